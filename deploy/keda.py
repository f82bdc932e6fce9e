"""deploy.autoscaler=keda: a KEDA ScaledObject on the engine's waiting requests.

The trigger is KEDA's `prometheus` scaler over the series the ServiceMonitor scrapes
(deploy.hpa.metric, vLLM's `vllm:num_requests_waiting` or SGLang's `sglang:num_queue_reqs`),
summed over the serving pods; as an AverageValue metric KEDA divides it by the replica count, the
same per-pod target the HPA path uses (deploy.hpa.target_average), within deploy.hpa's bounds.
"""

from __future__ import annotations

from deploy.manifests import Plan, _meta

# keda.sh/v1alpha1: the version KEDA 2.x serves for ScaledObject (2.18 the current release line).
API_VERSION = "keda.sh/v1alpha1"
KIND = "ScaledObject"


def query(p: Plan) -> str:
    """The PromQL the trigger evaluates: the waiting requests of this server's pods, summed."""
    d = p.cfg.deploy
    return f'sum({d.hpa.metric}{{namespace="{d.namespace}",service="{d.name}"}})'


def threshold_source(p: Plan) -> str:
    """Where the per-pod threshold comes from (a manifest comment). best.yaml records no measured
    capacity (requests a pod serves within the SLOs), so it is the config's."""
    return (f"per-pod threshold from the config (deploy.hpa.target_average={p.cfg.deploy.hpa.target_average}): "
            "the study recorded no measured capacity")


def prometheus_trigger(p: Plan) -> dict:
    """KEDA's prometheus trigger on the waiting requests (also KServe's spec.scaling.keda)."""
    d = p.cfg.deploy
    return {"type": "prometheus", "metricType": "AverageValue",
            "metadata": {"serverAddress": d.prometheus_url, "query": query(p), "threshold": d.hpa.target_average}}


def scaled_object(p: Plan, target_api: str, target_kind: str) -> dict:
    """The ScaledObject scaling `target_kind` NAME (a Deployment or a LeaderWorkerSet)."""
    d = p.cfg.deploy
    meta = _meta(p).to_dict()
    return {
        "apiVersion": API_VERSION, "kind": KIND,
        "metadata": {"name": meta["name"], "namespace": meta["namespace"], "labels": meta["labels"]},
        "spec": {
            "scaleTargetRef": {"apiVersion": target_api, "kind": target_kind, "name": d.name},
            "minReplicaCount": max(d.hpa.min_replicas, d.replicas),
            "maxReplicaCount": d.hpa.max_replicas,
            "pollingInterval": 15,
            # a new pod loads the model for minutes: scale in slowly
            "cooldownPeriod": 300,
            "triggers": [prometheus_trigger(p)],
        },
    }
