"""deploy.platform=kserve: a KServe LLMInferenceService serving the winner.

The pod is the Deployment's, with the same engine command: KServe has no speculative-decoding
field yet (kserve#5687), so the speculative flags travel in the container args. The container is
named `main`, the name KServe's presets merge a template onto. The model is downloaded by the
engine into the model volume (HF_HOME) as in the Deployment, so KServe's storage initializer is
switched off. Autoscaling is KServe's own `spec.scaling` (a KEDA trigger); the inference gateway
is its `spec.router` (KServe creates the InferencePool, the endpoint picker and the HTTPRoute).
"""

from __future__ import annotations

from kubernetes import client as k

from deploy.keda import prometheus_trigger
from deploy.manifests import Plan, deployment

# serving.kserve.io/v1alpha2: the version KServe v0.21 stores (v1alpha1 is still served).
API_VERSION = "serving.kserve.io/v1alpha2"
KIND = "LLMInferenceService"
CONTAINER = "main"


def llm_inference_service(p: Plan, config_hash: str) -> dict:
    """The LLMInferenceService of plan `p` (a single-node model: TP GPUs in one pod)."""
    d, m = p.cfg.deploy, p.cfg.model
    dep = k.ApiClient().sanitize_for_serialization(deployment(p, config_hash))
    tmpl = dep["spec"]["template"]
    pod = tmpl["spec"]
    pod["containers"][0]["name"] = CONTAINER
    spec: dict = {
        "model": {"uri": f"hf://{m.hf_id}", "name": m.name},
        "parallelism": {"tensor": p.tp},
        # the pods' labels: the Service, the ServiceMonitor and an InferencePool select them
        "labels": tmpl["metadata"]["labels"],
        "annotations": tmpl["metadata"]["annotations"],
        "storageInitializer": {"enabled": False},
        "template": pod,
    }
    if d.autoscaler == "keda":
        lo, hi = max(d.hpa.min_replicas, d.replicas), d.hpa.max_replicas
        spec["scaling"] = {"minReplicas": lo, "maxReplicas": hi, "keda": {"triggers": [prometheus_trigger(p)]}}
    else:  # replicas and scaling are mutually exclusive in the CRD
        spec["replicas"] = d.replicas
    if d.gateway == "inference-pool":
        spec["router"] = {"route": {}, "gateway": {"refs": [{"name": d.gateway_name}]}, "scheduler": {}}
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": dep["metadata"], "spec": spec}
