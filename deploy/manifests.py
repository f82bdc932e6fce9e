"""Kubernetes objects serving the winner, built with the `kubernetes` client models.

`build(cfg, best)` returns `[(file name, document dict), ...]` in apply order (Namespace first).
Documents are plain camelCase dicts (`ApiClient.sanitize_for_serialization`), so validation,
YAML output and server-side apply all see exactly the same data.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass

import yaml
from kubernetes import client as k

from tuner.schema.fit import builtin_memory_gib, max_model_len, startup_budget_s, tensor_parallel_size
from tuner.schema.flags import builtin_args, sglang_args, vllm_args
from deploy.winner import MODEL_DIR, Served, WinnerOverride, served_spec
from tuner.schema.config import BestResult, Config, HardwareConfig, UserError

PORT_NAME = "http"
HEALTH_PATH = "/health"
METRICS_PATH = "/metrics"
FIELD_MANAGER = "spectune"
BUILTIN_UID = 1000  # the spectune image runs as this non-root user; vLLM/SGLang images run as root
COMMANDS = {"vllm": ["vllm", "serve"], "sglang": ["python3", "-m", "sglang.launch_server"], "builtin": ["tuner", "serve"]}
STARTUP_PERIOD_S = 10


@dataclass(frozen=True)
class Plan:
    """Everything derived from the config before objects are built (also shown in the ConfigMap)."""

    cfg: Config
    best: BestResult | None
    served: Served
    tp: int
    max_len: int
    command: list[str]
    args: list[str]
    startup_s: int


def plan(cfg: Config, best: BestResult | None, override: WinnerOverride | None = None) -> Plan:
    """Resolve spec, tensor parallel size (fit check), context length and the engine command line
    (`override`: the winner with spec.* overrides, deploy.winner.served_spec)."""
    d, m = cfg.deploy, cfg.model
    if d.hpa.enabled and d.hpa.min_replicas > d.hpa.max_replicas:
        raise UserError(f"deploy.hpa.min_replicas={d.hpa.min_replicas} > deploy.hpa.max_replicas={d.hpa.max_replicas}")
    # With an HPA, deploy.replicas is its floor: a floor it cannot keep is refused, not adjusted.
    # Without one the Deployment carries the count as given (0: rendered with no pods).
    if d.hpa.enabled and d.replicas == 0:
        raise UserError(f"deploy.replicas=0 with deploy.hpa.enabled=true: the HPA keeps at least "
                        f"deploy.hpa.min_replicas={d.hpa.min_replicas} pod(s); for a Deployment with no pods set "
                        "deploy.hpa.enabled=false, else give deploy.replicas >= 1")
    if d.hpa.enabled and d.replicas > d.hpa.max_replicas:
        raise UserError(f"deploy.replicas={d.replicas} exceeds deploy.hpa.max_replicas={d.hpa.max_replicas} (with an "
                        f"HPA deploy.replicas is its floor): raise deploy.hpa.max_replicas to at least {d.replicas}, "
                        "or set deploy.hpa.enabled=false for a fixed count")
    if d.target != "builtin" and cfg.hardware.accelerator != "cuda":
        raise UserError(f"deploy={d.target} with hardware={cfg.hardware.name}: a GPU target needs a cuda hardware profile "
                        "(or render deploy=builtin for CPU clusters)")
    served = served_spec(cfg, best, override)
    # The built-in server runs on CPU nodes without tensor parallelism.
    tp = 1 if d.target == "builtin" else tensor_parallel_size(m, cfg.hardware, d)
    max_len = max_model_len(m, cfg.hardware, d, tp)
    quant = None if d.quantization == "none" else d.quantization
    if d.target == "vllm":
        args = vllm_args(m.hf_id, served.spec, dtype="auto", max_model_len=max_len, tensor_parallel_size=tp,
                         quantization=quant, kv_cache_dtype=d.kv_cache_dtype,
                         gpu_memory_utilization=d.gpu_memory_utilization, served_model_name=m.name,
                         host="0.0.0.0", port=d.port, extra_args=d.extra_args)
    elif d.target == "sglang":
        args = sglang_args(m.hf_id, served.spec, tp=tp, quantization=quant, kv_cache_dtype=d.kv_cache_dtype,
                           host="0.0.0.0", port=d.port, context_length=max_len,
                           mem_fraction_static=d.gpu_memory_utilization, served_model_name=m.name,
                           extra_args=d.extra_args)
    else:
        e = cfg.engine.builtin
        fp8 = quant == "fp8" or e.fp8_weights
        builtin_memory_gib(m, cfg.hardware, e.dtype, fp8)
        args = builtin_args(m.name, served.spec, host="0.0.0.0", port=d.port, dtype=e.dtype, fp8_weights=fp8,
                            extra_args=[f"cache_dir={MODEL_DIR}/spectune", *d.extra_args])
    return Plan(cfg=cfg, best=best, served=served, tp=tp, max_len=max_len, command=COMMANDS[d.target],
                args=args, startup_s=startup_budget_s(m, d))


def _labels(p: Plan) -> dict[str, str]:
    return {**_selector(p), "app.kubernetes.io/component": "inference", "app.kubernetes.io/managed-by": FIELD_MANAGER,
            "spectune.dev/target": p.cfg.deploy.target}


def _selector(p: Plan) -> dict[str, str]:
    return {"app.kubernetes.io/name": "spectune", "app.kubernetes.io/instance": p.cfg.deploy.name}


def _meta(p: Plan, name: str | None = None, **extra: object) -> k.V1ObjectMeta:
    d = p.cfg.deploy
    return k.V1ObjectMeta(name=name or d.name, namespace=d.namespace, labels=_labels(p), **extra)


def _figure(v: float | None, fmt: str = "{:.3g}") -> str:
    return "" if v is None else fmt.format(v)


def configmap_data(p: Plan) -> dict[str, str]:
    """The winning config and its provenance, as ConfigMap string values."""
    b, d = p.best, p.cfg.deploy
    served = {
        "target": d.target,
        "model": p.cfg.model.hf_id,
        "hardware": p.cfg.hardware.name,
        "tensor_parallel_size": p.tp,
        "max_model_len": p.max_len,
        "spec": p.served.spec.model_dump(mode="json"),
        "tuned_spec": p.served.tuned.model_dump(mode="json"),
        "notes": list(p.served.notes),
        "command": p.command + p.args,
    }
    pj = b.projection if b is not None else None
    data = {
        "served.yaml": yaml.safe_dump(served, sort_keys=False, width=10**6),
        "spec": p.served.spec.key(),
        "source": "projection" if pj else "best.yaml" if b else "config overrides",
    }
    if b is not None:
        # a projected configuration is no run's best.yaml: its record goes under its own name
        data["projected.yaml" if pj else "best.yaml"] = yaml.safe_dump(b.model_dump(mode="json", exclude_none=True),
                                                                       sort_keys=False, width=10**6)
        pv, mt = b.provenance, b.metrics
        data.update({
            "study": pv.study, "trial": "" if pv.trial is None else str(pv.trial), "date": pv.date,
            "tuned_hardware": pv.hardware, "tuned_engine": pv.engine, "workload": pv.workload,
            "tau": _figure(mt.tau if mt else None),
            "output_tokens_per_s": _figure(mt.output_tokens_per_s if mt else None, "{:.1f}"),
            "output_tokens_per_s_ci": (f"[{mt.ci_low:.1f}, {mt.ci_high:.1f}]"
                                       if mt and mt.ci_low is not None and mt.ci_high is not None else ""),
            "speedup": _figure(b.speedup),
        })
    if pj is not None:  # predicted on a hardware profile, not measured: say so, and from what
        data.update({
            "projected": "true", "projected_hardware": pj.hardware, "projected_from_run": pj.run,
            "profile": pj.profile, "acceptance": pj.acceptance, "cost_model": pj.cost_model,
            "predicted_at_concurrency": ",".join(str(c) for c in pj.concurrency),
            "predicted_speedup": _figure(pj.predicted_speedup), "predicted_tpot_ms": _figure(pj.predicted_tpot_ms),
            "measured_spec": pj.measured_spec or "",
        })
    return data


def _resources(p: Plan) -> k.V1ResourceRequirements:
    """GPUs = TP; CPU and memory: half of the node's per-GPU share (all of a CPU node's cores)."""
    hw = p.cfg.hardware
    if hw.accelerator == "cuda" and p.cfg.deploy.target != "builtin":
        share = p.tp / hw.gpu_count
        cpu, mem = max(2, int(hw.cpu_cores * share / 2)), max(8, int(hw.memory_gib * share / 2))
        gpus = {hw.gpu_resource: str(p.tp)}
    else:
        e = p.cfg.engine.builtin
        cpu, gpus = hw.cpu_cores, {}
        mem = builtin_memory_gib(p.cfg.model, hw, e.dtype, p.cfg.deploy.quantization == "fp8" or e.fp8_weights)
    return k.V1ResourceRequirements(requests={"cpu": str(cpu), "memory": f"{mem}Gi", **gpus},
                                    limits={"memory": f"{mem}Gi", **gpus})


def _probe(p: Plan, period: int, failures: int) -> k.V1Probe:
    return k.V1Probe(http_get=k.V1HTTPGetAction(path=HEALTH_PATH, port=PORT_NAME), period_seconds=period,
                     timeout_seconds=5, failure_threshold=failures)


def _env(p: Plan) -> list[k.V1EnvVar]:
    env = [k.V1EnvVar(name="HF_HOME", value=f"{MODEL_DIR}/hf")]
    sec = p.cfg.deploy.hf_token_secret
    if sec is not None:  # by reference only: the token value never appears in a manifest
        env.append(k.V1EnvVar(name="HF_TOKEN", value_from=k.V1EnvVarSource(
            secret_key_ref=k.V1SecretKeySelector(name=sec.name, key=sec.key))))
    if p.cfg.deploy.target == "vllm":
        env.append(k.V1EnvVar(name="VLLM_NO_USAGE_STATS", value="1"))
    return env


def security_contexts(non_root_uid: int | None) -> tuple[k.V1PodSecurityContext, k.V1SecurityContext]:
    """Pod and container security contexts: no privilege, no capabilities, RuntimeDefault seccomp;
    with a uid, the pod runs as that non-root user (and group, owning its volumes)."""
    seccomp = k.V1SeccompProfile(type="RuntimeDefault")
    container = k.V1SecurityContext(
        allow_privilege_escalation=False, privileged=False, capabilities=k.V1Capabilities(drop=["ALL"]),
        seccomp_profile=seccomp, run_as_non_root=True if non_root_uid is not None else None)
    pod = k.V1PodSecurityContext(seccomp_profile=seccomp)
    if non_root_uid is not None:
        pod = k.V1PodSecurityContext(run_as_non_root=True, run_as_user=non_root_uid, run_as_group=non_root_uid,
                                     fs_group=non_root_uid, seccomp_profile=seccomp)
    return pod, container


def gpu_placement(hw: HardwareConfig) -> tuple[dict[str, str] | None, list[k.V1Toleration] | None]:
    """Node selector and toleration that put a pod on the hardware profile's GPU nodes."""
    if hw.accelerator != "cuda":
        return None, None
    return ({"nvidia.com/gpu.product": hw.gpu_product},
            [k.V1Toleration(key=hw.gpu_resource, operator="Exists", effect="NoSchedule")])


def deployment(p: Plan, config_hash: str) -> k.V1Deployment:
    d, hw = p.cfg.deploy, p.cfg.hardware
    gpu = d.target != "builtin"
    non_root = d.target == "builtin"
    pod_sc, container_sc = security_contexts(BUILTIN_UID if non_root else None)
    container = k.V1Container(
        name="server",
        image=f"{d.image}:{d.image_tag}",
        image_pull_policy="IfNotPresent",
        command=p.command,
        args=p.args,
        env=_env(p),
        ports=[k.V1ContainerPort(name=PORT_NAME, container_port=d.port, protocol="TCP")],
        resources=_resources(p),
        volume_mounts=[k.V1VolumeMount(name="model-cache", mount_path=MODEL_DIR),
                       k.V1VolumeMount(name="dshm", mount_path="/dev/shm")],
        startup_probe=_probe(p, STARTUP_PERIOD_S, math.ceil(p.startup_s / STARTUP_PERIOD_S)),
        liveness_probe=_probe(p, 10, 3),
        readiness_probe=_probe(p, 5, 3),
        security_context=container_sc,
    )
    node_selector, tolerations = gpu_placement(hw) if gpu else (None, None)
    # Hub drafters the server loads from a directory: fetched into the model volume first (the
    # image's `hf` CLI, the same HF_HOME / HF_TOKEN as the server).
    fetch = [k.V1Container(
        name=f"fetch-draft-{i}" if i else "fetch-draft", image=container.image, image_pull_policy="IfNotPresent",
        command=["hf", "download", repo, "--local-dir", path], env=_env(p),
        volume_mounts=[k.V1VolumeMount(name="model-cache", mount_path=MODEL_DIR)],
        resources=k.V1ResourceRequirements(requests={"cpu": "100m", "memory": "256Mi"}, limits={"memory": "1Gi"}),
        security_context=container_sc) for i, (repo, path) in enumerate(p.served.fetches)]
    pod = k.V1PodSpec(
        init_containers=fetch or None,
        containers=[container],
        security_context=pod_sc,
        # Service env vars (e.g. VLLM_PORT from a Service named 'vllm') confuse the engines.
        enable_service_links=False,
        automount_service_account_token=False,
        termination_grace_period_seconds=60,
        volumes=[
            k.V1Volume(name="model-cache", persistent_volume_claim=k.V1PersistentVolumeClaimVolumeSource(
                claim_name=f"{d.name}-model-cache")),
            # NCCL / tensor-parallel workers share memory through /dev/shm; the default 64Mi is too small.
            k.V1Volume(name="dshm", empty_dir=k.V1EmptyDirVolumeSource(medium="Memory",
                                                                        size_limit="16Gi" if gpu else "1Gi")),
        ],
        node_selector=node_selector,
        tolerations=tolerations,
    )
    annotations = {"prometheus.io/scrape": "true", "prometheus.io/port": str(d.port),
                   "prometheus.io/path": METRICS_PATH, "spectune.dev/config-hash": config_hash}
    # A GPU node rarely has a spare GPU for a surge pod: replace pods one at a time instead.
    strategy = k.V1DeploymentStrategy(type="RollingUpdate", rolling_update=k.V1RollingUpdateDeployment(
        max_surge=0, max_unavailable=1)) if gpu else None
    return k.V1Deployment(
        api_version="apps/v1", kind="Deployment", metadata=_meta(p),
        spec=k.V1DeploymentSpec(
            # With an HPA the replica count is the HPA's: a replicas field here would be reset on every apply.
            replicas=None if d.hpa.enabled else d.replicas, strategy=strategy,
            selector=k.V1LabelSelector(match_labels=_selector(p)),
            template=k.V1PodTemplateSpec(metadata=k.V1ObjectMeta(labels=_labels(p), annotations=annotations),
                                         spec=pod)))


def hpa_bounds(p: Plan) -> tuple[int, int]:
    """HPA min/max replicas: deploy.replicas is a floor (e.g. a CI override `deploy.replicas=3`), at
    most deploy.hpa.max_replicas (plan() refuses a higher one)."""
    h = p.cfg.deploy.hpa
    return max(h.min_replicas, p.cfg.deploy.replicas), h.max_replicas


def _max_pods(p: Plan) -> int:
    return hpa_bounds(p)[1] if p.cfg.deploy.hpa.enabled else p.cfg.deploy.replicas


def service_monitor(p: Plan) -> dict:
    """monitoring.coreos.com/v1 ServiceMonitor (a CRD: no client model; checked by deploy/schemas)."""
    d = p.cfg.deploy
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": {"name": d.name, "namespace": d.namespace, "labels": _labels(p)},
        "spec": {
            "selector": {"matchLabels": _selector(p)},
            "namespaceSelector": {"matchNames": [d.namespace]},
            "endpoints": [{"port": PORT_NAME, "path": METRICS_PATH, "interval": "15s", "scheme": "http"}],
        },
    }


def build(cfg: Config, best: BestResult | None = None,
          override: WinnerOverride | None = None) -> tuple[Plan, list[tuple[str, dict]]]:
    """All documents for cfg.deploy.target, in apply order, as (file name, camelCase dict)."""
    p = plan(cfg, best, override)
    d = cfg.deploy
    api = k.ApiClient()
    data = configmap_data(p)
    config_hash = hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]
    objs: list[tuple[str, object]] = [
        ("namespace.yaml", k.V1Namespace(api_version="v1", kind="Namespace", metadata=k.V1ObjectMeta(
            name=d.namespace, labels={"app.kubernetes.io/managed-by": FIELD_MANAGER}))),
        ("configmap.yaml", k.V1ConfigMap(api_version="v1", kind="ConfigMap", metadata=_meta(p, f"{d.name}-winner"),
                                         data=data)),
        ("pvc.yaml", k.V1PersistentVolumeClaim(
            api_version="v1", kind="PersistentVolumeClaim", metadata=_meta(p, f"{d.name}-model-cache"),
            spec=k.V1PersistentVolumeClaimSpec(
                # Several pods on several nodes can only share the cache through a ReadWriteMany volume.
                access_modes=["ReadWriteMany" if _max_pods(p) > 1 else "ReadWriteOnce"],
                storage_class_name=d.storage_class,
                resources=k.V1VolumeResourceRequirements(requests={"storage": d.model_cache_size})))),
        ("deployment.yaml", deployment(p, config_hash)),
        ("service.yaml", k.V1Service(api_version="v1", kind="Service", metadata=_meta(p), spec=k.V1ServiceSpec(
            type="ClusterIP", selector=_selector(p),
            ports=[k.V1ServicePort(name=PORT_NAME, port=d.port, target_port=PORT_NAME, protocol="TCP")]))),
    ]
    if d.service_monitor:
        objs.append(("servicemonitor.yaml", service_monitor(p)))
    if d.pdb_min_available > 0:
        objs.append(("pdb.yaml", k.V1PodDisruptionBudget(
            api_version="policy/v1", kind="PodDisruptionBudget", metadata=_meta(p),
            spec=k.V1PodDisruptionBudgetSpec(min_available=d.pdb_min_available,
                                             selector=k.V1LabelSelector(match_labels=_selector(p))))))
    if d.hpa.enabled:
        objs.append(("hpa.yaml", k.V2HorizontalPodAutoscaler(
            api_version="autoscaling/v2", kind="HorizontalPodAutoscaler", metadata=_meta(p),
            spec=k.V2HorizontalPodAutoscalerSpec(
                scale_target_ref=k.V2CrossVersionObjectReference(api_version="apps/v1", kind="Deployment", name=d.name),
                min_replicas=hpa_bounds(p)[0], max_replicas=hpa_bounds(p)[1],
                metrics=[k.V2MetricSpec(type="Pods", pods=k.V2PodsMetricSource(
                    metric=k.V2MetricIdentifier(name=d.hpa.metric),
                    target=k.V2MetricTarget(type="AverageValue", average_value=d.hpa.target_average)))]))))
    docs = [(name, obj if isinstance(obj, dict) else api.sanitize_for_serialization(obj)) for name, obj in objs]
    return p, docs
