"""Kubernetes objects of a distributed study (`tuner render-tuner`), built with the client models.

Optuna's storage coordinates the workers; Kubernetes only runs them:

- PostgreSQL: a StatefulSet (its volume from a volumeClaimTemplate) behind a headless Service, or
  none when `distributed.external_url_secret` names a Secret holding an existing database's URL,
  or `search.storage=postgresql://USER@HOST/DB` names one (its password from distributed.db_secret);
- a Job creating the study (`tuner optimize --create-only` with the render's overrides);
- the `…-cache` PersistentVolumeClaim every tuner pod mounts at /cache (cache_dir and HF_HOME);
- when the searched methods need trained drafts, a Job that trains them once into that volume
  (`tuner train-draft --searched`, the workers' own lookup) with one worker's GPUs;
- an Indexed Job of `search.workers` workers (`tuner optimize --worker`), each with the GPUs one
  serving replica gets on the selected hardware, its node selector and toleration; with a train
  Job they wait for its drafts (`--wait-drafts`) instead of each training its own;
- a Job that waits for the budget to be spent and writes best.yaml, the report and the winner's
  manifests (`tuner report --storage ... --study ...`) into a PersistentVolumeClaim; it mounts the
  cache volume too, so a winner's head path is there to render and push.

Every pod first waits for the database (`tuner wait-storage`). Credentials exist only in a Secret
the user creates; pods read them through secretKeyRef, and the storage URL carries no password
(libpq reads PGPASSWORD) or is read whole from SPECTUNE_STORAGE_URL (`search.storage=env`).
"""

from __future__ import annotations

import math

from kubernetes import client as k

from tuner.schema.fit import tensor_parallel_size
from deploy.manifests import BUILTIN_UID, FIELD_MANAGER, gpu_placement, security_contexts
from tuner.schema.config import Config, UserError, spectune_image, trained_drafts

DB_PORT = 5432
PG_UID = 999  # the official postgres image's postgres user
RESULTS_DIR = "/results"
CACHE_DIR = "/cache"
RUNS_DIR = "/runs"
WAIT_DB_S = 900  # how long a pod waits for the database before its Job retries it
WAIT_DONE_S = 30 * 24 * 3600  # the report Job waits for the whole study
WAIT_DRAFTS_S = 48 * 3600  # a worker waits this long for the train Job's drafts before its pod fails
STORAGE_ENV = "SPECTUNE_STORAGE_URL"  # tuner.run.distributed reads the whole URL from it (search.storage=env)
# Keys of `distributed.db_secret`: the in-cluster database's user, password and database name.
SECRET_KEYS = {"user": ("POSTGRES_USER", "PGUSER"), "password": ("POSTGRES_PASSWORD", "PGPASSWORD"),
               "database": ("POSTGRES_DB", "PGDATABASE")}
RENDER_ONLY = ("distributed.", "search.storage", "search.study_name", "run_dir", "cache_dir")


def study_name(cfg: Config) -> str:
    """The study every pod joins: search.study_name, or a stable name (no timestamp) from the config."""
    if cfg.search.study_name:
        return cfg.search.study_name
    workload = cfg.workload.name if cfg.workload else "none"
    return f"{workload}-{cfg.model.name}-{cfg.engine.kind}"


def _names(cfg: Config) -> dict[str, str]:
    n = cfg.distributed.name
    return {"db": f"{n}-db", "create": f"{n}-create-study", "workers": f"{n}-workers", "report": f"{n}-report",
            "results": f"{n}-results", "cache": f"{n}-cache", "train": f"{n}-train-drafts"}


def user_database(cfg: Config) -> str | None:
    """The user's own database, `search.storage=postgresql://USER@HOST/DB` (no password: the pods read
    PGPASSWORD from the `password` key of distributed.db_secret); None: another storage value, such
    as the `env` tuner.cli.cluster.tuner_config assumes when none is given."""
    url = cfg.search.storage
    return url if url is not None and url.startswith("postgresql") else None


def storage_value(cfg: Config) -> str:
    """search.storage as the pods give it: no password; `$(VAR)` is expanded by Kubernetes from the
    container's env (the user and database names from the Secret)."""
    if cfg.distributed.external_url_secret is not None:
        return "env"
    if user_database(cfg) is not None:
        return user_database(cfg)  # type: ignore[return-value]
    return f"postgresql://$(PGUSER)@{_names(cfg)['db']}:{DB_PORT}/$(PGDATABASE)"


def _secret_env(name: str, secret: str, key: str) -> k.V1EnvVar:
    return k.V1EnvVar(name=name, value_from=k.V1EnvVarSource(
        secret_key_ref=k.V1SecretKeySelector(name=secret, key=key)))


def db_env(cfg: Config) -> list[k.V1EnvVar]:
    """What a tuner pod needs to reach the storage: Secret references only, never values."""
    ext = cfg.distributed.external_url_secret
    if ext is not None:
        return [_secret_env(STORAGE_ENV, ext.name, ext.key)]
    if user_database(cfg) is not None:  # the user and database are in the URL; only the password is secret
        return [_secret_env("PGPASSWORD", cfg.distributed.db_secret, "password")]
    return [_secret_env(libpq, cfg.distributed.db_secret, key) for key, (_, libpq) in SECRET_KEYS.items()]


def _labels(cfg: Config, component: str) -> dict[str, str]:
    return {**_selector(cfg, component), "app.kubernetes.io/managed-by": FIELD_MANAGER}


def _selector(cfg: Config, component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "spectune-tuner", "app.kubernetes.io/instance": cfg.distributed.name,
            "app.kubernetes.io/component": component}


def _meta(cfg: Config, name: str, component: str) -> k.V1ObjectMeta:
    return k.V1ObjectMeta(name=name, namespace=cfg.distributed.namespace, labels=_labels(cfg, component))


def _tuner_image(cfg: Config, variant: str = "cpu") -> str:
    """A tuner image: spectune's own from image_repo/image_tag, or distributed.image[:image_tag]
    with the same variant suffixes (`-vllm` on the name, `-cuda` on the tag)."""
    dc = cfg.distributed
    if dc.image is None:
        return spectune_image(cfg, variant)  # type: ignore[arg-type]
    name = f"{dc.image}-vllm" if variant == "vllm" else dc.image
    return f"{name}:{dc.image_tag or cfg.image_tag}{'-cuda' if variant == 'cuda' else ''}"


def _image(cfg: Config) -> str:
    return _tuner_image(cfg)


def worker_image(cfg: Config) -> str:
    """The image a worker needs for cfg.engine, as `make image` tags them: the built-in engine's
    (its CUDA variant when the worker gets GPUs), or the one with vLLM in the pod."""
    if cfg.engine.kind == "vllm":
        return _tuner_image(cfg, "vllm")
    if cfg.engine.kind == "sglang":
        raise UserError("render-tuner engine=sglang: no tuner worker image with SGLang is built "
                        "(make image builds the built-in and vLLM ones); use engine=vllm or engine=builtin")
    return _tuner_image(cfg, "cuda") if worker_gpus(cfg) > 0 else _image(cfg)


def cache_size(cfg: Config) -> str:
    """distributed.cache_storage, or room for the model's hub weights (16-bit: 2 GB per billion
    parameters, plus a quarter for converted copies) and 10 GiB for heads, their data and compile caches."""
    if cfg.distributed.cache_storage is not None:
        return cfg.distributed.cache_storage
    return f"{math.ceil(2.5 * cfg.model.params_b) + 10}Gi"


def _tuner_container(cfg: Config, name: str, args: list[str], resources: k.V1ResourceRequirements,
                     mounts: list[k.V1VolumeMount], extra_env: list[k.V1EnvVar] | None = None,
                     image: str | None = None) -> k.V1Container:
    _, container_sc = security_contexts(BUILTIN_UID)
    return k.V1Container(name=name, image=image or _image(cfg), image_pull_policy="IfNotPresent", command=["tuner"],
                         args=args, env=db_env(cfg) + (extra_env or []), resources=resources,
                         volume_mounts=mounts or None, security_context=container_sc)


def _wait_container(cfg: Config, study: str | None) -> k.V1Container:
    """Init container: wait until the database answers (and, for workers, the study exists)."""
    args = ["wait-storage", "--storage", storage_value(cfg), "--timeout", str(WAIT_DB_S)]
    if study is not None:
        args += ["--study", study]
    small = k.V1ResourceRequirements(requests={"cpu": "100m", "memory": "256Mi"}, limits={"memory": "512Mi"})
    return _tuner_container(cfg, "wait-for-database", args, small, [])


def _pod(cfg: Config, containers: list[k.V1Container], init: list[k.V1Container], restart: str,
         volumes: list[k.V1Volume] | None = None, gpu: bool = False) -> k.V1PodSpec:
    pod_sc, _ = security_contexts(BUILTIN_UID)
    node_selector, tolerations = gpu_placement(cfg.hardware) if gpu else (None, None)
    return k.V1PodSpec(containers=containers, init_containers=init or None, restart_policy=restart,
                       security_context=pod_sc, volumes=volumes, node_selector=node_selector,
                       tolerations=tolerations, enable_service_links=False,
                       automount_service_account_token=False)


def _job(cfg: Config, name: str, component: str, pod: k.V1PodSpec, backoff: int, **spec: object) -> k.V1Job:
    return k.V1Job(api_version="batch/v1", kind="Job", metadata=_meta(cfg, name, component),
                   spec=k.V1JobSpec(backoff_limit=backoff, template=k.V1PodTemplateSpec(
                       metadata=k.V1ObjectMeta(labels=_labels(cfg, component)), spec=pod), **spec))


def worker_gpus(cfg: Config) -> int:
    """GPUs per worker: what one serving replica gets (tuner.schema.fit's tensor parallel size)."""
    if cfg.hardware.accelerator != "cuda":
        return 0
    return tensor_parallel_size(cfg.model, cfg.hardware, cfg.deploy)


def worker_resources(cfg: Config) -> k.V1ResourceRequirements:
    """The GPUs of one serving replica plus half of the node's CPU and memory share for them."""
    hw, gpus = cfg.hardware, worker_gpus(cfg)
    if gpus:
        share = gpus / hw.gpu_count
        cpu, mem = max(2, int(hw.cpu_cores * share / 2)), max(8, int(hw.memory_gib * share / 2))
        extra = {hw.gpu_resource: str(gpus)}
    else:
        cpu, mem, extra = hw.cpu_cores, max(2, int(hw.memory_gib / 2)), {}
    return k.V1ResourceRequirements(requests={"cpu": str(cpu), "memory": f"{mem}Gi", **extra},
                                    limits={"memory": f"{mem}Gi", **extra})


def creator_overrides(overrides: list[str]) -> list[str]:
    """The render's overrides that shape the study (render-only keys dropped), `$(` escaped so
    Kubernetes does not expand it."""
    keep = [o for o in overrides if not o.lstrip("+~").startswith(RENDER_ONLY)]
    return [o.replace("$(", "$$(") for o in keep]


def database(cfg: Config) -> list[tuple[str, object]]:
    """Headless Service + StatefulSet running PostgreSQL with its own volume."""
    dc, names = cfg.distributed, _names(cfg)
    env = [k.V1EnvVar(name="PGDATA", value="/var/lib/postgresql/data/pgdata")]
    env += [_secret_env(pg_name, dc.db_secret, key) for key, (pg_name, _) in SECRET_KEYS.items()]
    ready = k.V1ExecAction(command=["sh", "-c", f'pg_isready -h 127.0.0.1 -p {DB_PORT} -U "$POSTGRES_USER" '
                                                '-d "$POSTGRES_DB"'])
    pod_sc, container_sc = security_contexts(PG_UID)
    container = k.V1Container(
        name="postgres", image=f"{dc.postgres_image}:{dc.postgres_tag}", image_pull_policy="IfNotPresent",
        env=env, ports=[k.V1ContainerPort(name="postgres", container_port=DB_PORT, protocol="TCP")],
        resources=k.V1ResourceRequirements(requests={"cpu": "500m", "memory": "1Gi"}, limits={"memory": "2Gi"}),
        volume_mounts=[k.V1VolumeMount(name="data", mount_path="/var/lib/postgresql/data"),
                       k.V1VolumeMount(name="run", mount_path="/var/run/postgresql")],
        readiness_probe=k.V1Probe(_exec=ready, period_seconds=5, timeout_seconds=5, failure_threshold=3),
        liveness_probe=k.V1Probe(_exec=ready, initial_delay_seconds=30, period_seconds=15, timeout_seconds=5,
                                 failure_threshold=4),
        security_context=container_sc)
    claim = k.V1PersistentVolumeClaim(
        metadata=k.V1ObjectMeta(name="data", labels=_labels(cfg, "database")),
        spec=k.V1PersistentVolumeClaimSpec(access_modes=["ReadWriteOnce"], storage_class_name=dc.storage_class,
                                           resources=k.V1VolumeResourceRequirements(
                                               requests={"storage": dc.postgres_storage})))
    sts = k.V1StatefulSet(
        api_version="apps/v1", kind="StatefulSet", metadata=_meta(cfg, names["db"], "database"),
        spec=k.V1StatefulSetSpec(
            service_name=names["db"], replicas=1, selector=k.V1LabelSelector(match_labels=_selector(cfg, "database")),
            template=k.V1PodTemplateSpec(
                metadata=k.V1ObjectMeta(labels=_labels(cfg, "database")),
                spec=k.V1PodSpec(containers=[container], security_context=pod_sc, enable_service_links=False,
                                 automount_service_account_token=False, termination_grace_period_seconds=60,
                                 volumes=[k.V1Volume(name="run", empty_dir=k.V1EmptyDirVolumeSource())])),
            volume_claim_templates=[claim]))
    svc = k.V1Service(
        api_version="v1", kind="Service", metadata=_meta(cfg, names["db"], "database"),
        spec=k.V1ServiceSpec(cluster_ip="None", selector=_selector(cfg, "database"),
                             ports=[k.V1ServicePort(name="postgres", port=DB_PORT, target_port="postgres",
                                                    protocol="TCP")]))
    return [("db-service.yaml", svc), ("db-statefulset.yaml", sts)]


def build(cfg: Config, overrides: list[str]) -> list[tuple[str, dict]]:
    """All documents of the distributed study, in apply order, as (file name, camelCase dict)."""
    if cfg.workload is None:
        raise UserError("render-tuner needs a workload: add +workload=NAME (the study tunes for it)")
    dc, names, study = cfg.distributed, _names(cfg), study_name(cfg)
    storage = storage_value(cfg)
    study_args = [f"search.storage={storage}", f"search.study_name={study}"]
    cache = [k.V1VolumeMount(name="cache", mount_path=CACHE_DIR), k.V1VolumeMount(name="runs", mount_path=RUNS_DIR)]
    # The model, converted copies and trained drafts: one volume all tuner pods share (the head a
    # winner names lives there after the workers are gone); the run directories stay per pod.
    shared_cache = k.V1Volume(name="cache", persistent_volume_claim=k.V1PersistentVolumeClaimVolumeSource(
        claim_name=names["cache"]))
    scratch = [shared_cache, k.V1Volume(name="runs", empty_dir=k.V1EmptyDirVolumeSource())]
    cache_dir = f"cache_dir={CACHE_DIR}/spectune"
    cpu_small = k.V1ResourceRequirements(requests={"cpu": "500m", "memory": "2Gi"}, limits={"memory": "4Gi"})

    create = _job(cfg, names["create"], "create-study", _pod(
        cfg, [_tuner_container(cfg, "create-study", ["optimize", "--create-only", *creator_overrides(overrides),
                                                     *study_args], cpu_small, [])],
        [_wait_container(cfg, None)], "OnFailure"), backoff=6)

    hf_env = [k.V1EnvVar(name="HF_HOME", value=f"{CACHE_DIR}/hf")]
    if cfg.deploy.hf_token_secret is not None:
        hf_env.append(_secret_env("HF_TOKEN", cfg.deploy.hf_token_secret.name, cfg.deploy.hf_token_secret.key))
    gpu = worker_gpus(cfg) > 0
    image = worker_image(cfg)
    drafts = trained_drafts(cfg)
    # in the vLLM image `vllm` is on PATH; HOME on the cache volume gives vLLM a writable cache
    engine_args = ["engine.vllm.executable=vllm"] if cfg.engine.kind == "vllm" else []
    # With drafts to train, the train Job trains them once and the workers wait for them (each
    # worker would otherwise train the same head, all into one volume).
    wait = ["--wait-drafts", str(WAIT_DRAFTS_S)] if drafts else []
    shm_mount = k.V1VolumeMount(name="dshm", mount_path="/dev/shm")
    worker = _tuner_container(cfg, "worker", ["optimize", "--worker", *wait, *study_args, f"run_dir={RUNS_DIR}",
                                              cache_dir, *engine_args],
                              worker_resources(cfg), cache + [shm_mount],
                              hf_env + [k.V1EnvVar(name="HOME", value=CACHE_DIR)], image=image)
    shm = k.V1Volume(name="dshm", empty_dir=k.V1EmptyDirVolumeSource(medium="Memory",
                                                                     size_limit="16Gi" if gpu else "1Gi"))
    # The same config as the study (the creator's overrides), the same cache_dir as the workers:
    # the drafts land where the workers' lookup (tuner.study.measurer.get_drafts) finds them. It
    # needs no database; the GPUs, image and placement of one worker.
    train = _job(cfg, names["train"], "train-drafts", _pod(
        cfg, [_tuner_container(cfg, "train-drafts", ["train-draft", "--searched", *creator_overrides(overrides),
                                                     *study_args, cache_dir],
                               worker_resources(cfg), cache + [shm_mount],
                               hf_env + [k.V1EnvVar(name="HOME", value=CACHE_DIR)], image=image)],
        [], "OnFailure", scratch + [shm], gpu=gpu), backoff=dc.backoff_limit)
    # Indexed: each index is one worker; a pod that dies is replaced (up to backoff_limit times per
    # index) and joins the study again, while the heartbeat sweep fails the trial it lost.
    workers = _job(cfg, names["workers"], "worker", _pod(
        cfg, [worker], [_wait_container(cfg, study)], "Never", scratch + [shm], gpu=gpu),
        backoff=None, completion_mode="Indexed", completions=cfg.search.workers, parallelism=cfg.search.workers,
        backoff_limit_per_index=dc.backoff_limit, max_failed_indexes=max(0, cfg.search.workers - 1))

    # The cache volume at the workers' path: the winner's head (best.yaml names /cache/...) is there
    # for the manifests and for `tuner push-head` (done here with distributed.push_head_to).
    push = ["--push-head", dc.push_head_to] if dc.push_head_to else []
    push_env = [_secret_env("HF_TOKEN", dc.push_token_secret.name, dc.push_token_secret.key)] if push else []
    report = _job(cfg, names["report"], "report", _pod(
        cfg, [_tuner_container(cfg, "report", ["report", "--storage", storage, "--study", study,
                                               "--wait", str(WAIT_DONE_S), "--out", f"{RESULTS_DIR}/{study}", *push],
                               cpu_small, [k.V1VolumeMount(name="results", mount_path=RESULTS_DIR),
                                           k.V1VolumeMount(name="cache", mount_path=CACHE_DIR, read_only=True)],
                               push_env)],
        [_wait_container(cfg, study)], "OnFailure",
        [k.V1Volume(name="results", persistent_volume_claim=k.V1PersistentVolumeClaimVolumeSource(
            claim_name=names["results"])), shared_cache]), backoff=6)

    results = k.V1PersistentVolumeClaim(
        api_version="v1", kind="PersistentVolumeClaim", metadata=_meta(cfg, names["results"], "report"),
        spec=k.V1PersistentVolumeClaimSpec(access_modes=["ReadWriteOnce"], storage_class_name=dc.storage_class,
                                           resources=k.V1VolumeResourceRequirements(
                                               requests={"storage": dc.results_storage})))
    cache_pvc = k.V1PersistentVolumeClaim(
        api_version="v1", kind="PersistentVolumeClaim", metadata=_meta(cfg, names["cache"], "cache"),
        spec=k.V1PersistentVolumeClaimSpec(access_modes=[dc.cache_access_mode], storage_class_name=dc.storage_class,
                                           resources=k.V1VolumeResourceRequirements(
                                               requests={"storage": cache_size(cfg)})))
    objs: list[tuple[str, object]] = [
        ("namespace.yaml", k.V1Namespace(api_version="v1", kind="Namespace", metadata=k.V1ObjectMeta(
            name=dc.namespace, labels={"app.kubernetes.io/managed-by": FIELD_MANAGER}))),
    ]
    if dc.external_url_secret is None and user_database(cfg) is None:
        objs += database(cfg)
    objs += [("results-pvc.yaml", results), ("cache-pvc.yaml", cache_pvc), ("create-study-job.yaml", create)]
    if drafts:
        objs.append(("train-drafts-job.yaml", train))
    objs += [("workers-job.yaml", workers), ("report-job.yaml", report)]
    api = k.ApiClient()
    return [(name, api.sanitize_for_serialization(obj)) for name, obj in objs]
