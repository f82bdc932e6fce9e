"""deploy.platform=lws: a LeaderWorkerSet for a model that needs more than one node.

One group of `nodes` pods serves one replica: the leader (worker index 0) runs the API server and
the engine's first rank, each worker joins it. vLLM uses its native multi-node launch (`--nnodes
--node-rank --master-addr`, workers `--headless`: no API server) with tensor parallelism inside a
node and pipeline parallelism across nodes; SGLang its `--nnodes --node-rank --dist-init-addr` with
one tensor-parallel group over every GPU of the group. The LWS controller sets LWS_LEADER_ADDRESS
and LWS_WORKER_INDEX in every container; Kubernetes expands `$(VAR)` in args from them.
"""

from __future__ import annotations

import copy
from dataclasses import replace

from kubernetes import client as k

from deploy.manifests import Plan, deployment, plan
from deploy.winner import WinnerOverride
from tuner.schema.config import BestResult, Config, UserError

# leaderworkerset.x-k8s.io/v1: the version LWS v0.6+ serves (and stores); v1 since LWS v0.3.
API_VERSION = "leaderworkerset.x-k8s.io/v1"
KIND = "LeaderWorkerSet"
SGLANG_DIST_PORT = 5000  # the leader's torch.distributed rendezvous port for SGLang workers
LEADER_ADDRESS = "$(LWS_LEADER_ADDRESS)"
WORKER_INDEX = "$(LWS_WORKER_INDEX)"
MAX_NODES = 16


def nodes_needed(cfg: Config) -> int:
    """How many nodes of cfg.hardware the model needs: 1 when the one-node fit check passes, else the
    fewest whose GPUs together hold it (the same fit rule over nodes x gpu_count GPUs)."""
    from tuner.schema.fit import tensor_parallel_size

    hw = cfg.hardware
    for nodes in range(1, MAX_NODES + 1):
        try:
            tp = tensor_parallel_size(cfg.model, hw.model_copy(update={"gpu_count": hw.gpu_count * nodes}), cfg.deploy)
        except UserError:
            continue
        return max(1, -(-tp // hw.gpu_count))
    # the one-node error names the model, the hardware and what to change
    tensor_parallel_size(cfg.model, hw, cfg.deploy)
    raise AssertionError("unreachable: the one-node fit check raised above")


def multinode_plan(cfg: Config, best: BestResult | None, override: WinnerOverride | None,
                   nodes: int) -> tuple[Plan, list[str], list[str]]:
    """The plan of one node of a `nodes`-node group (its GPUs, TP per node) and the engine args of
    the leader and of a worker."""
    hw = cfg.hardware
    wide = cfg.model_copy(update={"hardware": hw.model_copy(update={"gpu_count": hw.gpu_count * nodes})})
    p = plan(wide, best, override)  # the engine command over all GPUs of the group
    per_node = p.tp // nodes
    args = list(p.args)
    if cfg.deploy.target == "vllm":
        at = args.index("--tensor-parallel-size") + 1
        args[at] = str(per_node)
        common = args + ["--pipeline-parallel-size", str(nodes), "--nnodes", str(nodes),
                         "--master-addr", LEADER_ADDRESS]
        leader = common + ["--node-rank", "0"]
        worker = common + ["--node-rank", WORKER_INDEX, "--headless"]
    else:  # sglang: one TP group over every GPU of the group
        common = args + ["--nnodes", str(nodes), "--dist-init-addr", f"{LEADER_ADDRESS}:{SGLANG_DIST_PORT}"]
        leader = common + ["--node-rank", "0"]
        worker = common + ["--node-rank", WORKER_INDEX]
    return replace(p, cfg=cfg, tp=per_node, args=leader), leader, worker


def leader_worker_set(p: Plan, worker_args: list[str], nodes: int, config_hash: str) -> dict:
    """The LeaderWorkerSet: the Deployment's pod template for the leader (serving, probed) and the
    same pod with the worker's args and no HTTP probes (a headless worker serves nothing)."""
    d = p.cfg.deploy
    api = k.ApiClient()
    dep = api.sanitize_for_serialization(deployment(p, config_hash))
    leader = dep["spec"]["template"]
    worker = copy.deepcopy(leader)
    c = worker["spec"]["containers"][0]
    c["args"] = worker_args
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        c.pop(probe, None)
    c.pop("ports", None)
    spec: dict = {
        "startupPolicy": "LeaderCreated",
        "leaderWorkerTemplate": {
            "size": nodes,
            # one pod of a group restarting restarts the group: the engine's ranks cannot rejoin alone
            "restartPolicy": "RecreateGroupOnPodRestart",
            "leaderTemplate": leader,
            "workerTemplate": worker,
        },
    }
    if d.autoscaler == "none":
        spec = {"replicas": d.replicas, **spec}
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": dep["metadata"], "spec": spec}


def leader_selector(p: Plan) -> dict[str, str]:
    """Labels of the leader pods (the ones serving HTTP): the Service selects these only."""
    from deploy.manifests import _selector

    return {**_selector(p), "leaderworkerset.sigs.k8s.io/worker-index": "0"}
