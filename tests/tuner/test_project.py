"""`tuner profile` and `tuner project` (tuner.cli.project, tuner.projection.projector): a profile of the tiny model
projected onto GPU profiles, the K schedule per concurrency band, and one-line errors (exit 2)
for an unknown hardware, a missing tau for another model and a profile of another model."""

from __future__ import annotations

import csv
import json

import pytest
import yaml

from tuner.cli import main
from tuner.schema.compose import load_config
from tuner.projection.costmodel import Prediction, roofline_for
from tuner.projection.projector import Acceptance, best_per_concurrency, k_schedule, project
from tuner.schema.config import SpecConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """`tuner profile` of the tiny model: 2 prompts x 16 tokens, n-gram chains of depth 1-3."""
    out = tmp_path_factory.mktemp("run")
    rc = main(["profile", "+workload=code", "model=tiny-random", "search.methods=[ngram]", "search.topk=[1]", "search.trial_prompts=2", "workload.max_new_tokens=16",
               "search.depth.max=3", "--out", str(out), "--quiet"])
    assert rc == 0
    return out


def test_profile_command_writes_every_point(run_dir, capsys) -> None:
    prof = json.loads((run_dir / "profile.json").read_text())
    assert prof["model"] == "tiny-random" and prof["workload"] == "code" and prof["temperature"] == 0
    assert [p["key"] for p in prof["points"]] == ["off", "ngram d1 k1 b2", "ngram d2 k1 b3", "ngram d3 k1 b4"]
    assert all(p["tau"] >= 1.0 and not p["estimate"] for p in prof["points"])
    assert len(prof["sequences"]) == 2 and (run_dir / "config.yaml").is_file()


def test_project_from_run_writes_csv_png_yaml(run_dir, capsys) -> None:
    out = run_dir / "proj"
    # no model=: the run's own model (tiny-random) is projected, not the default SmolLM2
    rc = main(["project", "hardware=h100x8", "--from", str(run_dir), "--concurrency", "1,16", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0 and text.strip().splitlines()[-1] == str(out) and text.startswith("projection of tiny-random")
    rows = list(csv.DictReader(open(out / "projection.csv")))
    assert len(rows) == 2 * 4 and {r["concurrency"] for r in rows} == {"1", "16"}
    assert (out / "projection.png").stat().st_size > 1000
    summary = yaml.safe_load((out / "projection.yaml").read_text())
    assert summary["projected"] and summary["hardware"] == "h100x8" and "profile" in summary["acceptance"]
    assert [b["concurrency"] for b in summary["best"]] == [1, 16]


def test_project_with_tau_for_another_model(tmp_path, capsys) -> None:
    out = tmp_path / "p"
    rc = main(["project", "hardware=h100x8", "model=llama-3.1-8b-instruct", "deploy=vllm", "spec.method=eagle3", "spec.depth=4",
               "spec.topk=1", "spec.budget=5", "--tau", "3.2", "--concurrency", "1,4", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0 and "--tau 3.2 for eagle3 d4 k1 b5" in text
    summary = yaml.safe_load((out / "projection.yaml").read_text())
    assert summary["best"][0]["spec"] == "eagle3 d4 k1 b5" and summary["best"][0]["speedup"] > 1.5
    assert summary["tensor_parallel_size"] == 1 and summary["quantization"] == "fp8"


def test_acceptance_file(tmp_path, capsys) -> None:
    f = tmp_path / "acc.yaml"
    f.write_text(yaml.safe_dump([{"method": "eagle", "depth": 5, "topk": 4, "budget": 8, "tau": 3.84},
                                 {"method": "draft_model", "depth": 4, "topk": 1, "budget": 5,
                                  "draft_model": "meta-llama/Llama-3.2-1B-Instruct", "tau": 2.85}]))
    rc = main(["project", "hardware=a100-80gbx4", "model=llama-3.3-70b-instruct", "deploy.quantization=none",
               "--acceptance-file", str(f), "--concurrency", "1", "--out", str(tmp_path / "o")])
    assert rc == 0
    rows = {r["config"]: r for r in csv.DictReader(open(tmp_path / "o" / "projection.csv"))}
    assert float(rows["eagle d5 k4 b8"]["speedup"]) > float(rows["draft_model d4 k1 b5"]["speedup"]) > 1.5


@pytest.mark.parametrize("args,needle", [
    (["hardware=h100x9"], "hardware=h100x9: unknown option"),
    (["hardware=h100x8", "model=llama-3.1-8b-instruct", "--from", "{run}"], "measured tiny-random"),
    (["hardware=h100x8", "model=llama-3.1-8b-instruct", "--profile", "{run}/profile.json"], "measured tiny-random"),
    (["hardware=h100x8", "model=llama-3.1-8b-instruct"], "no acceptance given"),
    (["hardware=h100x8", "model=llama-3.1-8b-instruct", "spec.method=ngram", "--tau", "0.5"], "--tau 0.5"),
    (["hardware=h100x8", "--profile", "{run}/config.yaml"], "no readable acceptance profile"),
    (["hardware=h100x8", "--profile", "{run}/proj/projection.yaml"], "no readable acceptance profile"),
    (["hardware=h100x8", "model=tiny-random", "--from", "{run}", "--concurrency", "0,x"], "--concurrency"),
])
def test_bad_input_one_line_exit_2(run_dir, capsys, args, needle) -> None:
    rc = main(["project", *[a.replace("{run}", str(run_dir)) for a in args]])
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def _pred(spec: SpecConfig, c: int, tok_s: float) -> Prediction:
    return Prediction(spec=spec, concurrency=c, tau=2.0, step_s=1.0, verify_s=1.0, draft_s=0.0, tpot_ms=1.0,
                      tok_s=tok_s, speedup=1.0)


def test_k_schedule_bands_follow_the_best_chain() -> None:
    off = SpecConfig(method="off")
    d4 = SpecConfig(method="eagle", depth=4, topk=1, budget=5)
    d2 = SpecConfig(method="eagle", depth=2, topk=1, budget=3)
    tree = SpecConfig(method="eagle", depth=4, topk=4, budget=8)
    preds = [_pred(off, 1, 10), _pred(d4, 1, 30), _pred(d2, 1, 25), _pred(tree, 1, 40),
             _pred(off, 8, 80), _pred(d4, 8, 150), _pred(d2, 8, 200), _pred(tree, 8, 210),
             _pred(off, 64, 500), _pred(d4, 64, 300), _pred(d2, 64, 450), _pred(tree, 64, 200)]
    best = best_per_concurrency(preds)
    assert [best[c].spec.key() for c in (1, 8, 64)] == ["eagle d4 k4 b8", "eagle d4 k4 b8", "off"]
    chain, bands = k_schedule(preds)
    assert bands == [(1, 1, 4), (2, 8, 2), (9, 64, 0)]
    assert chain.depth == 4 and chain.topk == 1


def test_projection_turns_to_off_at_high_concurrency_when_compute_bound() -> None:
    """70B in 16 bit on A100s: a 16-token tree pays at batch 1 and not at batch 256."""
    cfg = load_config(["hardware=a100-80gbx4", "model=llama-3.3-70b-instruct", "deploy.quantization=none"])
    cost = roofline_for(cfg.model, cfg.hardware, 4, "none", "auto")
    acc = Acceptance(points=[(SpecConfig(method="eagle", depth=5, topk=4, budget=16), 3.5)], source="test")
    best = best_per_concurrency(project(cost, acc, [1, 256], 1024))
    assert best[1].spec.method == "eagle" and best[256].spec.method == "off"


def test_here_uses_the_measured_cost_and_the_profiles_draft_times(run_dir, tmp_path, monkeypatch, capsys) -> None:
    """hardware=cpu: this machine's measured forward costs (faked here: no timing in tests) and the
    draft time per step the profile measured; one concurrency; a profile of other engine settings
    is refused."""
    import engine.measure.microbench as mb
    import tuner.projection.costmodel as cm

    table = {"1,128": 0.010, "8,128": 0.017, "1,512": 0.012, "8,512": 0.021}
    monkeypatch.setattr(mb, "measure_forward", lambda target, builtin=None, cache_dir=None: table)
    monkeypatch.setattr(cm, "cache_path", lambda root, key: tmp_path / f"{key}.json")
    out = tmp_path / "here"
    rc = main(["project", "hardware=cpu", "model=tiny-random", "--from", str(run_dir), "--out", str(out)])
    assert rc == 0
    prof = json.loads((run_dir / "profile.json").read_text())
    rows = {r["config"]: r for r in csv.DictReader(open(out / "projection.csv"))}
    assert {r["concurrency"] for r in rows.values()} == {"1"}
    m = cm.Measured(forward=table)
    ctx = int(sum(s["prompt_len"] + s["n_new"] / 2 for s in prof["sequences"]) / len(prof["sequences"]))
    for p in prof["points"][1:]:
        verify = sum(w * m.verify_s(int(n), 1, ctx) for n, w in p["verified_shares"].items())
        want = p["tau"] / (verify + p["draft_s_per_step"])
        assert float(rows[p["key"]]["tok_s"]) == pytest.approx(want, rel=1e-3)
    assert yaml.safe_load((out / "projection.yaml").read_text())["cost_model"] == "measured here"
    capsys.readouterr()
    import torch

    n = torch.get_num_threads()
    try:
        rc = main(["project", "hardware=cpu", "model=tiny-random", "engine.builtin.threads=3", "--from", str(run_dir),
                   "--out", str(tmp_path / "x")])
    finally:
        torch.set_num_threads(n)
    assert rc == 2 and "profile again with the same engine.builtin settings" in capsys.readouterr().err


def test_a_step_cost_is_averaged_over_the_tokens_steps_verify() -> None:
    """A one-row step is the compiled decode step, so the cost curve jumps from 1 to 2 tokens: half
    the steps verifying 1 token and half 9 cost the mean of the two, not the cost of 5 tokens."""
    import tuner.projection.costmodel as cm

    m = cm.Measured(forward={"1,128": 0.010, "2,128": 0.020, "8,128": 0.026, "16,128": 0.034},
                    draft={"ngram d8 k1 b9": 0.0})
    spec = SpecConfig(method="ngram", depth=8, topk=1, budget=9)
    shares = cm.predict(m, spec, 2.0, 1, 128, {"1": 0.5, "9": 0.5})
    assert shares.verify_s == pytest.approx((0.010 + 0.027) / 2)
    mean = cm.predict(m, spec, 2.0, 1, 128, 5.0)
    assert mean.verify_s == pytest.approx(0.020 + 0.006 * 3 / 6)
    assert cm.predict(m, spec, 2.0, 1, 128).verify_s == pytest.approx(0.027)  # no profile: the budget


# Issue 25: every input is honoured or refused in one line (no run needed: refused before anything loads).
@pytest.mark.parametrize("args,needle", [
    (["--tau", "3", "--acceptance-file", "{tmp}/acc.yaml"], "--tau and --acceptance-file: two sources of acceptance"),
    (["--tau", "3", "--profile", "{tmp}/profile.json"], "--tau and --profile: two sources of acceptance"),
    (["--acceptance-file", "{tmp}/acc.yaml", "--profile", "{tmp}/profile.json"],
     "--acceptance-file and --profile: two sources"),
    (["--tau", "3", "--context", "-5"], "--context -5: KV context tokens per sequence, must be >= 1"),
    (["--tau", "3", "--context", "0"], "--context 0: KV context tokens per sequence, must be >= 1"),
])
def test_conflicting_or_out_of_range_input_is_refused(tmp_path, capsys, args, needle) -> None:
    (tmp_path / "acc.yaml").write_text(yaml.safe_dump([{"method": "ngram", "depth": 3, "topk": 1, "budget": 4,
                                                        "tau": 2.5}]))
    rc = main(["project", "hardware=h100x8", "spec.method=ngram", *[a.replace("{tmp}", str(tmp_path)) for a in args],
               "--out", str(tmp_path / "o")])
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and needle in lines[0], captured.err
    assert captured.out == "" and not (tmp_path / "o").exists()
