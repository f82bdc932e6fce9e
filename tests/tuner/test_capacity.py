"""Capacity at the SLOs (search.capacity=true): the bracketing search over request rates finds a
planted capacity, best.yaml records off's and the winner's, the report plots latency against rate
with the SLO lines, and deploy.target_rate sizes the replicas from the winner's capacity."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tuner.schema.compose import load_config
from tuner.schema.config import SLO, Rate, SpecConfig, UserError
from tuner.study.capacity import search_capacity, slo_holds
from tuner.study.objective import Sample

CAP = {"off": 3.0, "ngram": 7.5}  # requests/s each serves within the SLOs
SLO_TTFT = 1000.0


def planted(calls: list | None = None):
    """A MeasureFn whose TTFT p99 breaks the SLO above each configuration's planted capacity (a
    queue that grows once arrivals outpace service), and whose speed favours n-gram."""

    def measure(spec: SpecConfig, split: str, level) -> Sample:
        if calls is not None:
            calls.append((spec.method, level))
        cap = CAP["off" if spec.method == "off" else "ngram"]
        if isinstance(level, Rate):
            over = level.rps / cap
            ttft = 200.0 * over if over <= 1 else 200.0 + 4000.0 * (over - 1)
            return Sample(10.0 * min(level.rps, cap), 2.0, ttft, 20.0, goodput=min(level.rps, cap))
        return Sample(10.0 if spec.method == "off" else 10.0 + 3 * spec.depth, 1 + 0.4 * spec.depth, 50.0, 20.0)

    return measure


@pytest.mark.parametrize("start", [0.5, 1.0, 40.0])
def test_the_bracketing_search_finds_a_planted_capacity(start: float) -> None:
    calls: list = []
    off = SpecConfig(method="off")
    cap, bounded, probes = search_capacity(planted(calls), off, SLO(ttft_p99_ms=SLO_TTFT), start, 12)
    assert bounded and cap is not None
    assert CAP["off"] / 1.1 <= cap <= CAP["off"] * 1.25  # 200 ms x 1.2 + ... breaks 1000 ms above 1.2x
    held = [p.rate for p in probes if p.ok]
    broke = [p.rate for p in probes if not p.ok]
    assert cap == max(held) and min(broke) > cap and min(broke) / cap <= 1.1 + 1e-9
    assert len(probes) == len(calls) <= 12 and all(isinstance(c[1], Rate) for c in calls)


def test_capacity_is_a_lower_bound_or_none_when_the_slo_never_or_always_breaks() -> None:
    off = SpecConfig(method="off")
    cap, bounded, probes = search_capacity(planted(), off, SLO(ttft_p99_ms=1e9), 1.0, 4)
    assert (cap, bounded, [p.rate for p in probes]) == (8.0, False, [1.0, 2.0, 4.0, 8.0])
    cap, bounded, probes = search_capacity(planted(), off, SLO(ttft_p99_ms=1.0), 1.0, 3)
    assert (cap, bounded, [p.rate for p in probes]) == (None, True, [1.0, 0.5, 0.25])
    assert not slo_holds(Sample(1.0, ttft_p99_ms=None, tpot_p99_ms=None), SLO(ttft_p99_ms=5))


def test_probes_no_larger_than_the_batch_say_they_cannot_queue() -> None:
    from tuner.study.capacity import measure_capacity

    lines: list[str] = []
    small = load_config(["model=tiny-random", "+workload=code", "search.capacity=true", "workload.rate_requests=8",
                         "engine.builtin.max_batch=8", "search.capacity_probes=2"])
    measure_capacity(small, planted(), SpecConfig(method="off"), 10.0, lines.append)
    assert any("never queue" in line and "workload.rate_requests=8" in line for line in lines)
    lines.clear()
    measure_capacity(small.model_copy(update={"workload": small.workload.model_copy(update={"rate_requests": 24})}),
                     planted(), SpecConfig(method="off"), 10.0, lines.append)
    assert not any("never queue" in line for line in lines)


def test_capacity_needs_an_slo() -> None:
    with pytest.raises(UserError, match="search.capacity=true"):
        load_config(["+workload=code", "search.capacity=true", "workload.slo.ttft_p99_ms=null",
                     "workload.slo.tpot_p99_ms=null"])


def test_optimize_records_both_capacities_plots_them_and_sizes_replicas(tmp_path: Path) -> None:
    from tuner.run.rundir import render_run
    from tuner.run.session import optimize

    calls: list = []
    run = optimize(["+workload=code", "search=quick", "search.methods=[ngram]", "search.n_trials=3",
                    "workload.concurrency=[1]", "workload.request_rate=[1,2]", "workload.num_heldout=0",
                    f"workload.slo.ttft_p99_ms={SLO_TTFT:g}", "workload.slo.tpot_p99_ms=null", "search.capacity=true",
                    "search.capacity_probes=8", f"run_dir={tmp_path / 'run'}"], quiet=True, measure=planted(calls))
    best = yaml.safe_load((run / "best.yaml").read_text())
    assert best["spec"]["method"] == "ngram"
    c = best["capacity"]
    assert CAP["off"] / 1.1 <= c["baseline_rps"] <= CAP["off"] * 1.25 and c["baseline_bounded"]
    assert CAP["ngram"] / 1.1 <= c["winner_rps"] <= CAP["ngram"] * 1.25 and c["winner_bounded"]
    assert c["slo_ttft_p99_ms"] == SLO_TTFT
    assert {p["spec"] for p in c["probes"]} == {"off", best["reason"].split(":")[0]}
    assert (run / "rates.png").stat().st_size > 1000
    html = (run / "report.html").read_text()
    assert "Request rates (open loop)" in html and "capacity at the SLOs" in html
    # every trial measured both rates beside concurrency 1
    assert {lvl for _, lvl in calls} >= {1, Rate(1.0), Rate(2.0)}

    out = tmp_path / "k8s"
    render_run(run, ["deploy=builtin", "deploy.hpa.enabled=false", "deploy.target_rate=20"], out)
    dep = (out / "deployment.yaml").read_text()
    want = -(-20 // c["winner_rps"])  # ceil
    assert yaml.safe_load(dep.split("\n", 1)[1] if dep.startswith("#") else dep)["spec"]["replicas"] == want
    assert "deploy.target_rate=20 req/s / capacity" in dep
    with pytest.raises(UserError, match="deploy.hpa.max_replicas"):
        render_run(run, ["deploy=builtin", "deploy.target_rate=1000", "deploy.hpa.max_replicas=4"], tmp_path / "k2")


def test_target_rate_without_a_capacity_is_refused(tmp_path: Path) -> None:
    from tuner.run.rundir import render_run
    from tuner.run.session import optimize

    run = optimize(["+workload=code", "search=quick", "search.methods=[ngram]", "search.n_trials=2",
                    "workload.num_heldout=0", "report.figures=false", f"run_dir={tmp_path / 'run'}"], quiet=True,
                   measure=planted())
    with pytest.raises(UserError, match="search.capacity=true"):
        render_run(run, ["deploy=builtin", "deploy.target_rate=5"], tmp_path / "k8s")
