"""tuner render: goldens per target and hardware, key fields, strict validation, secrets, determinism, errors.

Regenerate the goldens with SPECTUNE_REGEN_GOLDEN=1 (then review the diff: the field assertions
below must keep passing, so a golden cannot silently absorb a bug).
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest
import yaml

from tuner.schema.fit import startup_budget_s
from deploy.render import render
from deploy.validate import check_dir
from tuner.cli import main
from tuner.run.rundir import render_run
from tuner.schema.compose import load_config, save_config
from tuner.schema.config import BestResult, Figures, Provenance, SpecConfig, UserError

GOLDEN = Path(__file__).parents[1] / "golden"
REGEN = os.environ.get("SPECTUNE_REGEN_GOLDEN") == "1"
DATE = "2026-11-20T14:03:00+00:00"
EAGLE3_8B = "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"
EAGLE_8B = "yuhuili/EAGLE-LLaMA3.1-Instruct-8B"
TUNING_DIR = "/home/alice/spectune"  # where the study ran: no rendered file may name it


def _best(spec: SpecConfig, chain: SpecConfig | None, model: str, hardware: str, engine: str) -> BestResult:
    return BestResult(
        spec=spec, chain_spec=chain,
        metrics=Figures(output_tokens_per_s=412.5, ci_low=405.1, ci_high=419.8, tau=3.42, tpot_p99_ms=9.8),
        baseline=Figures(output_tokens_per_s=160.2, ci_low=158.0, ci_high=162.9, tau=1.0),
        speedup=2.575, reason="fastest feasible trial",
        provenance=Provenance(study=f"{model}-chat", trial=17, storage=f"sqlite:///{TUNING_DIR}/runs/r1/study.db", date=DATE,
                              model=model, hardware=hardware, engine=engine, workload="chat"),
    )


CASES: dict[str, tuple[list[str], BestResult | None]] = {
    # Tree winner tuned on SGLang, rendered for vLLM: the study's best chain (with a K schedule) is served.
    "vllm-h200x1": (["model=llama-3.1-8b-instruct", "hardware=h200x1", "deploy=vllm"], _best(
        SpecConfig(method="eagle3", depth=5, topk=4, budget=8, head_path=EAGLE3_8B),
        SpecConfig(method="eagle3", depth=4, topk=1, budget=5, head_path=EAGLE3_8B,
                   k_per_batch_size=[(1, 8, 4), (9, 64, 2), (65, 512, 0)]),
        "llama-3.1-8b-instruct", "h200x1", "sglang")),
    # 70B on H100s: tensor parallel 2; spec from overrides.
    "vllm-h100x8": (["model=llama-3.3-70b-instruct", "hardware=h100x8", "deploy=vllm", "spec.method=ngram",
                     "spec.depth=3", "spec.budget=4"], None),
    # The CI-style override from the issue, on a run tuned on SGLang with a tree.
    # ... with a ReadWriteMany storage class: one model PVC the 3+ pods share.
    "sglang-h100x8": (["model=llama-3.1-8b-instruct", "hardware=h100x8", "deploy=sglang", "deploy.replicas=3",
                       "deploy.model_cache_access_mode=ReadWriteMany"], _best(
        SpecConfig(method="eagle", depth=5, topk=4, budget=8, head_path=EAGLE_8B), None,
        "llama-3.1-8b-instruct", "h100x8", "sglang")),
    "sglang-h200x1": (["model=llama-3.3-70b-instruct", "hardware=h200x1", "deploy=sglang", "spec.method=eagle3",
                       "spec.depth=3", "spec.topk=2", "spec.budget=6", "spec.head_path=org/eagle3-70b"], None),
    # Built-in server on CPU, with a head trained locally and pushed to a hub repository (`tuner push-head`):
    # an init container downloads it into the model volume.
    "builtin-cpu": ([], _best(
        SpecConfig(method="eagle", depth=3, topk=2, budget=5, head_path="me/smollm2-eagle"),
        None, "smollm2-135m", "cpu", "builtin")),
    "builtin-cpu-tiny": (["model=tiny-random", "spec.method=ngram", "spec.depth=6", "spec.budget=7",
                          "deploy.hpa.enabled=false", "deploy.service_monitor=false", "deploy.pdb_max_unavailable=null"], None),
}


def _render_case(name: str, out: Path) -> tuple[object, list[Path]]:
    overrides, best = CASES[name]
    if best is None:
        return render(load_config(overrides), None, out)
    run = out.parent / f"{out.name}-run"
    save_config(load_config(overrides), run / "config.yaml")
    (run / "best.yaml").write_text(yaml.safe_dump(best.model_dump(mode="json"), sort_keys=False))
    return render_run(run, [], out)


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("render")
    dirs = {}
    for name in CASES:
        _render_case(name, root / name)
        dirs[name] = root / name
    return dirs


def _docs(d: Path) -> dict[str, dict]:
    return {p.name: yaml.safe_load(p.read_text()) for p in sorted(d.glob("*.yaml"))}


def _container(d: Path) -> dict:
    return _docs(d)["deployment.yaml"]["spec"]["template"]["spec"]["containers"][0]


def _notes(err: str) -> list[str]:
    """The `note:` lines of a render but the ones every render with an HPA (its adapter rule) or
    with spectune's image at the unpublished default repository prints."""
    return [ln for ln in err.splitlines() if ln.startswith("note:") and not ln.startswith("note: the HPA scales on")
            and "is not published" not in ln and not ln.startswith(("note: no PrometheusRule", "note: no Speculation"))]


def _adapter_rule(hpa: Path) -> dict:
    """The prometheus-adapter rule written as comments above hpa.yaml's document."""
    lines = [ln for ln in hpa.read_text().splitlines() if ln.startswith("#")]
    start = next(i for i, ln in enumerate(lines) if ln == "# rules:")
    return yaml.safe_load("\n".join(ln[2:] for ln in lines[start:]))


def _opt(args: list[str], flag: str) -> str:
    assert args.count(flag) == 1, (flag, args)
    return args[args.index(flag) + 1]


@pytest.mark.parametrize("name", list(CASES))
def test_golden(name: str, rendered: dict[str, Path]) -> None:
    golden = GOLDEN / name
    got = {p.name: p.read_bytes() for p in rendered[name].iterdir()}
    if REGEN:
        shutil.rmtree(golden, ignore_errors=True)
        golden.mkdir(parents=True)
        for fname, data in got.items():
            (golden / fname).write_bytes(data)
    want = {p.name: p.read_bytes() for p in golden.iterdir()}
    assert sorted(got) == sorted(want)
    for fname in want:
        assert got[fname] == want[fname], f"{name}/{fname} differs from the golden (SPECTUNE_REGEN_GOLDEN=1 to update)"


@pytest.mark.parametrize("version", ["1.29", "1.33", "1.37"])
def test_strictly_valid_for_each_version(version: str, rendered: dict[str, Path]) -> None:
    for name, d in rendered.items():
        assert check_dir(d, version) == [], name


def test_vllm_tree_winner_serves_the_chain_with_k_schedule(rendered: dict[str, Path]) -> None:
    c = _container(rendered["vllm-h200x1"])
    assert c["command"] == ["vllm", "serve"]
    assert c["args"][0] == "meta-llama/Llama-3.1-8B-Instruct"
    spec = json.loads(_opt(c["args"], "--speculative-config"))
    assert spec == {"method": "eagle3", "model": EAGLE3_8B, "num_speculative_tokens": 4,
                    "num_speculative_tokens_per_batch_size": [[1, 8, 4], [9, 64, 2], [65, 512, 0]]}
    assert _opt(c["args"], "--quantization") == "fp8" and _opt(c["args"], "--kv-cache-dtype") == "fp8"
    assert _opt(c["args"], "--port") == "8000" and _opt(c["args"], "--gpu-memory-utilization") == "0.9"
    at = c["args"].index("--served-model-name") + 1  # both names: requests may name the config or the hub id
    assert c["args"][at:at + 3] == ["llama-3.1-8b-instruct", "meta-llama/Llama-3.1-8B-Instruct", "--speculative-config"]
    assert "--tensor-parallel-size" not in c["args"]  # TP 1
    cm = _docs(rendered["vllm-h200x1"])["configmap.yaml"]["data"]
    assert (cm["study"], cm["trial"], cm["date"], cm["tau"]) == ("llama-3.1-8b-instruct-chat", "17", DATE, "3.42")
    assert cm["output_tokens_per_s_ci"] == "[405.1, 419.8]" and cm["spec"] == "eagle3 d4 k1 b5"
    assert yaml.safe_load(cm["served.yaml"])["tuned_spec"]["topk"] == 4


def test_vllm_70b_tensor_parallel_gpus_and_node_placement(rendered: dict[str, Path]) -> None:
    docs = _docs(rendered["vllm-h100x8"])
    pod = docs["deployment.yaml"]["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert _opt(c["args"], "--tensor-parallel-size") == "2"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "2" == c["resources"]["requests"]["nvidia.com/gpu"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert json.loads(_opt(c["args"], "--speculative-config"))["prompt_lookup_max"] == 4
    # Startup budget sized to model load: 70B FP8 weights take far longer than the 8B model.
    cfg = load_config(CASES["vllm-h100x8"][0])
    assert c["startupProbe"]["failureThreshold"] == math.ceil(startup_budget_s(cfg.model, cfg.deploy) / 10)
    small = _container(rendered["vllm-h200x1"])["startupProbe"]["failureThreshold"]
    assert c["startupProbe"]["failureThreshold"] > 2 * small


def test_sglang_ci_override_replicas_and_tree_flags(rendered: dict[str, Path]) -> None:
    docs = _docs(rendered["sglang-h100x8"])
    # The HPA owns the replica count; deploy.replicas=3 becomes its floor (a replicas field would fight it).
    assert "replicas" not in docs["deployment.yaml"]["spec"]
    assert (docs["hpa.yaml"]["spec"]["minReplicas"], docs["hpa.yaml"]["spec"]["maxReplicas"]) == (3, 4)
    c = docs["deployment.yaml"]["spec"]["template"]["spec"]["containers"][0]
    assert c["command"] == ["python3", "-m", "sglang.launch_server"]
    a = c["args"]
    assert (_opt(a, "--speculative-algorithm"), _opt(a, "--speculative-num-steps"), _opt(a, "--speculative-eagle-topk"),
            _opt(a, "--speculative-num-draft-tokens")) == ("EAGLE", "5", "4", "8")
    assert _opt(a, "--speculative-draft-model-path") == EAGLE_8B
    assert _opt(a, "--quantization") == "fp8" and _opt(a, "--kv-cache-dtype") == "fp8_e4m3"
    assert docs["pvc.yaml"]["spec"]["accessModes"] == ["ReadWriteMany"]  # 3 pods share the cache, as asked
    tree = _container(rendered["sglang-h200x1"])["args"]
    assert _opt(tree, "--speculative-algorithm") == "EAGLE3" and _opt(tree, "--speculative-eagle-topk") == "2"


@pytest.mark.parametrize("case", ["sglang-h100x8", "sglang-h200x1"])
def test_sglang_serves_the_metrics_its_monitor_and_hpa_scrape(rendered: dict[str, Path], case: str) -> None:
    """The ServiceMonitor and the HPA (sglang:num_queue_reqs) read /metrics, which SGLang serves
    only with --enable-metrics."""
    docs = _docs(rendered[case])
    # the HPA reads the series under the name the prometheus-adapter rule atop hpa.yaml serves it as
    assert docs["hpa.yaml"]["spec"]["metrics"][0]["pods"]["metric"]["name"] == "sglang_num_queue_reqs"
    rule = _adapter_rule(rendered[case] / "hpa.yaml")["rules"]["custom"][0]
    assert rule["seriesQuery"].startswith('{__name__="sglang:num_queue_reqs"') and "servicemonitor.yaml" in docs
    assert rule["name"] == {"matches": "^sglang:num_queue_reqs$", "as": "sglang_num_queue_reqs"}
    assert "--enable-metrics" in _container(rendered[case])["args"]


def test_builtin_is_cpu_only_non_root_and_serves_the_spec(rendered: dict[str, Path]) -> None:
    docs = _docs(rendered["builtin-cpu"])
    text = "".join(p.read_text() for p in rendered["builtin-cpu"].glob("*.yaml"))
    assert "nvidia.com/gpu" not in text
    pod = docs["deployment.yaml"]["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["command"] == ["tuner", "serve"]
    assert c["resources"]["requests"] == {"cpu": "2", "memory": "12Gi"}
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 1000
    # The overrides compose back into the same spec, with the hub head read from where the init container puts it.
    cfg = load_config(c["args"])  # exactly what `tuner serve` composes in the pod
    assert cfg.engine.kind == "builtin" and cfg.cache_dir == "/models/spectune"
    assert cfg.spec == SpecConfig(method="eagle", depth=3, topk=2, budget=5, head_path="/models/drafts/me--smollm2-eagle")
    assert pod["initContainers"][0]["command"] == ["hf", "download", "me/smollm2-eagle", "--local-dir",
                                                   "/models/drafts/me--smollm2-eagle"]
    tiny = _docs(rendered["builtin-cpu-tiny"])
    assert {"hpa.yaml", "servicemonitor.yaml", "pdb.yaml"}.isdisjoint(tiny)
    assert "hpa.yaml" not in yaml.safe_load((rendered["builtin-cpu-tiny"] / "kustomization.yaml").read_text())["resources"]


@pytest.mark.parametrize("name", list(CASES))
def test_common_objects_and_hardening(name: str, rendered: dict[str, Path]) -> None:
    d = rendered[name]
    docs = _docs(d)
    kust = docs.pop("kustomization.yaml")
    # the namespace is the cluster's: not in the kustomization unless deploy.create_namespace=true
    assert sorted(kust["resources"]) == sorted(docs) and kust["resources"][0] == "configmap.yaml"
    assert "namespace.yaml" not in docs and (d / "README.md").is_file()
    dep = docs["deployment.yaml"]
    pod = dep["spec"]["template"]["spec"]
    c = pod["containers"][0]
    sc = c["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert c["ports"] == [{"containerPort": 8000, "name": "http", "protocol": "TCP"}]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}
    assert {"mountPath": "/dev/shm", "name": "dshm"} in c["volumeMounts"]
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["dshm"]["emptyDir"]["medium"] == "Memory"
    cfg = load_config(CASES[name][0])
    if cfg.deploy.model_cache_access_mode == "ReadWriteMany":  # one claim the pods share
        assert vols["model-cache"]["persistentVolumeClaim"]["claimName"] == docs["pvc.yaml"]["metadata"]["name"]
    else:  # a claim per pod: a surge pod or a replica on another node never waits on an attached volume
        assert "pvc.yaml" not in docs
        claim = vols["model-cache"]["ephemeral"]["volumeClaimTemplate"]["spec"]
        assert claim["accessModes"] == ["ReadWriteOnce"] and claim["resources"]["requests"]["storage"] == (
            cfg.deploy.model_cache_size)
    # a rollout starts the new pod first: with one replica there is no moment without a pod
    assert dep["spec"]["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    ann = dep["spec"]["template"]["metadata"]["annotations"]
    assert (ann["prometheus.io/scrape"], ann["prometheus.io/port"], ann["prometheus.io/path"]) == ("true", "8000", "/metrics")
    assert docs["service.yaml"]["spec"]["ports"][0]["targetPort"] == "http"
    sel = dep["spec"]["selector"]["matchLabels"]
    assert docs["service.yaml"]["spec"]["selector"] == sel
    if "servicemonitor.yaml" in docs:
        assert docs["servicemonitor.yaml"]["spec"]["selector"]["matchLabels"] == sel
    if "hpa.yaml" in docs:
        m = docs["hpa.yaml"]["spec"]["metrics"][0]
        assert m["type"] == "Pods" and m["pods"]["target"] == {"type": "AverageValue", "averageValue": "5"}
        assert docs["hpa.yaml"]["apiVersion"] == "autoscaling/v2"
    if "pdb.yaml" in docs:  # never one that blocks `kubectl drain` (minAvailable 1 of 1 pod did)
        assert docs["pdb.yaml"]["spec"]["selector"]["matchLabels"] == sel
        assert docs["pdb.yaml"]["spec"]["maxUnavailable"] == 1 and "minAvailable" not in docs["pdb.yaml"]["spec"]


def test_hf_token_only_by_secret_reference(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    secret = "hf_THISMUSTNEVERAPPEAR1234"
    monkeypatch.setenv("HF_TOKEN", secret)
    monkeypatch.setenv("HUGGING_FACE_HUB_TOKEN", secret)
    cfg = load_config(["model=llama-3.1-8b-instruct", "hardware=h200x1", "deploy=vllm", "spec.method=ngram",
                       "deploy.hf_token_secret.name=my-hf", "deploy.hf_token_secret.key=tok"])
    render(cfg, None, tmp_path)
    docs = [yaml.safe_load(p.read_text()) for p in tmp_path.glob("*.yaml")]
    assert secret not in "".join(p.read_text() for p in tmp_path.glob("*.yaml"))
    assert all(doc["kind"] != "Secret" for doc in docs)
    env = {e["name"]: e for e in _container(tmp_path)["env"]}
    assert env["HF_TOKEN"] == {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "my-hf", "key": "tok"}}}
    assert all("value" not in e for n, e in env.items() if "TOKEN" in n)


def test_builtin_pod_gets_the_hub_token_by_the_same_reference(rendered: dict[str, Path], tmp_path: Path) -> None:
    """Issue 38: the built-in server (and its draft fetch) reads HF_TOKEN from deploy.hf_token_secret
    as vLLM's and SGLang's do, so a gated model downloads. Its default is null: the packaged model needs
    no hub, and a required Secret the cluster lacks would keep the default pod from starting."""
    ref = {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}}
    pod = _docs(rendered["builtin-cpu"])["deployment.yaml"]["spec"]["template"]["spec"]
    assert all(e["name"] != "HF_TOKEN" for c in [*pod["containers"], *pod.get("initContainers", [])] for e in c.get("env", []))
    assert "hf-token" not in (rendered["builtin-cpu"] / "README.md").read_text()
    assert ref in _container(rendered["vllm-h200x1"])["env"]
    render(load_config(["spec.method=ngram", "deploy.hf_token_secret={name: hf-token, key: token}"]), None, tmp_path)
    pod = _docs(tmp_path)["deployment.yaml"]["spec"]["template"]["spec"]
    for c in [*pod["containers"], *pod.get("initContainers", [])]:
        assert ref in c["env"], c["name"]  # the same reference as the vLLM pod's
    assert "a Secret hf-token with key token" in (tmp_path / "README.md").read_text()


def test_render_is_byte_identical(tmp_path: Path) -> None:
    for i in (1, 2):
        _render_case("vllm-h200x1", tmp_path / f"r{i}")
    a, b = sorted((tmp_path / "r1").iterdir()), sorted((tmp_path / "r2").iterdir())
    assert [p.name for p in a] == [p.name for p in b]
    assert all(x.read_bytes() == y.read_bytes() for x, y in zip(a, b))


def test_tree_winner_without_chain_is_refused_for_vllm(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run = tmp_path / "run"
    save_config(load_config(["model=llama-3.1-8b-instruct", "hardware=h200x1"]), run / "config.yaml")
    best = _best(SpecConfig(method="eagle", depth=5, topk=4, budget=8, head_path=EAGLE_8B), None,
                 "llama-3.1-8b-instruct", "h200x1", "sglang")
    (run / "best.yaml").write_text(yaml.safe_dump(best.model_dump(mode="json")))
    assert main(["render", "--from", str(run), "deploy=vllm"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is a tree (topk=4)" in err[0] and "no chain_spec" in err[0]
    assert not (run / "k8s").exists()


def test_tree_to_chain_note_on_stderr(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    _, best = CASES["vllm-h200x1"]
    run = tmp_path / "run"
    save_config(load_config(["model=llama-3.1-8b-instruct", "hardware=h200x1"]), run / "config.yaml")
    (run / "best.yaml").write_text(yaml.safe_dump(best.model_dump(mode="json")))
    # Overrides on the command line apply on top of the run's saved config (deploy group + a key).
    assert main(["render", "--from", str(run), "deploy=vllm", "deploy.replicas=2"]) == 0
    out = capsys.readouterr()
    notes = _notes(out.err)
    assert len(notes) == 1 and "serving the study's best chain 'eagle3 d4 k1 b5'" in notes[0]
    assert "deploy=vllm" in out.out and "valid" in out.out
    assert _docs(run / "k8s")["hpa.yaml"]["spec"]["minReplicas"] == 2


def test_ci_override_command(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # The issue's command on the default model (no EAGLE head anywhere): one clear line, exit 2.
    assert main(["render", "deploy=sglang", "hardware=h100x8", "deploy.replicas=3", "--out", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot be served by deploy=sglang" in err[0] and "draft_sources" in err[0]
    # Issue 37: the real reason (SGLang runs n-gram only as a tree), not a list that holds ngram
    assert "'ngram d4 k1 b5' cannot be served by deploy=sglang: spec.topk=1 with spec.method=ngram and " \
           "engine=sglang: sglang runs ngram as a tree only" in err[0], err[0]
    assert "give spec.topk=2 (an n-gram tree, not measured) or spec.method=eagle3" in err[0]
    assert not (tmp_path / "a").exists()
    # With a model that publishes heads, the same overrides render valid manifests.
    out = tmp_path / "b"
    assert main(["render", "model=llama-3.1-8b-instruct", "deploy=sglang", "hardware=h100x8", "deploy.replicas=3",
                 "--out", str(out)]) == 0
    assert _docs(out)["hpa.yaml"]["spec"]["minReplicas"] == 3
    fixed = tmp_path / "c"  # without an HPA the Deployment carries the count itself
    assert main(["render", "model=llama-3.1-8b-instruct", "deploy=sglang", "hardware=h100x8", "deploy.replicas=3",
                 "deploy.hpa.enabled=false", "--out", str(fixed)]) == 0
    assert _docs(fixed)["deployment.yaml"]["spec"]["replicas"] == 3 and not (fixed / "hpa.yaml").exists()
    assert _opt(_container(out)["args"], "--speculative-algorithm") == "EAGLE3"
    assert main(["render", "--check", str(out)]) == 0


def test_fit_check_error_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    rc = main(["render", "model=llama-3.3-70b-instruct", "deploy=vllm", "hardware=l4x1", "--out", str(tmp_path)])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("error: model llama-3.3-70b-instruct does not fit hardware l4x1:") and "GiB" in err[0]


def test_gpu_target_needs_gpu_hardware() -> None:
    with pytest.raises(UserError, match="deploy=vllm with hardware=cpu"):
        render(load_config(["deploy=vllm"]), None, Path("/nonexistent/never-written"))


def test_check_reports_one_line_per_invalid_doc(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    render(load_config([]), None, tmp_path)
    dep = yaml.safe_load((tmp_path / "deployment.yaml").read_text())
    dep["spec"]["template"]["spec"]["containers"][0]["resourcez"] = {}
    (tmp_path / "deployment.yaml").write_text(yaml.safe_dump(dep))
    sm = yaml.safe_load((tmp_path / "servicemonitor.yaml").read_text())
    sm["spec"]["endpoints"][0]["interval"] = "every 15 seconds"
    (tmp_path / "servicemonitor.yaml").write_text(yaml.safe_dump(sm))
    assert main(["render", "--check", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2
    assert err[0].startswith("deployment.yaml: Deployment/spectune: spec.template.spec.containers[0]:") and "resourcez" in err[0]
    assert err[1].startswith("servicemonitor.yaml: ServiceMonitor/spectune: spec.endpoints[0].interval:")


def test_check_names_what_the_api_server_refuses(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Issues 37 / 38.5: --check gives a tab's line and column, and refuses what the schema allows but
    the API server does not: both PDB fields, a Service name that is no DNS-1035 label, an object
    name that is no DNS-1123 subdomain."""
    render(load_config([]), None, tmp_path)
    pdb = yaml.safe_load((tmp_path / "pdb.yaml").read_text())
    pdb["spec"]["minAvailable"] = 1
    (tmp_path / "pdb.yaml").write_text(yaml.safe_dump(pdb))
    svc = yaml.safe_load((tmp_path / "service.yaml").read_text())
    svc["metadata"]["name"] = "1spectune"
    (tmp_path / "service.yaml").write_text(yaml.safe_dump(svc))
    cm = (tmp_path / "configmap.yaml").read_text()
    (tmp_path / "configmap.yaml").write_text(cm.replace("\n  name: ", "\n\tname: ", 1))
    dep = yaml.safe_load((tmp_path / "deployment.yaml").read_text())
    dep["metadata"]["name"] = "Spec_Tune"
    (tmp_path / "deployment.yaml").write_text(yaml.safe_dump(dep))
    assert main(["render", "--check", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    err = sorted(captured.err.strip().splitlines())
    assert len(err) == 4 and captured.out == "" and "Traceback" not in captured.err, err
    line = cm[:cm.index("\n  name: ")].count("\n") + 2
    assert err[0] == (f"configmap.yaml: not valid YAML at line {line}, column 1: found character '\\t' that cannot "
                      "start any token (a tab: YAML indents with spaces only)")
    assert err[1].startswith("deployment.yaml: Deployment/Spec_Tune: metadata.name='Spec_Tune': not a name Kubernetes "
                             "accepts here (a DNS-1123 subdomain")
    assert err[2] == ("pdb.yaml: PodDisruptionBudget/spectune: spec: minAvailable and maxUnavailable are mutually "
                      "exclusive (a PodDisruptionBudget takes one)")
    assert err[3].startswith("service.yaml: Service/1spectune: metadata.name='1spectune': not a name Kubernetes "
                             "accepts here (a DNS-1035 label")


def test_check_catches_fields_unknown_to_an_older_version(tmp_path: Path) -> None:
    render(load_config([]), None, tmp_path)
    dep = yaml.safe_load((tmp_path / "deployment.yaml").read_text())
    # Pod-level `resources` exists in recent schemas only: strict 1.29 must reject it.
    dep["spec"]["template"]["spec"]["resources"] = {"limits": {"cpu": "2"}}
    (tmp_path / "deployment.yaml").write_text(yaml.safe_dump(dep))
    assert check_dir(tmp_path, "1.37") == []
    assert len(check_dir(tmp_path, "1.29")) == 1


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
def test_kubectl_kustomize_builds_the_directory(rendered: dict[str, Path]) -> None:
    import subprocess

    r = subprocess.run(["kubectl", "kustomize", str(rendered["vllm-h100x8"])], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    kinds = [d["kind"] for d in yaml.safe_load_all(r.stdout)]
    assert sorted(kinds) == sorted(["ConfigMap", "Deployment", "Service", "ServiceMonitor", "PodDisruptionBudget",
                                    "HorizontalPodAutoscaler", "ConfigMap"])  # the second: the Grafana dashboard


def test_example_ci_workflow_commands_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import shlex

    workflow = yaml.safe_load((Path(__file__).parents[2] / "docs/ci/render-manifests.yml").read_text())
    _, best = CASES["vllm-h200x1"]  # a tree winner with a chain_spec
    run = tmp_path / "run"
    save_config(load_config(["model=llama-3.1-8b-instruct", "hardware=h100x8"]), run / "config.yaml")
    (run / "best.yaml").write_text(yaml.safe_dump(best.model_dump(mode="json")))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RUN_DIR", str(run))
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    commands = [ln.strip() for step in workflow["jobs"]["render"]["steps"] for ln in step.get("run", "").splitlines()
                if ln.strip().startswith("tuner ") and "apply" not in ln]
    assert len(commands) >= 5
    for cmd in commands:
        argv = [os.path.expandvars(a) for a in shlex.split(cmd)[1:]]
        assert main(argv) == 0, cmd
    assert _docs(tmp_path / "out")["hpa.yaml"]["spec"]["minReplicas"] == 3


def test_retargeting_a_run_says_the_speedup_was_measured_elsewhere(tmp_path: Path) -> None:
    _, best = CASES["sglang-h100x8"]
    run = tmp_path / "run"
    save_config(load_config(["model=llama-3.1-8b-instruct", "hardware=h100x8", "deploy=sglang"]), run / "config.yaml")
    (run / "best.yaml").write_text(yaml.safe_dump(best.model_dump(mode="json")))
    plan, _ = render_run(run, [], tmp_path / "same")
    assert plan.served.notes == ()
    plan, _ = render_run(run, ["hardware=h200x1", "+workload=code", "deploy.hpa.max_replicas=8"], tmp_path / "other")
    assert plan.cfg.hardware.name == "h200x1" and plan.cfg.workload.name == "code"
    assert plan.cfg.deploy.target == "sglang" and plan.cfg.deploy.hpa.max_replicas == 8  # the rest stays the run's
    assert any("tuned for model llama-3.1-8b-instruct on h100x8" in n and "h200x1" in n for n in plan.served.notes)


def test_check_reports_a_missing_kustomization_resource(tmp_path: Path) -> None:
    render(load_config([]), None, tmp_path)
    (tmp_path / "service.yaml").unlink()
    assert check_dir(tmp_path, "1.33") == ["kustomization.yaml: resource service.yaml does not exist"]


def test_rerender_removes_files_it_no_longer_writes(tmp_path: Path) -> None:
    render(load_config([]), None, tmp_path)
    assert (tmp_path / "hpa.yaml").exists()
    (tmp_path / "mine.yaml").write_text("# kept: not written by tuner render\n")
    render(load_config(["deploy.hpa.enabled=false"]), None, tmp_path)
    assert not (tmp_path / "hpa.yaml").exists() and (tmp_path / "mine.yaml").exists()
    assert check_dir(tmp_path, "1.33") == []  # the kustomization's resources, as kubectl apply -k sees them


def test_builtin_memory_fit_and_dtype(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # (a 40 GiB host holds the built-in engine's fp32 load, 30 GiB: the server's ~46 GiB is the refusal)
    assert main(["render", "model=llama-3.1-8b-instruct", "hardware.memory_gib=40", "--out", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs ~46 GiB of memory on the built-in server" in err[0] and "has 40 GiB" in err[0]
    # The engine's dtype / FP8 emulation travel to the pod (acceptance was measured under them).
    p, _ = render(load_config(["engine.builtin.dtype=bfloat16", "engine.builtin.weights=fp8"]), None, tmp_path / "b")
    assert "engine.builtin.dtype=bfloat16" in p.args and "engine.builtin.weights=fp8" in p.args
    p, _ = render(load_config(["engine.builtin.weights=bf16"]), None, tmp_path / "c")
    assert "engine.builtin.weights=bf16" in p.args


def test_servicemonitor_schema_is_strict() -> None:
    from deploy.manifests import build
    from deploy.validate import doc_error

    _, docs = build(load_config([]))
    sm = dict(docs)["servicemonitor.yaml"]
    assert doc_error(sm, "1.33") is None
    typo = json.loads(json.dumps(sm))
    typo["spec"]["endpoints"][0]["portt"] = "http"
    assert "'portt' was unexpected" in doc_error(typo, "1.33")
    no_selector = json.loads(json.dumps(sm))
    del no_selector["spec"]["selector"]
    assert "'selector' is a required property" in doc_error(no_selector, "1.33")
    bad_scheme = json.loads(json.dumps(sm))
    bad_scheme["spec"]["endpoints"][0]["scheme"] = "tcp"
    assert doc_error(bad_scheme, "1.33").startswith("spec.endpoints[0].scheme:")


# Issue 25: bad `tuner render` inputs, each one line naming the cause, exit 2, nothing written.
# (arguments; "{tmp}" stands for the test's directory, which holds a file named "afile")
BAD_RENDER = [
    (["--out", "{tmp}/afile"], "--out {tmp}/afile: is an existing file, not a directory"),
    (["--out", "{tmp}/afile/sub"], "--out {tmp}/afile/sub: cannot create the output directory (a parent is a file"),
    (["--out", ""], "--out '': an empty path; give the output directory"),
    (["--out", " "], "--out ' ': an empty path"),
    (["deploy.model_cache_size=lots", "--out", "{tmp}/o"], "deploy.model_cache_size='lots': not a Kubernetes quantity"),
    (["deploy.hpa.target_average=five", "--out", "{tmp}/o"], "deploy.hpa.target_average='five': not a Kubernetes quantity"),
    (["deploy.image_tag=bad tag", "--out", "{tmp}/o"], "deploy.image_tag='bad tag': not an image tag"),
    (["deploy.namespace=My_NS", "--out", "{tmp}/o"], "deploy.namespace='My_NS': not a Kubernetes namespace"),
    (["deploy.max_model_len=999999999", "--out", "{tmp}/o"], "deploy.max_model_len=999999999 exceeds the context"),
    (["deploy.k8s_version=1.20", "--out", "{tmp}/o"], "deploy.k8s_version='1.20': allowed are 1.25–1.37"),
]


@pytest.mark.parametrize("args,fragment", BAD_RENDER, ids=[" ".join(a) for a, _ in BAD_RENDER])
def test_bad_render_input_one_line_exit_2(args: list[str], fragment: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture) -> None:
    monkeypatch.chdir(tmp_path)  # an empty --out must not land here either
    (tmp_path / "afile").write_text("not a directory\n")
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(["render", *(a.replace("{tmp}", str(tmp_path)) for a in args)]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    assert fragment.replace("{tmp}", str(tmp_path)) in lines[0], lines[0]
    assert captured.out == "" and sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written


def test_render_without_out_names_the_directory_it_wrote(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["render"]) == 0
    captured = capsys.readouterr()
    out = captured.out.strip().splitlines()
    # the HPA's metric needs an adapter: said on every render that has an HPA; the built-in server's
    # image is not published at the default image_repo: said too
    assert captured.err.strip().splitlines() == [
        "note: the HPA scales on vllm_num_requests_waiting from the custom metrics API: install prometheus-adapter "
        "with the rule written at the top of hpa.yaml (docs/deploy.md, Autoscaling), or set deploy.hpa.enabled=false",
        "note: ghcr.io/spectune/spectune:0.1.0 is not published: build and push it (make image push IMAGE_REPO=REPO) "
        "and render with image_repo=REPO (docs/deploy.md, Images)"]
    # what the cluster must already have, one line each, then the summary line
    assert [ln for ln in out if not ln.startswith("needs: ")] == out[-1:]
    assert "needs: the namespace spectune (kubectl create namespace spectune; or render with " \
           "deploy.create_namespace=true)" in out
    assert out[-1].startswith(f"rendered 7 files into {tmp_path / 'runs' / 'k8s'} (default --out; ")
    assert (tmp_path / "runs" / "k8s" / "kustomization.yaml").is_file()


def _run(tmp_path: Path, overrides: list[str], best: BestResult) -> Path:
    run = tmp_path / "run"
    save_config(load_config(overrides), run / "config.yaml")
    (run / "best.yaml").write_text(yaml.safe_dump(best.model_dump(mode="json")))
    return run


def test_render_from_run_applies_spec_overrides_to_the_winner(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Issue 25: `tuner render --from RUN spec.depth=5` serves the run's winner with the override
    applied (a chain's budget follows its depth), says so in a note, and keeps the measured winner
    as tuned_spec; on vLLM a tree winner's best chain takes the same override."""
    run = _run(tmp_path, [], _best(SpecConfig(method="ngram", depth=3, topk=1, budget=4), None,
                                   "smollm2-135m", "cpu", "builtin"))
    assert main(["render", "--from", str(run), "spec.depth=5", "--out", str(tmp_path / "o")]) == 0
    captured = capsys.readouterr()
    assert "spec 'ngram d5 k1 b6'" in captured.out
    notes = _notes(captured.err)
    assert notes == ["note: spec.depth=5 on top of the winner 'ngram d3 k1 b4': serving 'ngram d5 k1 b6' "
                     "(not measured: re-measure to confirm the speedup)"]
    data = _docs(tmp_path / "o")["configmap.yaml"]["data"]
    served = yaml.safe_load(data["served.yaml"])
    assert data["spec"] == "ngram d5 k1 b6" and served["tuned_spec"]["depth"] == 3
    assert served["spec"]["depth"] == 5 and "spec.depth=5" in _container(tmp_path / "o")["args"]

    _, tree = CASES["vllm-h200x1"]
    run = _run(tmp_path / "t", ["model=llama-3.1-8b-instruct", "hardware=h200x1"], tree)
    assert main(["render", "--from", str(run), "deploy=vllm", "spec.depth=6", "--out", str(tmp_path / "v")]) == 0
    assert "spec 'eagle3 d6 k1 b7'" in capsys.readouterr().out
    assert json.loads(_opt(_container(tmp_path / "v")["args"], "--speculative-config"))["num_speculative_tokens"] == 6
    # an override that leaves a tree for vLLM, or meets --projected, is refused in one line
    for args, needle in ((["deploy=vllm", "spec.topk=4"], "spec.topk=4: 'eagle3 d5 k4 b8' is a tree (topk=4) and vLLM "
                                                          "verifies chains only: give spec.topk=1"),
                         (["deploy=vllm", "spec.depth=3"], "spec.depth=3 on the winner's best chain 'eagle3 d4 k1 b5' "
                                                           "(what vLLM serves for a tree): spec.k_per_batch_size="),
                         (["hardware=h100x8", "spec.depth=4", "--projected"], "spec.depth=4 with --projected")):
        assert main(["render", "--from", str(run), *args, "--out", str(tmp_path / "x")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0], err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("args,needle", [
    (["--from", "{tmp}"], "got --from"),
    (["--projected"], "got --projected"),
    (["--out", "{tmp}/o"], "got --out"),
    (["deploy=vllm"], "got deploy=vllm"),
])
def test_check_refuses_what_it_cannot_honour(args: list[str], needle: str, tmp_path: Path,
                                             capsys: pytest.CaptureFixture) -> None:
    """Issue 25: --check validates a directory for deploy.k8s_version; --from, --projected, --out or
    another override would be dropped, so each is refused in one line."""
    render(load_config([]), None, tmp_path / "k8s")
    assert main(["render", "--check", str(tmp_path / "k8s"), *(a.replace("{tmp}", str(tmp_path)) for a in args)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --check {tmp_path / 'k8s'} validates existing manifests")
    assert needle in err[0] and not (tmp_path / "o").exists()
    assert main(["render", "--check", str(tmp_path / "k8s"), "deploy.k8s_version=1.29"]) == 0


def test_replicas_the_hpa_cannot_keep_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Issue 25: with an HPA, deploy.replicas is its floor: 0, or more than deploy.hpa.max_replicas,
    is refused in one line (it was silently raised to 1 / raised the max). Without an HPA, 0 renders
    a Deployment with no pods, as asked."""
    for replicas, needle in ((0, "deploy.replicas=0 with deploy.autoscaler=hpa"),
                             (6, "deploy.replicas=6 exceeds deploy.hpa.max_replicas=4")):
        assert main(["render", f"deploy.replicas={replicas}", "--out", str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0], err
    assert not (tmp_path / "o").exists()
    assert main(["render", "deploy.replicas=4", "--out", str(tmp_path / "four")]) == 0
    assert _docs(tmp_path / "four")["hpa.yaml"]["spec"]["minReplicas"] == 4
    assert _docs(tmp_path / "four")["hpa.yaml"]["spec"]["maxReplicas"] == 4
    assert main(["render", "deploy.replicas=0", "deploy.hpa.enabled=false", "--out", str(tmp_path / "zero")]) == 0
    assert _docs(tmp_path / "zero")["deployment.yaml"]["spec"]["replicas"] == 0


def _line(path: Path, needle: str) -> str:
    hits = [ln for ln in path.read_text().splitlines() if needle in ln]
    assert len(hits) == 1, (needle, hits)
    return hits[0]


@pytest.mark.parametrize("name", list(CASES))
def test_each_derived_value_says_where_it_came_from(name: str, rendered: dict[str, Path]) -> None:
    """Issue 25.9: one YAML comment per derived value (TP, max model len, probe thresholds,
    requests), saying from what it was derived, with the numbers the manifest carries."""
    from deploy.manifests import plan

    cfg = load_config(CASES[name][0])
    p = plan(cfg, CASES[name][1])
    dep = rendered[name] / "deployment.yaml"
    c = _container(rendered[name])
    threshold = c["startupProbe"]["failureThreshold"]
    assert f"failureThreshold: {threshold}  # {threshold} x 10 s >= {startup_budget_s(cfg.model, cfg.deploy)} s " \
           "start-up budget" in dep.read_text()
    assert _line(dep, f"cpu: '{c['resources']['requests']['cpu']}'").split("  # ")[1].startswith("cpu: ")
    assert "memory: " in _line(dep, f"memory: {c['resources']['requests']['memory']}  #")
    text = dep.read_text()
    assert text.count("failureThreshold: 3  # ") == 2  # liveness and readiness say what 3 failures mean
    if cfg.deploy.target == "builtin":
        return
    gpu = _line(dep, f"nvidia.com/gpu: '{p.tp}'  #")
    assert f"# TP {p.tp}: the smallest power of two dividing {cfg.model.num_attention_heads} heads" in gpu
    flag = "--max-model-len" if cfg.deploy.target == "vllm" else "--context-length"
    value_line = text.splitlines()[text.splitlines().index(f"        - {flag}") + 1]
    assert value_line.startswith(f"        - '{p.max_len}'  # min(model.max_context={cfg.model.max_context}, ")
    if p.tp > 1:
        tp_flag = "--tensor-parallel-size" if cfg.deploy.target == "vllm" else "--tp"
        assert text.splitlines()[text.splitlines().index(f"        - {tp_flag}") + 1].startswith(
            f"        - '{p.tp}'  # TP {p.tp}: ")


def test_a_stock_cluster_accepts_the_defaults(rendered: dict[str, Path]) -> None:
    """Issue 25.9: defaults that work on a stock cluster: a PDB that lets `kubectl drain` evict the
    one replica, a ReadWriteOnce model volume per pod (no ReadWriteMany storage class needed), a
    rollout without downtime, both model names served, the HPA's adapter rule written out, and no
    path of the tuning machine in the provenance."""
    docs = _docs(rendered["vllm-h200x1"])
    assert docs["pdb.yaml"]["spec"]["maxUnavailable"] == 1 and "minAvailable" not in docs["pdb.yaml"]["spec"]
    assert "pvc.yaml" not in docs
    rule = _adapter_rule(rendered["vllm-h200x1"] / "hpa.yaml")["rules"]["custom"][0]
    assert rule["name"]["as"] == docs["hpa.yaml"]["spec"]["metrics"][0]["pods"]["metric"]["name"]
    assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
    sglang = _container(rendered["sglang-h200x1"])["args"]
    assert sglang.count("--served-model-name") == 1 and _opt(sglang, "--served-model-name") == "llama-3.3-70b-instruct"
    assert not sglang[sglang.index("--served-model-name") + 2].startswith("meta-llama")  # SGLang takes one name
    for name, d in rendered.items():
        for f in d.iterdir():
            assert TUNING_DIR not in f.read_text(), (name, f.name)
    best = yaml.safe_load(docs["configmap.yaml"]["data"]["best.yaml"])
    assert best["provenance"]["storage"] == "sqlite:///study.db"  # the study file, as named in its run directory


def test_replace_rollout_and_a_min_available_budget(tmp_path: Path) -> None:
    """deploy.rollout=replace (no spare GPU needed) and a minAvailable below the replicas at rest
    render as asked, and pass the strict check."""
    cfg = load_config(["model=llama-3.1-8b-instruct", "hardware=h200x1", "deploy=vllm", "deploy.rollout=replace",
                       "deploy.pdb_max_unavailable=null", "deploy.pdb_min_available=2", "deploy.replicas=3"])
    render(cfg, None, tmp_path)
    docs = _docs(tmp_path)
    assert docs["deployment.yaml"]["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    assert docs["pdb.yaml"]["spec"]["minAvailable"] == 2 and "maxUnavailable" not in docs["pdb.yaml"]["spec"]
    assert "downtime with one replica" in _line(tmp_path / "deployment.yaml", "maxSurge: 0")
    assert check_dir(tmp_path, "1.33") == []


def test_a_suffix_winner_on_vllm_runs_the_vllm_image_with_arctic_inference(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture) -> None:
    # vLLM imports arctic-inference for method suffix and the stock image has none: the Deployment
    # runs spectune's image of it (Dockerfile.vllm-suffix, `make image`), from image_repo/image_tag.
    base = ["model=llama-3.1-8b-instruct", "hardware=h200x1", "deploy=vllm"]
    cfg = load_config(base)
    want = f"ghcr.io/spectune/spectune-vllm-suffix:{cfg.image_tag}-vllm-{cfg.deploy.image_tag}"
    run = tmp_path / "run"
    save_config(cfg, run / "config.yaml")
    best = _best(SpecConfig(method="suffix", depth=4, budget=5), None, "llama-3.1-8b-instruct", "h200x1", "vllm")
    (run / "best.yaml").write_text(yaml.safe_dump(best.model_dump(mode="json")))
    assert main(["render", "--from", str(run), "--out", str(tmp_path / "k8s")]) == 0
    out, err = capsys.readouterr()
    c = _container(tmp_path / "k8s")
    assert c["image"] == want and c["command"] == ["vllm", "serve"]
    assert json.loads(_opt(c["args"], "--speculative-config"))["method"] == "suffix"
    assert f"note: {want} is not published" in err and ", valid)" in out  # strictly validated by the render
    # one setting names every spectune image; other methods and a user's own image are served as given
    render(load_config([*base, "spec.method=suffix", "spec.depth=4", "image_repo=registry.example.com/team"]),
           None, tmp_path / "repo")
    assert _container(tmp_path / "repo")["image"] == want.replace("ghcr.io/spectune", "registry.example.com/team")
    render(load_config([*base, "spec.method=ngram", "spec.depth=4"]), None, tmp_path / "ngram")
    assert _container(tmp_path / "ngram")["image"] == f"vllm/vllm-openai:{cfg.deploy.image_tag}"
    render(load_config([*base, "spec.method=suffix", "spec.depth=4", "deploy.image=registry.example.com/team/vllm-arctic",
                        "deploy.image_tag=v1"]), None, tmp_path / "own")
    assert _container(tmp_path / "own")["image"] == "registry.example.com/team/vllm-arctic:v1"
    # without a vLLM release there is no image to name: one line, exit 2
    assert main(["render", *base, "spec.method=suffix", "spec.depth=4", "deploy.image_tag=null",
                 "--out", str(tmp_path / "untagged")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "deploy.image_tag=null with spec.method=suffix" in err[0]
