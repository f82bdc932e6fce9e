"""deploy.autoscaler=keda: a KEDA ScaledObject.

The trigger is KEDA's `prometheus` scaler over the series the ServiceMonitor scrapes, summed over
the serving pods; as an AverageValue metric KEDA divides it by the replica count. With a capacity
the study measured for the served configuration (best.yaml, search.capacity=true) it scales on
finished requests per second at that capacity per pod; otherwise on the waiting requests
(deploy.hpa.metric, vLLM's `vllm:num_requests_waiting` or SGLang's `sglang:num_queue_reqs`) at
deploy.hpa.target_average per pod, as the HPA does. Either within deploy.hpa's bounds.
"""

from __future__ import annotations

from deploy.manifests import Plan, _meta

# keda.sh/v1alpha1: the version KEDA 2.x serves for ScaledObject (2.18 the current release line).
API_VERSION = "keda.sh/v1alpha1"
KIND = "ScaledObject"


def measured_capacity(p: Plan) -> float | None:
    """Requests/s one pod of the served configuration sustains within the workload's SLOs, as the
    study measured it (best.yaml capacity, search.capacity=true); None when it did not, or measured
    another configuration."""
    b = p.best
    if b is None or b.capacity is None or b.projection is not None or p.served.spec != b.spec:
        return None
    return b.capacity.winner_rps


def query(p: Plan) -> str:
    """The PromQL the trigger evaluates, summed over this server's pods: the finished requests per
    second when a capacity was measured, else the waiting requests (deploy.hpa.metric)."""
    d = p.cfg.deploy
    sel = f'namespace="{d.namespace}",service="{d.name}"'
    if measured_capacity(p) is not None:
        done = "sglang:num_requests_total" if d.target == "sglang" else "vllm:request_success_total"
        return f"sum(rate({done}{{{sel}}}[2m]))"
    return f"sum({d.hpa.metric}{{{sel}}})"


def threshold(p: Plan) -> str:
    """The per-pod target: the measured capacity (req/s), else deploy.hpa.target_average."""
    cap = measured_capacity(p)
    return p.cfg.deploy.hpa.target_average if cap is None else f"{cap:.3g}"


def threshold_source(p: Plan) -> str:
    """Where the per-pod threshold comes from (a manifest comment)."""
    cap = measured_capacity(p)
    if cap is not None:
        return (f"per-pod threshold from the measured capacity: {cap:.3g} req/s of {p.served.spec.key()} within the "
                "workload's SLOs (best.yaml capacity)")
    return (f"per-pod threshold from the config (deploy.hpa.target_average={p.cfg.deploy.hpa.target_average}): "
            "the study recorded no measured capacity of the served configuration (search.capacity=true records one)")


def prometheus_trigger(p: Plan) -> dict:
    """KEDA's prometheus trigger (also KServe's spec.scaling.keda)."""
    return {"type": "prometheus", "metricType": "AverageValue",
            "metadata": {"serverAddress": p.cfg.deploy.prometheus_url, "query": query(p), "threshold": threshold(p)}}


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
