"""deploy.gateway=inference-pool: the Gateway API inference extension's InferencePool selecting the
serving pods, and an HTTPRoute from the cluster's Gateway (deploy.gateway_name) to it.

The pool's endpoint picker (EPP) is the cluster's: a Service NAME-epp on port 9002, deployed with
the inference extension's endpoint picker (listed in the rendered README's prerequisites).
"""

from __future__ import annotations

from deploy.manifests import Plan, _meta

# inference.networking.k8s.io/v1: the InferencePool API the inference extension serves since v1.0.
POOL_API = "inference.networking.k8s.io/v1"
# gateway.networking.k8s.io/v1: HTTPRoute's GA version (Gateway API v1.0 and later).
ROUTE_API = "gateway.networking.k8s.io/v1"
EPP_PORT = 9002  # the endpoint picker's gRPC ext-proc port


def epp_name(p: Plan) -> str:
    return f"{p.cfg.deploy.name}-epp"


def _metadata(p: Plan) -> dict:
    meta = _meta(p).to_dict()
    return {"name": meta["name"], "namespace": meta["namespace"], "labels": meta["labels"]}


def inference_pool(p: Plan, selector: dict[str, str]) -> dict:
    """The InferencePool over the pods `selector` matches (the serving ones), on the server port."""
    return {
        "apiVersion": POOL_API, "kind": "InferencePool", "metadata": _metadata(p),
        "spec": {
            "selector": {"matchLabels": selector},
            "targetPorts": [{"number": p.cfg.deploy.port}],
            "endpointPickerRef": {"name": epp_name(p), "port": {"number": EPP_PORT}, "failureMode": "FailClose"},
        },
    }


def http_route(p: Plan) -> dict:
    """The HTTPRoute sending every path of the Gateway to the InferencePool."""
    d = p.cfg.deploy
    parent: dict = {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": d.gateway_name}
    if d.gateway_namespace:
        parent["namespace"] = d.gateway_namespace
    return {
        "apiVersion": ROUTE_API, "kind": "HTTPRoute", "metadata": _metadata(p),
        "spec": {
            "parentRefs": [parent],
            "rules": [{
                "matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
                "backendRefs": [{"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": d.name}],
                # a long generation streams for minutes: no gateway default cut-off
                "timeouts": {"request": "0s"},
            }],
        },
    }
