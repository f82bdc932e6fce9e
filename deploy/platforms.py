"""Every object a render writes, for deploy.platform, deploy.autoscaler and deploy.gateway, and what
the cluster must already have for them.

deploy.manifests builds the Deployment set (the default); this module swaps the workload for a
KServe LLMInferenceService or a LeaderWorkerSet and adds the KEDA ScaledObject, the inference
gateway's InferencePool and HTTPRoute, and the PrometheusRule and dashboard of vLLM / SGLang.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, replace

from kubernetes import client as k

from deploy import gateway, keda, kserve, lws, monitoring
from deploy.manifests import (KeyPath, Plan, build as build_deployment, comments as deployment_comments, configmap_data,
                              deployment)
from deploy.winner import WinnerOverride
from tuner.schema.config import BestResult, Config, UserError

POD = ("spec", "template", "spec")  # the pod spec's path in a Deployment


@dataclass
class Rendered:
    """A render's documents in apply order, their comments, and the lines to say about them."""

    plan: Plan
    docs: list[tuple[str, dict]]
    comments: dict[str, dict[KeyPath, str]]
    notes: list[str] = field(default_factory=list)
    nodes: int = 1


def _refuse(cfg: Config) -> None:
    d = cfg.deploy
    if d.platform != "deployment" and d.target == "builtin":
        raise UserError(f"deploy.platform={d.platform} with deploy=builtin: the built-in CPU server renders as a "
                        "Deployment only (deploy.platform=deployment); KServe and LeaderWorkerSet serve vLLM or SGLang")
    if d.platform == "kserve" and d.autoscaler == "hpa":
        raise UserError("deploy.platform=kserve with deploy.autoscaler=hpa: an LLMInferenceService scales through "
                        "its own spec.scaling (KEDA); use deploy.autoscaler=keda or deploy.autoscaler=none")


def _hash(data: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def _replace(docs: list[tuple[str, dict]], old: str, new: str, doc: dict) -> list[tuple[str, dict]]:
    return [(new, doc) if name == old else (name, d) for name, d in docs]


def _move_pod_comments(com: dict[KeyPath, str], prefix: KeyPath, keep_args: bool = True) -> dict[KeyPath, str]:
    """The Deployment's comments on its pod spec, at the pod spec's path in another object."""
    out = {}
    for path, note in com.items():
        if path[:len(POD)] == POD and (keep_args or "args" not in path):
            out[(*prefix, *path[len(POD):])] = note
    return out


def build(cfg: Config, best: BestResult | None = None, override: WinnerOverride | None = None) -> Rendered:
    """All documents of a render of cfg (deploy.platform, .autoscaler, .gateway), in apply order."""
    _refuse(cfg)
    d = cfg.deploy
    notes: list[str] = []
    nodes = lws.nodes_needed(cfg) if d.platform == "lws" else 1
    if d.platform == "lws" and nodes == 1:
        notes.append(f"deploy.platform=lws: {cfg.model.name} fits one node of hardware {cfg.hardware.name}, so it is "
                     "rendered as a Deployment (a LeaderWorkerSet is for a model that needs several nodes)")
    if nodes == 1:
        p, docs = build_deployment(cfg, best, override)
        com = deployment_comments(p, docs)
    else:
        p, docs, com = _multinode(cfg, best, override, nodes)
    byname = dict(docs)
    config_hash = (byname["deployment.yaml"]["spec"]["template"]["metadata"]["annotations"]["spectune.dev/config-hash"]
                   if "deployment.yaml" in byname else "")
    selector = {"app.kubernetes.io/name": "spectune", "app.kubernetes.io/instance": d.name}
    if d.platform == "kserve":
        docs = _replace(docs, "deployment.yaml", "llminferenceservice.yaml", kserve.llm_inference_service(p, config_hash))
        com["llminferenceservice.yaml"] = _move_pod_comments(com.pop("deployment.yaml"), ("spec", "template"))
        if d.autoscaler == "keda":
            com["llminferenceservice.yaml"][("spec", "scaling", "keda", "triggers", 0, "metadata", "threshold")] = \
                keda.threshold_source(p)
    elif nodes > 1:
        selector = lws.leader_selector(p)
    target = (lws.API_VERSION, lws.KIND) if nodes > 1 else ("apps/v1", "Deployment")
    if d.autoscaler == "keda" and d.platform != "kserve":
        docs.append(("scaledobject.yaml", keda.scaled_object(p, *target)))
        com["scaledobject.yaml"] = {("spec", "triggers", 0, "metadata", "threshold"): keda.threshold_source(p)}
    if d.gateway == "inference-pool" and d.platform != "kserve":
        docs += [("inferencepool.yaml", gateway.inference_pool(p, selector)), ("httproute.yaml", gateway.http_route(p))]
        com["inferencepool.yaml"] = {("spec", "endpointPickerRef", "name"):
                                     f"the cluster's endpoint picker Service (port {gateway.EPP_PORT}): see README.md"}
    if d.target in ("vllm", "sglang"):
        if d.alerts.enabled:
            rule = monitoring.prometheus_rule(p)
            if rule is not None:
                docs.append(("prometheusrule.yaml", rule))
            notes += monitoring.alert_rules(p)[1]
        docs.append(("dashboard.yaml", monitoring.dashboard_configmap(p)))
    r = Rendered(plan=p, docs=docs, comments=com, notes=notes, nodes=nodes)
    r.plan = replace(p, platform_notes=tuple(notes), prerequisites=tuple(prerequisites(r)), nodes=nodes)
    return r


def _multinode(cfg: Config, best: BestResult | None, override: WinnerOverride | None,
               nodes: int) -> tuple[Plan, list[tuple[str, dict]], dict[str, dict[KeyPath, str]]]:
    """The Deployment set over a `nodes`-node group, its Deployment swapped for a LeaderWorkerSet."""
    d, hw = cfg.deploy, cfg.hardware
    p, leader, worker = lws.multinode_plan(cfg, best, override, nodes)
    wide = cfg.model_copy(update={"hardware": hw.model_copy(update={"gpu_count": hw.gpu_count * nodes})})
    _, docs = build_deployment(wide, best, override)  # the objects around the workload
    data = {**configmap_data(p), "nodes": str(nodes)}
    config_hash = _hash(data)
    byname = dict(docs)
    byname["configmap.yaml"]["data"] = data
    byname["service.yaml"]["spec"]["selector"] = lws.leader_selector(p)
    if "hpa.yaml" in byname:
        byname["hpa.yaml"]["spec"]["scaleTargetRef"] = {"apiVersion": lws.API_VERSION, "kind": lws.KIND, "name": d.name}
    docs = _replace(docs, "deployment.yaml", "leaderworkerset.yaml", lws.leader_worker_set(p, worker, nodes, config_hash))
    # comments as for one node's Deployment, less the engine args (the group's, said below)
    one = k.ApiClient().sanitize_for_serialization(deployment(p, config_hash))
    com = deployment_comments(p, [(n, one if n == "leaderworkerset.yaml" else doc) for n, doc in docs]
                              + [("deployment.yaml", one)])
    pod_com = com.pop("deployment.yaml")
    gpu = ("resources", "requests", hw.gpu_resource)
    why = (f"{nodes} nodes x {p.tp} GPUs: {cfg.model.name} does not fit one node of hardware {hw.name} "
           f"(the fit check over {nodes} x {hw.gpu_count} GPUs; each pod is one node)")
    lw = ("spec", "leaderWorkerTemplate")
    com["leaderworkerset.yaml"] = {
        **_move_pod_comments({k_: v for k_, v in pod_com.items() if gpu[-1] not in k_}, (*lw, "leaderTemplate", "spec"),
                             keep_args=False),
        (*lw, "size"): why,
        (*lw, "leaderTemplate", "spec", "containers", 0, "args"): (
            "the leader: API server and the engine's rank 0" + ("; TP inside a node, PP across nodes"
                                                                  if d.target == "vllm" else "; one TP group")),
        (*lw, "workerTemplate", "spec", "containers", 0, "args"): "a worker joins the leader (LWS_WORKER_INDEX is its rank)",
    }
    return p, docs, com


def prerequisites(r: Rendered) -> list[str]:
    """What the cluster must already have for these documents, one line each."""
    p, d, hw = r.plan, r.plan.cfg.deploy, r.plan.cfg.hardware
    names = {n for n, _ in r.docs}
    out = []
    if not d.create_namespace:
        out.append(f"the namespace {d.namespace} (kubectl create namespace {d.namespace}; or render with "
                   "deploy.create_namespace=true)")
    if d.hf_token_secret is not None:
        s = d.hf_token_secret
        out.append(f"a Secret {s.name} with key {s.key} in {d.namespace}: the Hugging Face token for gated models "
                   f"(kubectl -n {d.namespace} create secret generic {s.name} --from-literal={s.key}=hf_...)")
    if hw.accelerator == "cuda" and d.target != "builtin":
        out.append(f"GPU nodes labelled nvidia.com/gpu.product={hw.gpu_product} (GPU Feature Discovery, e.g. the "
                   f"NVIDIA GPU Operator) whose device plugin offers {hw.gpu_resource}")
    if d.storage_class or d.model_cache_access_mode == "ReadWriteMany":
        out.append(f"a StorageClass {d.storage_class or '(the default)'} offering {d.model_cache_access_mode}")
    if "servicemonitor.yaml" in names or "prometheusrule.yaml" in names:
        sel = ",".join(f"{k}={v}" for k, v in d.monitor_labels.items())
        out.append(f"the Prometheus Operator (monitoring.coreos.com/v1 CRDs) selecting ServiceMonitors and "
                   f"PrometheusRules labelled {sel} (deploy.monitor_labels)")
    if "dashboard.yaml" in names:
        out.append("Grafana with its dashboard sidecar watching ConfigMaps labelled grafana_dashboard=1")
    if "hpa.yaml" in names:
        out.append("prometheus-adapter serving the HPA's metric with the rule written at the top of hpa.yaml")
    if d.autoscaler == "keda":
        out.append(f"KEDA 2.x (keda.sh/v1alpha1), able to query Prometheus at {d.prometheus_url} "
                   "(deploy.prometheus_url)")
    if "leaderworkerset.yaml" in names:
        out.append("the LeaderWorkerSet controller (leaderworkerset.x-k8s.io/v1, LWS v0.6 or later)")
    if d.platform == "kserve":
        out.append(f"KServe with the LLMInferenceService CRD ({kserve.API_VERSION}, KServe v0.21 or later)")
    if d.gateway == "inference-pool":
        ns = d.gateway_namespace or d.namespace
        out.append(f"a Gateway {ns}/{d.gateway_name} of a Gateway API implementation that supports the inference "
                   "extension, with the InferencePool CRD (inference.networking.k8s.io/v1)")
        if d.platform != "kserve":
            out.append(f"an endpoint picker Service {gateway.epp_name(p)} on port {gateway.EPP_PORT} in {d.namespace} "
                       "(the inference extension's EPP, configured for the pool)")
    return out


def readme(r: Rendered, lines: list[str]) -> str:
    """README.md beside the manifests: what they are and what the cluster must already have."""
    d = r.plan.cfg.deploy
    files = "\n".join(f"- `{n}`: {doc['kind']} {doc['metadata']['name']}" for n, doc in r.docs)
    need = "\n".join(f"- {ln}" for ln in lines) or "- nothing beyond a Kubernetes cluster"
    return (f"# {d.name}: rendered by `tuner render` (spectune)\n\n"
            f"deploy={d.target}, deploy.platform={d.platform}, deploy.autoscaler={d.autoscaler}, "
            f"deploy.gateway={d.gateway}, spec `{r.plan.served.spec.key()}`. Apply with `kubectl apply -k .` or "
            "`tuner apply DIR`.\n\n"
            f"## Objects\n\n{files}\n\n"
            f"## What the cluster must already have\n\nNone of these is created or deleted by this kustomization.\n\n"
            f"{need}\n")
