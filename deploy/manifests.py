"""Kubernetes objects serving the winner, built with the `kubernetes` client models.

`build(cfg, best)` returns `[(file name, document dict), ...]` in apply order (Namespace first).
Documents are plain camelCase dicts (`ApiClient.sanitize_for_serialization`), so validation,
YAML output and server-side apply all see exactly the same data.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass

import yaml
from kubernetes import client as k

from tuner.schema.fit import (builtin_memory_gib, max_model_len, max_model_len_why, startup_budget_s, startup_why,
                              tensor_parallel_size, tensor_parallel_why)
from tuner.schema.engine_command import (PROGRAMS, Place, check_engine_version, engine_command, pinned_version,
                                         server_differences, server_settings)
from deploy.winner import MODEL_DIR, Served, WinnerOverride, served_spec
from tuner.schema.flags import sglang_adaptive, sglang_adaptive_config
from tuner.schema.config import BestResult, Config, HardwareConfig, Projection, UserError, deploy_image

PORT_NAME = "http"
HEALTH_PATH = "/health"
METRICS_PATH = "/metrics"
FIELD_MANAGER = "spectune"
BUILTIN_UID = 1000  # the spectune image runs as this non-root user; vLLM/SGLang images run as root
COMMANDS = PROGRAMS  # each target's program, as its image has it
STARTUP_PERIOD_S = 10
# SGLang reads its adaptive knobs from a file: the winner ConfigMap's key, mounted here
ADAPTIVE_KEY = "sglang-adaptive.json"
ADAPTIVE_DIR = "/etc/spectune"


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
    env: dict[str, str]
    startup_s: int
    replicas_why: str | None = None  # deploy.target_rate: how the replica count was sized
    # set by deploy.platforms.build: lines about the platform chosen, and what the cluster must have
    platform_notes: tuple[str, ...] = ()
    prerequisites: tuple[str, ...] = ()
    nodes: int = 1  # pods (nodes) per replica: more than one in a LeaderWorkerSet


def plan(cfg: Config, best: BestResult | None, override: WinnerOverride | None = None) -> Plan:
    """Resolve spec, tensor parallel size (fit check), context length and the engine command line
    (`override`: the winner with spec.* overrides, deploy.winner.served_spec)."""
    d, m = cfg.deploy, cfg.model
    if d.target != "builtin" and cfg.hardware.accelerator != "cuda":
        raise UserError(f"deploy={d.target} with hardware={cfg.hardware.name}: a GPU target needs a cuda hardware profile "
                        "(or render deploy=builtin for CPU clusters)")
    if d.target == "builtin" and cfg.hardware.accelerator == "cuda":
        raise UserError(f"deploy=builtin with hardware={cfg.hardware.name}: the built-in server's pod runs on a CPU "
                        f"node in fp32 without the GPUs of {cfg.hardware.name}; render deploy=vllm or deploy=sglang "
                        "for a cuda hardware profile, or hardware=cpu for the built-in server")
    check_engine_version(cfg, best)
    served = served_spec(cfg, best, override)
    replicas_why = None
    if d.target_rate is not None:
        n, replicas_why = sized_replicas(d.target_rate, best, served)
        if d.hpa.enabled and n > d.hpa.max_replicas:
            raise UserError(f"deploy.target_rate={d.target_rate:g} needs {n} replicas ({replicas_why}), above "
                            f"deploy.hpa.max_replicas={d.hpa.max_replicas}: raise it to at least {n}")
        cfg = cfg.model_copy(update={"deploy": d.model_copy(update={"replicas": n})})
        d = cfg.deploy
    differs = server_differences(cfg, best)
    if differs:  # a CPU trial of a GPU deployment: said once, and kept in the ConfigMap's notes
        served = dataclasses.replace(served, notes=(*served.notes, differs))
    settings = server_settings(cfg, d.target)
    if d.target == "builtin":
        e = cfg.engine.builtin
        builtin_memory_gib(m, cfg.hardware, e.dtype, e.weights)
    place = pod_place(cfg)
    if d.target == "sglang" and served.spec.adaptive:
        place = dataclasses.replace(place, adaptive_config=f"{ADAPTIVE_DIR}/{ADAPTIVE_KEY}")
    argv, env = engine_command(settings, served.spec, place)
    # The built-in server runs on CPU nodes without tensor parallelism.
    tp = settings.tp
    max_len = max_model_len(m, cfg.hardware, d, tp) if d.target == "builtin" else settings.context_length
    program = len(PROGRAMS[d.target])
    return Plan(cfg=cfg, best=best, served=served, tp=tp, max_len=max_len or 0, command=argv[:program],
                args=argv[program:], env=env, startup_s=startup_budget_s(m, d), replicas_why=replicas_why)


def sized_replicas(target_rate: float, best: BestResult | None, served: Served) -> tuple[int, str]:
    """(replicas, why) for deploy.target_rate: ceil(target / the served configuration's capacity at
    the SLOs), the capacity best.yaml recorded (search.capacity=true). Refused when there is none
    for the configuration served: a replica count from another configuration's capacity is wrong."""
    cap = best.capacity if best is not None else None
    if cap is None:
        raise UserError(f"deploy.target_rate={target_rate:g} sizes replicas from the winner's capacity at the SLOs, "
                        "and best.yaml records none: run tuner optimize with search.capacity=true (or drop "
                        "deploy.target_rate and give deploy.replicas)")
    key = served.spec.key()
    rps, bounded = ((cap.winner_rps, cap.winner_bounded) if key == best.spec.key()
                    else (cap.baseline_rps, cap.baseline_bounded) if served.spec.method == "off" else (None, True))
    if key not in (best.spec.key(), "off"):
        raise UserError(f"deploy.target_rate={target_rate:g}: the served configuration {key} is not the one whose "
                        f"capacity was measured ({best.spec.key()}); drop the spec override or deploy.target_rate")
    if rps is None:
        raise UserError(f"deploy.target_rate={target_rate:g}: {key} met the SLOs at no rate measured (best.yaml "
                        "capacity), so no replica count serves it; relax workload.slo or give deploy.replicas")
    n = max(1, math.ceil(target_rate / rps))
    why = (f"deploy.target_rate={target_rate:g} req/s / capacity {rps:.3g} req/s of {key} at the SLOs "
           f"(best.yaml) = {target_rate / rps:.2f}, rounded up to {n}")
    if not bounded:
        why += "; that capacity is a lower bound (the SLOs held at every rate measured), so this may be more than needed"
    return n, why


def pod_place(cfg: Config) -> Place:
    """Where the deployed server listens and finds its model (what may differ from a trial's, and
    nothing else: tuner.schema.engine_command.PLACE_FIELDS)."""
    d, m = cfg.deploy, cfg.model
    if d.target == "builtin":
        return Place(host="0.0.0.0", port=d.port, model=m.name, env={"HF_HOME": f"{MODEL_DIR}/hf"},
                     cache_dir=f"{MODEL_DIR}/spectune")
    return Place(host="0.0.0.0", port=d.port, model=m.hf_id, env={"HF_HOME": f"{MODEL_DIR}/hf"})


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


def portable_storage(url: str | None) -> str | None:
    """A study storage as the ConfigMap records it: a file storage (SQLite, journal) by its file
    name, relative to the run directory (the tuning machine's absolute path is no business of the
    cluster); a database URL as best.yaml has it (already without its password)."""
    if url is None:
        return None
    for scheme in ("sqlite:///", "journal:"):
        if url.startswith(scheme):
            return scheme + url[len(scheme):].replace("\\", "/").rsplit("/", 1)[-1]
    return url


def run_relative(run: str) -> Callable[[str], str]:
    """A function rewriting the tuning machine's run directory `run` in a text as the directory's
    name (what the ConfigMap may say of it)."""
    run = run.rstrip("/")
    name = run.replace("\\", "/").rsplit("/", 1)[-1]
    return lambda text: text.replace(run + "/", name + "/") if run else text


def portable_projection(pj: Projection) -> Projection:
    """A projection as the ConfigMap records it: the run directory by its name, the profile (and
    the acceptance text naming it) relative to the run directory's parent."""
    rel = run_relative(pj.run)
    return pj.model_copy(update={"run": rel(pj.run + "/").rstrip("/"), "profile": rel(pj.profile),
                                 "acceptance": rel(pj.acceptance)})


def configmap_data(p: Plan) -> dict[str, str]:
    """The winning config and its provenance, as ConfigMap string values."""
    b, d = p.best, p.cfg.deploy
    rel = run_relative(b.projection.run) if b is not None and b.projection is not None else (lambda text: text)
    served = {
        "target": d.target,
        "model": p.cfg.model.hf_id,
        "hardware": p.cfg.hardware.name,
        "tensor_parallel_size": p.tp,
        "max_model_len": p.max_len,
        "spec": p.served.spec.model_dump(mode="json"),
        "tuned_spec": p.served.tuned.model_dump(mode="json"),
        "notes": [rel(n) for n in p.served.notes],
        "command": p.command + p.args,
    }
    pj = b.projection if b is not None else None
    data = {
        "served.yaml": yaml.safe_dump(served, sort_keys=False, width=10**6),
        "spec": p.served.spec.key(),
        "source": "projection" if pj else "best.yaml" if b else "config overrides",
    }
    adaptive = adaptive_file(p)
    if adaptive is not None:
        data[ADAPTIVE_KEY] = adaptive
    if b is not None:
        # the cluster gets no path of the tuning machine: a study file is named as in its run directory
        b = b.model_copy(update={"provenance": b.provenance.model_copy(
            update={"storage": portable_storage(b.provenance.storage)})})
        if b.projection is not None:  # its reason names the profile too
            b = b.model_copy(update={"projection": portable_projection(b.projection),
                                     "reason": rel(b.reason) if b.reason else b.reason})
            pj = b.projection
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


def adaptive_file(p: Plan) -> str | None:
    """The JSON file SGLang reads its adaptive knobs from (`--speculative-adaptive-config`), when the
    served spec is adaptive on SGLang; None otherwise."""
    how = sglang_adaptive(pinned_version(p.cfg.deploy.image_tag)) if p.cfg.deploy.target == "sglang" and p.served.spec.adaptive else None
    return json.dumps(sglang_adaptive_config(p.served.spec, how), sort_keys=True) if how is not None else None


def _resource_values(p: Plan) -> tuple[int, int, dict[str, str], str, str]:
    """(cpu cores, memory GiB, GPU resources, why the cpu, why the memory) of the server container."""
    hw = p.cfg.hardware
    if hw.accelerator == "cuda" and p.cfg.deploy.target != "builtin":
        share = p.tp / hw.gpu_count
        cpu, mem = max(2, int(hw.cpu_cores * share / 2)), max(8, int(hw.memory_gib * share / 2))
        part = f"{p.tp}/{hw.gpu_count} GPUs"
        return (cpu, mem, {hw.gpu_resource: str(p.tp)},
                f"half of hardware {hw.name}'s {hw.cpu_cores} cores x {part} (at least 2)",
                f"half of hardware {hw.name}'s {hw.memory_gib:g} GiB x {part} (at least 8 GiB)")
    e = p.cfg.engine.builtin
    mem, how = builtin_memory_gib(p.cfg.model, hw, e.dtype, e.weights)
    return (hw.cpu_cores, mem, {}, f"all {hw.cpu_cores} cores of hardware {hw.name} (the built-in engine's threads)",
            f"half of hardware {hw.name}'s {hw.memory_gib:g} GiB, or {how} when more "
            "(tuner.schema.fit.builtin_memory_gib)")


def _resources(p: Plan) -> k.V1ResourceRequirements:
    """GPUs = TP; CPU and memory: half of the node's per-GPU share (all of a CPU node's cores)."""
    cpu, mem, gpus, _, _ = _resource_values(p)
    return k.V1ResourceRequirements(requests={"cpu": str(cpu), "memory": f"{mem}Gi", **gpus},
                                    limits={"memory": f"{mem}Gi", **gpus})


def _probe(p: Plan, period: int, failures: int) -> k.V1Probe:
    return k.V1Probe(http_get=k.V1HTTPGetAction(path=HEALTH_PATH, port=PORT_NAME), period_seconds=period,
                     timeout_seconds=5, failure_threshold=failures)


def _env(p: Plan) -> list[k.V1EnvVar]:
    """The engine command's variables (tuner.schema.engine_command), then the hub token by reference."""
    env = [k.V1EnvVar(name=name, value=value) for name, value in sorted(p.env.items())]
    sec = p.cfg.deploy.hf_token_secret
    if sec is not None:  # by reference only: the token value never appears in a manifest
        env.append(k.V1EnvVar(name="HF_TOKEN", value_from=k.V1EnvVarSource(
            secret_key_ref=k.V1SecretKeySelector(name=sec.name, key=sec.key))))
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


def _model_cache_spec(p: Plan) -> k.V1PersistentVolumeClaimSpec:
    d = p.cfg.deploy
    return k.V1PersistentVolumeClaimSpec(
        access_modes=[d.model_cache_access_mode], storage_class_name=d.storage_class,
        resources=k.V1VolumeResourceRequirements(requests={"storage": d.model_cache_size}))


def shared_model_cache(p: Plan) -> bool:
    """Whether the pods share one model PVC (ReadWriteMany) rather than each its own (ReadWriteOnce)."""
    return p.cfg.deploy.model_cache_access_mode == "ReadWriteMany"


def model_cache_volume(p: Plan) -> k.V1Volume:
    """The model volume: the shared PVC NAME-model-cache (ReadWriteMany), or a generic ephemeral
    volume (ReadWriteOnce): a claim created with each pod and deleted with it, so a surge pod or a
    replica on another node never waits on a volume attached elsewhere."""
    if shared_model_cache(p):
        return k.V1Volume(name="model-cache", persistent_volume_claim=k.V1PersistentVolumeClaimVolumeSource(
            claim_name=f"{p.cfg.deploy.name}-model-cache"))
    return k.V1Volume(name="model-cache", ephemeral=k.V1EphemeralVolumeSource(
        volume_claim_template=k.V1PersistentVolumeClaimTemplate(
            metadata=k.V1ObjectMeta(labels=_labels(p)), spec=_model_cache_spec(p))))


def rolling_update(p: Plan) -> k.V1RollingUpdateDeployment:
    """deploy.rollout: surge starts the new pod first (no downtime, one pod's room needed), replace
    stops one first (no spare GPU needed)."""
    surge = p.cfg.deploy.rollout == "surge"
    return k.V1RollingUpdateDeployment(max_surge=1 if surge else 0, max_unavailable=0 if surge else 1)


def deployment(p: Plan, config_hash: str) -> k.V1Deployment:
    d, hw = p.cfg.deploy, p.cfg.hardware
    gpu = d.target != "builtin"
    non_root = d.target == "builtin"
    adaptive = adaptive_file(p) is not None
    pod_sc, container_sc = security_contexts(BUILTIN_UID if non_root else None)
    container = k.V1Container(
        name="server",
        image=deploy_image(p.cfg, p.served.spec),
        image_pull_policy="IfNotPresent",
        command=p.command,
        args=p.args,
        env=_env(p),
        ports=[k.V1ContainerPort(name=PORT_NAME, container_port=d.port, protocol="TCP")],
        resources=_resources(p),
        volume_mounts=[k.V1VolumeMount(name="model-cache", mount_path=MODEL_DIR),
                       k.V1VolumeMount(name="dshm", mount_path="/dev/shm")]
        + ([k.V1VolumeMount(name="adaptive", mount_path=ADAPTIVE_DIR, read_only=True)] if adaptive else []),
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
            model_cache_volume(p),
            # NCCL / tensor-parallel workers share memory through /dev/shm; the default 64Mi is too small.
            k.V1Volume(name="dshm", empty_dir=k.V1EmptyDirVolumeSource(medium="Memory",
                                                                        size_limit="16Gi" if gpu else "1Gi")),
        ] + ([k.V1Volume(name="adaptive", config_map=k.V1ConfigMapVolumeSource(
            name=f"{d.name}-winner", items=[k.V1KeyToPath(key=ADAPTIVE_KEY, path=ADAPTIVE_KEY)]))] if adaptive else []),
        node_selector=node_selector,
        tolerations=tolerations,
    )
    annotations = {"prometheus.io/scrape": "true", "prometheus.io/port": str(d.port),
                   "prometheus.io/path": METRICS_PATH, "spectune.dev/config-hash": config_hash}
    strategy = k.V1DeploymentStrategy(type="RollingUpdate", rolling_update=rolling_update(p))
    return k.V1Deployment(
        api_version="apps/v1", kind="Deployment", metadata=_meta(p),
        spec=k.V1DeploymentSpec(
            # With an autoscaler (an HPA, or KEDA's) the replica count is its: a replicas field here
            # would be reset on every apply.
            replicas=None if d.autoscaler != "none" else d.replicas, strategy=strategy,
            selector=k.V1LabelSelector(match_labels=_selector(p)),
            template=k.V1PodTemplateSpec(metadata=k.V1ObjectMeta(labels=_labels(p), annotations=annotations),
                                         spec=pod)))


def hpa_bounds(p: Plan) -> tuple[int, int]:
    """HPA min/max replicas: deploy.replicas is a floor (e.g. a CI override `deploy.replicas=3`), at
    most deploy.hpa.max_replicas (plan() refuses a higher one)."""
    h = p.cfg.deploy.hpa
    return max(h.min_replicas, p.cfg.deploy.replicas), h.max_replicas


def hpa_metric_name(series: str) -> str:
    """The name the custom metrics API serves a Prometheus series under (prometheus_adapter_rule
    renames it): ':' of recording-rule style names such as vllm:num_requests_waiting becomes '_'."""
    return series.replace(":", "_")


def prometheus_adapter_rule(p: Plan) -> dict:
    """The prometheus-adapter rule (its Helm values' rules.custom entry) that serves the HPA's
    per-pod metric: the series the ServiceMonitor scrapes (with its namespace and pod labels),
    averaged per pod, under hpa_metric_name."""
    series = p.cfg.deploy.hpa.metric
    return {"rules": {"custom": [{
        "seriesQuery": f'{{__name__="{series}",namespace!="",pod!=""}}',
        "resources": {"overrides": {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}},
        "name": {"matches": f"^{series}$", "as": hpa_metric_name(series)},
        "metricsQuery": "avg(<<.Series>>{<<.LabelMatchers>>}) by (<<.GroupBy>>)",
    }]}}


def service_monitor(p: Plan) -> dict:
    """monitoring.coreos.com/v1 ServiceMonitor (a CRD: no client model; checked by deploy/schemas)."""
    d = p.cfg.deploy
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        # deploy.monitor_labels: what the Prometheus Operator's serviceMonitorSelector matches
        "metadata": {"name": d.name, "namespace": d.namespace, "labels": {**_labels(p), **d.monitor_labels}},
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
    objs: list[tuple[str, object] | None] = [
        # A namespace is usually the cluster's (shared): owned here only when asked, since
        # `kubectl delete -k` deletes what the kustomization lists.
        ("namespace.yaml", k.V1Namespace(api_version="v1", kind="Namespace", metadata=k.V1ObjectMeta(
            name=d.namespace, labels={"app.kubernetes.io/managed-by": FIELD_MANAGER})))
        if d.create_namespace else None,
        ("configmap.yaml", k.V1ConfigMap(api_version="v1", kind="ConfigMap", metadata=_meta(p, f"{d.name}-winner"),
                                         data=data)),
        ("pvc.yaml", k.V1PersistentVolumeClaim(
            api_version="v1", kind="PersistentVolumeClaim", metadata=_meta(p, f"{d.name}-model-cache"),
            spec=_model_cache_spec(p))) if shared_model_cache(p) else None,
        ("deployment.yaml", deployment(p, config_hash)),
        ("service.yaml", k.V1Service(api_version="v1", kind="Service", metadata=_meta(p), spec=k.V1ServiceSpec(
            type="ClusterIP", selector=_selector(p),
            ports=[k.V1ServicePort(name=PORT_NAME, port=d.port, target_port=PORT_NAME, protocol="TCP")]))),
    ]
    if d.service_monitor:
        objs.append(("servicemonitor.yaml", service_monitor(p)))
    if d.pdb_max_unavailable is not None or d.pdb_min_available:
        objs.append(("pdb.yaml", k.V1PodDisruptionBudget(
            api_version="policy/v1", kind="PodDisruptionBudget", metadata=_meta(p),
            spec=k.V1PodDisruptionBudgetSpec(max_unavailable=d.pdb_max_unavailable,
                                             min_available=d.pdb_min_available or None,
                                             selector=k.V1LabelSelector(match_labels=_selector(p))))))
    if d.hpa.enabled:
        objs.append(("hpa.yaml", k.V2HorizontalPodAutoscaler(
            api_version="autoscaling/v2", kind="HorizontalPodAutoscaler", metadata=_meta(p),
            spec=k.V2HorizontalPodAutoscalerSpec(
                scale_target_ref=k.V2CrossVersionObjectReference(api_version="apps/v1", kind="Deployment", name=d.name),
                min_replicas=hpa_bounds(p)[0], max_replicas=hpa_bounds(p)[1],
                metrics=[k.V2MetricSpec(type="Pods", pods=k.V2PodsMetricSource(
                    metric=k.V2MetricIdentifier(name=hpa_metric_name(d.hpa.metric)),
                    target=k.V2MetricTarget(type="AverageValue", average_value=d.hpa.target_average)))]))))
    docs = [(name, obj if isinstance(obj, dict) else api.sanitize_for_serialization(obj))
            for name, obj in (o for o in objs if o is not None)]
    return p, docs


KeyPath = tuple  # a key path inside one document: mapping keys and list indices


def _arg_value(args: list[str], flag: str) -> int | None:
    return args.index(flag) + 1 if flag in args else None


def comments(p: Plan, docs: list[tuple[str, dict]]) -> dict[str, dict[KeyPath, str]]:
    """Where each derived value of the rendered documents came from, by file and key path (an
    empty path: lines above the document), for deploy.render to write as YAML comments."""
    d, hw, byname = p.cfg.deploy, p.cfg.hardware, dict(docs)
    out: dict[str, dict[KeyPath, str]] = {}
    pod = ("spec", "template", "spec")
    c = (*pod, "containers", 0)
    args = byname["deployment.yaml"]["spec"]["template"]["spec"]["containers"][0]["args"]
    cpu_why, mem_why = _resource_values(p)[3:]
    dep: dict[KeyPath, str] = {
        (*c, "resources", "requests", "cpu"): f"cpu: {cpu_why}",
        (*c, "resources", "requests", "memory"): f"memory: {mem_why}",
        (*c, "startupProbe", "failureThreshold"): startup_why(p.cfg.model, d, STARTUP_PERIOD_S),
        (*c, "livenessProbe", "failureThreshold"): "restarted after 3 failed checks 10 s apart (once started)",
        (*c, "readinessProbe", "failureThreshold"): "out of the Service after 3 failed checks 5 s apart",
        ("spec", "strategy", "rollingUpdate", "maxSurge"):
            f"deploy.rollout={d.rollout}: " + ("the new pod starts before an old one stops (room for one more pod "
                                               "needed)" if d.rollout == "surge" else
                                               "an old pod stops before the new one starts (downtime with one replica)"),
        (*pod, "volumes", 0): ("the model volume: one PVC every pod shares (deploy.model_cache_access_mode=ReadWriteMany)"
                               if shared_model_cache(p) else
                               "the model volume: a ReadWriteOnce claim per pod, deleted with it (each pod downloads the "
                               "model; deploy.model_cache_access_mode=ReadWriteMany shares one)"),
    }
    if d.target != "builtin":
        dep[(*c, "resources", "requests", hw.gpu_resource)] = tensor_parallel_why(p.cfg.model, hw, d, p.tp)
        tp_at = _arg_value(args, "--tensor-parallel-size" if d.target == "vllm" else "--tp-size")
        if tp_at is not None:
            dep[(*c, "args", tp_at)] = tensor_parallel_why(p.cfg.model, hw, d, p.tp)
        len_at = _arg_value(args, "--max-model-len" if d.target == "vllm" else "--context-length")
        if len_at is not None:
            dep[(*c, "args", len_at)] = max_model_len_why(p.cfg.model, hw, d, p.tp)
        names_at = _arg_value(args, "--served-model-name")
        if names_at is not None:
            dep[(*c, "args", names_at)] = ("model.name and model.hf_id: requests may name either" if d.target == "vllm"
                                           else "SGLang takes one name and serves requests naming any model")
    if p.replicas_why is not None and not d.hpa.enabled:
        dep[("spec", "replicas")] = p.replicas_why
    out["deployment.yaml"] = dep
    if "pvc.yaml" in byname:
        out["pvc.yaml"] = {("spec", "accessModes", 0): "deploy.model_cache_access_mode: every pod mounts this claim"}
    if "pdb.yaml" in byname:
        key = "maxUnavailable" if d.pdb_max_unavailable is not None else "minAvailable"
        out["pdb.yaml"] = {("spec", key): (
            "deploy.pdb_max_unavailable: `kubectl drain` may evict one pod at a time, also with one replica"
            if key == "maxUnavailable" else "deploy.pdb_min_available: below the pods at rest, so drains proceed")}
    if "hpa.yaml" in byname:
        rule = yaml.safe_dump(prometheus_adapter_rule(p), sort_keys=False, width=10**6)
        lo, hi = hpa_bounds(p)
        out["hpa.yaml"] = {
            (): ("The HPA reads the per-pod metric " + hpa_metric_name(d.hpa.metric) + " from the custom metrics API "
                 "(custom.metrics.k8s.io). prometheus-adapter serves it from the series " + d.hpa.metric + " that the "
                 "ServiceMonitor scrapes, with this rule in its Helm values (docs/deploy.md, Autoscaling):\n" + rule),
            ("spec", "metrics", 0, "pods", "metric", "name"): f"the series {d.hpa.metric}, renamed by the adapter rule above",
            ("spec", "minReplicas"): f"max(deploy.hpa.min_replicas={d.hpa.min_replicas}, deploy.replicas={d.replicas}) = {lo}"
                                     + (f"; deploy.replicas: {p.replicas_why}" if p.replicas_why else ""),
            ("spec", "maxReplicas"): f"deploy.hpa.max_replicas={hi}",
        }
    return out
