"""`tuner render-tuner`: the Kubernetes objects of a distributed study are strictly schema-valid,
carry credentials only by Secret reference, give each worker the hardware's GPUs and placement,
and the committed base k8s/tuner/ is what the renderer writes today."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from deploy.tuner_manifests import CACHE_DIR, STORAGE_ENV, WAIT_DRAFTS_S, build, worker_gpus
from deploy.validate import check_docs
from tuner.cli import main
from tuner.cli.cluster import render_tuner, study_overrides
from tuner.cli.cluster import tuner_config as load_config  # the render's own composition
from tuner.run.distributed import WORKER_KEYS

REPO = Path(__file__).resolve().parents[2]
DEFAULT = ["+workload=code"]
GPU = ["+workload=chat", "model=llama-3.1-8b-instruct", "hardware=h200x1", "search.workers=4"]
EXTERNAL = [*GPU, "distributed.external_url_secret={name: tuner-db-url, key: url}"]
CASES = {"default": DEFAULT, "gpu": GPU, "external": EXTERNAL}
PASSWORD_VARS = {"PGPASSWORD", "POSTGRES_PASSWORD", STORAGE_ENV, "HF_TOKEN"}


def _docs(overrides: list[str]) -> dict[str, dict]:
    return dict(build(load_config(overrides), study_overrides(overrides)))


def _pods(docs: dict[str, dict]) -> dict[str, dict]:
    return {name: doc["spec"]["template"]["spec"] for name, doc in docs.items()
            if doc["kind"] in ("Job", "StatefulSet")}


def _containers(pod: dict) -> list[dict]:
    return pod["containers"] + pod.get("initContainers", [])


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("version", ["1.29", "1.33", "1.37"])
def test_strictly_valid(case: str, version: str) -> None:
    assert check_docs(list(_docs(CASES[case]).items()), version) == []


@pytest.mark.parametrize("case", CASES)
def test_secrets_only_by_reference(case: str) -> None:
    docs = _docs(CASES[case])
    assert not [d for d in docs.values() if d["kind"] == "Secret"]  # the user creates it; never rendered
    text = yaml.safe_dump(list(docs.values()))
    assert not re.search(r"postgresql://[^@\s]*:[^@\s]*@", text)  # no password in any URL
    refs = set()
    for pod in _pods(docs).values():
        for c in _containers(pod):
            for e in c.get("env", []):
                if e["name"] in PASSWORD_VARS:
                    assert "value" not in e and "secretKeyRef" in e["valueFrom"], (c["name"], e)
                    refs.add(e["valueFrom"]["secretKeyRef"]["name"])
    cfg = load_config(CASES[case])
    expected = {cfg.distributed.external_url_secret.name if case == "external" else cfg.distributed.db_secret}
    assert expected <= refs


def test_workers_job_parallelism_gpus_and_placement() -> None:
    docs = _docs(GPU)
    job = docs["workers-job.yaml"]["spec"]
    assert job["completionMode"] == "Indexed" and job["parallelism"] == job["completions"] == 4
    pod = job["template"]["spec"]
    worker = pod["containers"][0]
    cfg = load_config(GPU)
    assert worker_gpus(cfg) == 1  # an 8B model fits one H200: a worker gets what one replica serves with
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert worker["image"] == "ghcr.io/spectune/spectune:0.1.0-cuda"  # a GPU worker runs the CUDA variant
    assert pod["initContainers"][0]["args"][:1] == ["wait-storage"] and "--study" in pod["initContainers"][0]["args"]
    # Only the workers and the Job training their drafts (on one worker's GPUs) ask for GPUs.
    train = docs["train-drafts-job.yaml"]["spec"]["template"]["spec"]
    assert train["nodeSelector"] == pod["nodeSelector"] and train["containers"][0]["resources"] == worker["resources"]
    for name, p in _pods(docs).items():
        if name not in ("workers-job.yaml", "train-drafts-job.yaml"):
            assert "nodeSelector" not in p
            assert all("nvidia.com/gpu" not in str(c.get("resources")) for c in p["containers"])
    # CPU hardware: no GPUs, no GPU placement.
    cpu_pod = _docs(DEFAULT)["workers-job.yaml"]["spec"]["template"]["spec"]
    assert "nodeSelector" not in cpu_pod and "nvidia.com/gpu" not in str(cpu_pod["containers"][0]["resources"])


def test_image_and_database_from_config() -> None:
    docs = _docs([*DEFAULT, "distributed.image=registry.example/tuner", "distributed.image_tag=9.9",
                  "distributed.postgres_tag=17.2", "distributed.postgres_storage=50Gi"])
    assert {c["image"] for p in _pods(docs).values() for c in _containers(p) if c["name"] != "postgres"} == \
        {"registry.example/tuner:9.9"}
    sts = docs["db-statefulset.yaml"]["spec"]
    assert sts["template"]["spec"]["containers"][0]["image"] == "postgres:17.2"
    assert sts["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "50Gi"
    assert docs["db-service.yaml"]["spec"]["clusterIP"] == "None" and sts["serviceName"] == "spectune-tuner-db"
    ext = _docs(EXTERNAL)
    assert "db-statefulset.yaml" not in ext and "db-service.yaml" not in ext


def test_pod_arguments_are_what_the_cli_accepts() -> None:
    """Expand $(VAR) as Kubernetes does: the creator's and workers' arguments compose into a valid
    config without a password, and a worker passes only the keys `--worker` takes."""
    docs = _docs([*GPU, "search.n_trials=30", "distributed.namespace=tuning"])
    env = {"PGUSER": "tuner", "PGDATABASE": "optuna"}
    expand = lambda a: re.sub(r"(?<!\$)\$\((\w+)\)", lambda m: env[m.group(1)], a).replace("$$(", "$(")  # noqa: E731
    create = [expand(a) for a in docs["create-study-job.yaml"]["spec"]["template"]["spec"]["containers"][0]["args"]]
    assert create[:2] == ["optimize", "--create-only"]
    assert "search.n_trials=30" in create and not [a for a in create if a.startswith("distributed.")]
    cfg = load_config(create[2:])
    assert cfg.search.storage == "postgresql://tuner@spectune-tuner-db:5432/optuna"
    assert cfg.search.study_name == "chat-llama-3.1-8b-instruct-builtin" and cfg.search.n_trials == 30
    worker = [expand(a) for a in docs["workers-job.yaml"]["spec"]["template"]["spec"]["containers"][0]["args"]]
    assert worker[:4] == ["optimize", "--worker", "--wait-drafts", str(WAIT_DRAFTS_S)]  # the study trains a head
    assert all(a.startswith(WORKER_KEYS) for a in worker[4:])
    assert {d["metadata"].get("namespace") for d in docs.values() if d["kind"] != "Namespace"} == {"tuning"}


def test_committed_base_is_current(tmp_path: Path) -> None:
    files, errors = render_tuner(DEFAULT, tmp_path)
    assert errors == []
    committed = REPO / "k8s" / "tuner"
    assert sorted(p.name for p in committed.glob("*.yaml")) == sorted(p.name for p in files)
    for p in files:
        assert (committed / p.name).read_text() == p.read_text(), f"re-render k8s/tuner: {p.name} is stale"


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
def test_kubectl_kustomize_builds_the_base() -> None:
    r = subprocess.run(["kubectl", "kustomize", str(REPO / "k8s" / "tuner")], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    kinds = [d["kind"] for d in yaml.safe_load_all(r.stdout)]
    # the default search trains an EAGLE head: a train Job beside the creator, workers and report
    assert sorted(kinds) == sorted(["Namespace", "Service", "StatefulSet"] + ["PersistentVolumeClaim"] * 2 + ["Job"] * 4)


def test_cli(tmp_path: Path, capsys) -> None:
    assert main(["render-tuner", *GPU, "--out", str(tmp_path)]) == 0
    assert "4 worker(s) x 1 GPU(s) on h200x1" in capsys.readouterr().out
    assert main(["render", "--check", str(tmp_path)]) == 0
    assert main(["render-tuner", "--out", str(tmp_path / "x")]) == 2  # no workload
    assert "needs a workload" in capsys.readouterr().err


@pytest.mark.parametrize("out,fragment", [
    ("{tmp}/afile", "--out {tmp}/afile: is an existing file, not a directory"),
    ("{tmp}/afile/sub", "--out {tmp}/afile/sub: cannot create the output directory (a parent is a file"),
    ("", "--out '': an empty path; give the output directory"),
])
def test_cli_bad_out_one_line_exit_2(out: str, fragment: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture) -> None:
    """Issue 25: an --out that is a file or cannot be created (or is empty) is one line, exit 2."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("not a directory\n")
    assert main(["render-tuner", *DEFAULT, "--out", out.replace("{tmp}", str(tmp_path))]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment.replace("{tmp}", str(tmp_path)) in lines[0]
    assert captured.out == "" and sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


@pytest.mark.parametrize("override,fragment", [
    ("distributed.namespace=Bad_NS", "distributed.namespace='Bad_NS': not a Kubernetes namespace"),
    ("distributed.image_tag=bad tag", "distributed.image_tag='bad tag': not an image tag"),
    ("distributed.postgres_storage=lots", "distributed.postgres_storage='lots': not a Kubernetes quantity"),
])
def test_cli_cluster_rejected_values_one_line(override: str, fragment: str, tmp_path: Path,
                                              capsys: pytest.CaptureFixture) -> None:
    assert main(["render-tuner", *DEFAULT, override, "--out", str(tmp_path / "o")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], lines
    assert not (tmp_path / "o").exists()


def test_workers_use_the_image_of_their_engine() -> None:
    """CPU workers: the built-in image; GPU workers: its CUDA variant; engine=vllm: the image with vLLM
    in the pod (and its `vllm` on PATH); SGLang has no worker image: refused in one line. Every one
    of them is a tag `make image` builds."""
    from tests.test_image import _make_image_tags
    from tuner.schema.config import UserError

    tags = _make_image_tags()

    def worker(docs):
        job = next(d for d in docs.values() if d["kind"] == "Job" and d["spec"].get("completionMode") == "Indexed")
        return job["spec"]["template"]["spec"]["containers"][0]

    cpu = worker(_docs(["+workload=code"]))
    gpu = worker(_docs(GPU))
    vllm = worker(_docs([*GPU, "deploy=vllm"]))  # the workers run the engine the deployment serves
    assert cpu["image"] == "ghcr.io/spectune/spectune:0.1.0"
    assert gpu["image"] == "ghcr.io/spectune/spectune:0.1.0-cuda"
    assert vllm["image"] == "ghcr.io/spectune/spectune-vllm:0.1.0" and "engine.vllm.executable=vllm" in vllm["args"]
    assert {cpu["image"], gpu["image"], vllm["image"]} <= set(tags)
    with pytest.raises(UserError, match="render-tuner engine=sglang: no tuner worker image"):
        _docs([*GPU, "deploy=sglang", "spec.method=eagle", "search.methods=[eagle]"])


def test_users_database_url_is_what_the_pods_use(tmp_path: Path, capsys) -> None:
    """Issue 25: `search.storage=postgresql://USER@HOST/DB` was replaced by the in-cluster database
    without a word. Now every pod uses the user's URL (its password from the db Secret's `password`
    key, by reference) and no PostgreSQL is rendered; a storage pods cannot share, or two databases,
    is refused in one line."""
    url = "postgresql://tuner@db.example.com:5432/optuna"
    overrides = [*GPU, f"search.storage={url}"]
    docs = _docs(overrides)
    assert "db-statefulset.yaml" not in docs and "db-service.yaml" not in docs
    assert check_docs(list(docs.items()), "1.33") == []
    for name, pod in _pods(docs).items():
        for c in _containers(pod):
            args = c["args"]
            assert (f"search.storage={url}" in args) or (args[args.index("--storage") + 1] == url), (name, args)
            env = {e["name"]: e for e in c.get("env", [])}
            assert env["PGPASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "spectune-tuner-db", "key": "password"}
            assert "PGUSER" not in env and "value" not in env["PGPASSWORD"]
    create = docs["create-study-job.yaml"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert load_config(create[2:]).search.storage == url
    assert main(["render-tuner", *overrides, "--out", str(tmp_path / "o")]) == 0
    assert f"external database {url} (password from Secret spectune-tuner-db, key password)" in capsys.readouterr().out
    for bad, needle in (("search.storage=journal:/runs/j.log", "search.storage=journal:/runs/j.log: the workers are "
                                                                "pods on several nodes and share a database, not a file"),
                        ("search.storage=env", "search.storage=env: the pods read SPECTUNE_STORAGE_URL from a Secret"),
                        (f"search.storage={url}", "two databases")):
        extra = ["distributed.external_url_secret={name: tuner-db-url, key: url}"] if "two" in needle else []
        assert main(["render-tuner", *GPU, bad, *extra, "--out", str(tmp_path / "x")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0], err
    assert not (tmp_path / "x").exists()


def _pod_of(docs: dict[str, dict], name: str) -> dict:
    return docs[name]["spec"]["template"]["spec"]


def _cache_claim(pod: dict) -> str | None:
    (vol,) = [v for v in pod["volumes"] if v["name"] == "cache"]
    assert "emptyDir" not in vol  # the drafts outlive the pods
    return vol["persistentVolumeClaim"]["claimName"]


def test_drafts_are_trained_once_before_the_workers_into_the_claim_every_pod_mounts(tmp_path: Path) -> None:
    """Issue 24: each worker trained its own head on an emptyDir, lost with the pod. Now one Job
    trains the drafts of search.methods (the study's own config, the workers' cache_dir) before the
    workers, which wait for them; workers, the train Job and the report Job mount one claim at the
    same path, so the head best.yaml names is there to render and push."""
    from engine.heads.pipeline import head_dir
    from tuner.schema.compose import apply_overrides
    from tuner.schema.config import trained_drafts
    from tuner.study.measurer import train_job

    overrides = [*DEFAULT, "model=tiny-random", "search.methods=[ngram,eagle,eagle3]"]  # tiny: no GGUF digest
    docs = _docs(overrides)
    order = list(docs)
    assert order.index("cache-pvc.yaml") < order.index("create-study-job.yaml") < order.index("train-drafts-job.yaml") \
        < order.index("workers-job.yaml") < order.index("report-job.yaml")  # apply order (kustomization)
    claim = docs["cache-pvc.yaml"]["metadata"]["name"]
    pods = {n: _pod_of(docs, n) for n in ("train-drafts-job.yaml", "workers-job.yaml", "report-job.yaml")}
    assert {_cache_claim(p) for p in pods.values()} == {claim}
    for name, pod in pods.items():
        (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "cache"]
        assert mount["mountPath"] == CACHE_DIR and mount.get("readOnly", False) == (name == "report-job.yaml")
    train = pods["train-drafts-job.yaml"]["containers"][0]["args"]
    create = _pod_of(docs, "create-study-job.yaml")["containers"][0]["args"]
    worker = pods["workers-job.yaml"]["containers"][0]["args"]
    assert train[:2] == ["train-draft", "--searched"] and train[2:-1] == create[2:]  # the study's overrides
    cache_arg = [a for a in worker if a.startswith("cache_dir=")]
    assert cache_arg == [train[-1]] and "--wait-drafts" in worker
    # The train Job's config and a worker's (the study's config plus its own overrides) name the same
    # head directories: what the Job trains is what the workers wait for and then find.
    env = {"PGUSER": "tuner", "PGDATABASE": "optuna"}
    local = lambda args: [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a).replace(
        cache_arg[0], f"cache_dir={tmp_path}") for a in args]  # noqa: E731
    trainer = load_config(local(train[2:]))
    study = load_config(local(create[2:]))
    joined = apply_overrides(study.model_dump(mode="json"),
                             [a for a in local(worker[4:]) if not a.startswith("search.")])
    assert trained_drafts(trainer) == trained_drafts(joined) == ("eagle", "eagle3")
    assert [head_dir(train_job(trainer), m) for m in ("eagle", "eagle3")] == \
        [head_dir(train_job(joined), m) for m in ("eagle", "eagle3")]
    # A search without trained drafts: no train Job, no waiting; the cache is still shared.
    plain = _docs([*DEFAULT, "search.methods=[ngram,suffix]"])
    assert "train-drafts-job.yaml" not in plain and "--wait-drafts" not in _pod_of(plain, "workers-job.yaml")[
        "containers"][0]["args"]
    assert _cache_claim(_pod_of(plain, "workers-job.yaml")) == claim


def test_cache_claim_access_mode_and_size_are_settings(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    def pvc(overrides: list[str]) -> dict:
        return _docs(overrides)["cache-pvc.yaml"]["spec"]

    small, big = pvc(DEFAULT), pvc(GPU)
    assert small["accessModes"] == ["ReadWriteMany"]  # workers on several nodes share it
    size = lambda spec: int(spec["resources"]["requests"]["storage"].removesuffix("Gi"))  # noqa: E731
    assert size(big) > size(small) + 2 * load_config(GPU).model.params_b  # room for the model's weights
    one = pvc([*DEFAULT, "distributed.cache_access_mode=ReadWriteOnce", "distributed.cache_storage=50Gi",
               "distributed.storage_class=fast"])
    assert one["accessModes"] == ["ReadWriteOnce"] and one["resources"]["requests"]["storage"] == "50Gi"
    assert one["storageClassName"] == "fast"
    assert main(["render-tuner", *DEFAULT, "distributed.cache_access_mode=ReadOnlyMany", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "distributed.cache_access_mode" in err[0] and "ReadWriteMany" in err[0], err


def test_workers_run_the_engine_the_deployment_serves(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Issue 24: render-tuner for a vLLM FP8 deployment kept engine=builtin in fp32, measuring
    another engine and precision than the one served. The workers now default to deploy's engine;
    an engine= that differs from it is refused in one line naming both keys."""
    docs = _docs([*GPU, "deploy=vllm"])
    create = _pod_of(docs, "create-study-job.yaml")["containers"][0]["args"]
    assert "engine=vllm" in create
    cfg = load_config(create[2:-2])
    assert cfg.engine.kind == "vllm" and cfg.deploy.quantization == "fp8"  # the launcher serves fp8 like the Deployment
    assert _pod_of(docs, "workers-job.yaml")["containers"][0]["image"].split(":")[0].endswith("spectune-vllm")
    assert main(["render-tuner", *GPU, "deploy=vllm", "--out", str(tmp_path / "ok")]) == 0
    assert "note: the workers run engine=vllm, the engine deploy=vllm serves" in capsys.readouterr().err
    assert main(["render-tuner", *GPU, "deploy=vllm", "engine=builtin", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "engine=builtin with deploy=vllm" in err[0] and "give engine=vllm" in err[0], err
    assert not (tmp_path / "x").exists()


def test_every_spectune_image_comes_from_image_repo(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """One setting, image_repo (with image_tag), names every spectune image the manifests use: the
    built-in server, the tuner pods and their CUDA and vLLM variants; at the default repository,
    which publishes none, the render says how to build and push them."""
    repo = "registry.example.com:5000/team"
    seen = set()
    for extra in ([], ["model=llama-3.1-8b-instruct", "hardware=h200x1"], ["model=llama-3.1-8b-instruct",
                                                                        "hardware=h200x1", "deploy=vllm"]):
        docs = _docs([*DEFAULT, *extra, f"image_repo={repo}"])
        seen |= {c["image"] for p in _pods(docs).values() for c in _containers(p) if c["name"] != "postgres"}
    assert seen == {f"{repo}/spectune:0.1.0", f"{repo}/spectune:0.1.0-cuda", f"{repo}/spectune-vllm:0.1.0"}
    assert main(["render", f"image_repo={repo}", "--out", str(tmp_path / "d")]) == 0
    served = yaml.safe_load((tmp_path / "d" / "deployment.yaml").read_text())
    assert {c["image"] for c in served["spec"]["template"]["spec"]["containers"]} == {f"{repo}/spectune:0.1.0"}
    assert "is not published" not in capsys.readouterr().err
    assert main(["render", "--out", str(tmp_path / "e")]) == 0
    assert "note: ghcr.io/spectune/spectune:0.1.0 is not published: build and push it (make image push " \
           "IMAGE_REPO=REPO)" in capsys.readouterr().err
    assert main(["render-tuner", *DEFAULT, "image_repo=Bad Repo", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "image_repo='Bad Repo': not an image repository" in err[0], err


def test_the_report_job_pushes_the_winners_head_when_asked(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """distributed.push_head_to=ORG/NAME: the report Job runs `tuner report ... --push-head ORG/NAME`
    with a write token by Secret reference (distributed.push_token_secret); unset, it pushes nothing."""
    docs = _docs([*DEFAULT, "distributed.push_head_to=me/code-eagle",
                  "distributed.push_token_secret={name: hub-writer, key: tok}"])
    report = _pod_of(docs, "report-job.yaml")["containers"][0]
    assert report["args"][-2:] == ["--push-head", "me/code-eagle"]
    env = {e["name"]: e for e in report["env"]}
    assert env["HF_TOKEN"] == {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hub-writer", "key": "tok"}}}
    assert check_docs(list(docs.items()), "1.33") == []
    plain = _pod_of(_docs(DEFAULT), "report-job.yaml")["containers"][0]
    assert "--push-head" not in plain["args"] and "HF_TOKEN" not in {e["name"] for e in plain["env"]}
    assert main(["render-tuner", *DEFAULT, "distributed.push_head_to=no-slash", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "distributed.push_head_to='no-slash': not a hub repository id" in err[0], err
