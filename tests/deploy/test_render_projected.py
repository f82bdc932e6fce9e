"""`tuner render --from RUN --projected hardware=NAME` (tuner.projection.projector.projected_best): the manifests serve
the configuration that the run's acceptance profile predicts best on that hardware for the workload's
concurrency (a K schedule for vLLM), exactly what `tuner project` reports, and the provenance
ConfigMap says it was projected, for which hardware, from which run and profile, with the predicted
figures; without the flag the measured winner is rendered; a run without profile.json is one line."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from statistics import geometric_mean

import pytest
import yaml

from tuner.cli import main
from tuner.schema.compose import load_config, save_config
from tuner.projection.costmodel import Prediction
from tuner.projection.projector import choose_projected
from tuner.schema.config import BestResult, Figures, Provenance, SpecConfig

H = "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"
LEVELS = [1, 8, 64, 256]
# The measured winner of the run (tuned on one H200 with SGLang): a tree, and the study's best chain.
MEASURED = SpecConfig(method="eagle3", depth=5, topk=4, budget=8, head_path=H)
MEASURED_CHAIN = SpecConfig(method="eagle3", depth=4, topk=1, budget=5, head_path=H,
                            k_per_batch_size=[(1, 8, 4), (9, 64, 2), (65, 256, 0)])


def _points() -> list[tuple[SpecConfig, float]]:
    """Greedy taus as an EAGLE-3 head of an 8B model gets them: deeper chains and wider trees accept more."""
    pts = [(SpecConfig(method="off"), 1.0)]
    for d, tau in [(1, 1.7), (2, 2.2), (3, 2.6), (4, 2.85), (5, 3.0), (6, 3.1)]:
        pts.append((SpecConfig(method="eagle3", depth=d, topk=1, budget=d + 1, head_path=H), tau))
    for d, b, tau in [(4, 8, 3.3), (5, 16, 3.8), (6, 32, 4.2)]:
        pts.append((SpecConfig(method="eagle3", depth=d, topk=8, budget=b, head_path=H), tau))
    for d, tau in [(2, 1.3), (4, 1.4)]:
        pts.append((SpecConfig(method="ngram", depth=d, topk=1, budget=d + 1), tau))
    return pts


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run of llama-3.1-8b-instruct tuned on h200x1 (config.yaml, best.yaml) and its acceptance
    profile (profile.json as `tuner profile --from RUN` writes it; taus given, no 8B model here)."""
    from engine.measure.profile_file import Profile

    d = tmp_path_factory.mktemp("run")
    cfg = load_config(["model=llama-3.1-8b-instruct", "hardware=h200x1", "deploy=sglang", "+workload=chat",
                       f"workload.concurrency=[{','.join(map(str, LEVELS))}]"])
    save_config(cfg, d / "config.yaml")
    best = BestResult(spec=MEASURED, chain_spec=MEASURED_CHAIN, speedup=2.4, reason="fastest feasible trial",
                      metrics=Figures(output_tokens_per_s=400.0, tau=3.4),
                      provenance=Provenance(study="tuned-on-h200", trial=12, date="2026-11-20T14:03:00+00:00",
                                            model=cfg.model.name, hardware="h200x1", engine="sglang", workload="chat"))
    (d / "best.yaml").write_text(yaml.safe_dump(best.model_dump(mode="json"), sort_keys=False))
    points = [{"spec": s.model_dump(mode="json"), "key": s.key(), "tau": tau, "estimate": False,
               "verified_per_step": 1 if s.method == "off" else s.budget, "draft_s_per_step": 0.0}
              for s, tau in _points()]
    Profile(model=cfg.model.name, hf_id=cfg.model.hf_id, fp8=False, workload="chat", temperature=0.0,
            max_new_tokens=256, prompts=["p0", "p1"], sequences=[{"prompt_len": 200, "end": 256, "n_new": 256,
                                                                  "tokens": []}] * 2, points=points).save(d)
    return d


def _docs(d: Path) -> dict[str, dict]:
    return {p.name: yaml.safe_load(p.read_text()) for p in sorted(d.glob("*.yaml"))}


def _args(d: Path) -> list[str]:
    return _docs(d)["deployment.yaml"]["spec"]["template"]["spec"]["containers"][0]["args"]


def _opt(args: list[str], flag: str) -> str:
    assert args.count(flag) == 1, (flag, args)
    return args[args.index(flag) + 1]


def _projection(run: Path, out: Path, target: str, levels: list[int]) -> tuple[dict, dict[tuple[int, str], dict]]:
    """`tuner project` of the same run, hardware and deploy target: its summary and its table."""
    assert main(["project", "hardware=h100x8", "model=llama-3.1-8b-instruct", f"deploy={target}", "--from", str(run),
                 "--concurrency", ",".join(map(str, levels)), "--out", str(out)]) == 0
    rows = {(int(r["concurrency"]), r["config"]): r for r in csv.DictReader(open(out / "projection.csv"))}
    return yaml.safe_load((out / "projection.yaml").read_text()), rows


def test_vllm_serves_the_projected_k_schedule_and_the_configmap_says_so(run: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "k8s"
    assert main(["render", "--from", str(run), "--projected", "hardware=h100x8", "deploy=vllm", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "projected for h100x8" in text and "measured winner: 'eagle3 d5 k4 b8'" in text and ", valid)" in text
    # Issue 37: one figure per level, not one number for four levels
    import re

    levels = re.findall(r"(\d+): ([0-9.]+)x, TPOT ([0-9.]+) ms", text)
    assert [int(c) for c, _, _ in levels] == LEVELS, text
    assert len({tpot for _, _, tpot in levels}) == len(LEVELS), text  # TPOT grows with the batch
    summary, rows = _projection(run, tmp_path / "proj", "vllm", LEVELS)
    capsys.readouterr()
    # The Deployment's vLLM flags are the projection's K schedule, exactly.
    conf = json.loads(_opt(_args(out), "--speculative-config"))
    bands = summary["k_per_batch_size"]
    assert len(bands) > 1, "the fixture must give several K bands on h100x8"
    chain = summary["vllm_chain"]  # e.g. 'eagle3 d3 k1 b4'
    assert conf == {"method": "eagle3", "model": H, "num_speculative_tokens": int(chain.split()[1][1:]),
                    "num_speculative_tokens_per_batch_size": bands}
    assert bands[-1][1] == LEVELS[-1] and bands != [list(b) for b in MEASURED_CHAIN.k_per_batch_size]
    assert conf["num_speculative_tokens"] != MEASURED_CHAIN.depth  # not the measured chain
    # The ConfigMap: projected, for which hardware, from which run and profile, the predicted figures.
    cm = _docs(out)["configmap.yaml"]["data"]
    assert cm["source"] == "projection" and cm["projected"] == "true" and cm["projected_hardware"] == "h100x8"
    # named from the run directory, never by the tuning machine's path (issue 25.9)
    assert cm["projected_from_run"] == run.name and cm["profile"] == f"{run.name}/profile.json"
    assert cm["acceptance"].startswith(f"profile {run.name}/profile.json") and "exact greedy tau" in cm["acceptance"]
    assert not [ln for v in cm.values() for ln in v.splitlines() if str(run.parent) in ln]
    assert cm["cost_model"] == "roofline" and cm["predicted_at_concurrency"] == "1,8,64,256"
    assert cm["measured_spec"] == "eagle3 d5 k4 b8" and cm["tuned_hardware"] == "h200x1"
    assert "best.yaml" not in cm and cm["speedup"] == "" and cm["tau"] == ""  # nothing measured is claimed
    # Per level: the band's chain (K=0: off), with the figures `tuner project` predicts for it.
    band_key = {c: next((f"eagle3 d{k} k1 b{k + 1}" if k else "off") for lo, hi, k in bands if lo <= c <= hi)
                for c in LEVELS}
    rec = yaml.safe_load(cm["projected.yaml"])["projection"]
    assert [p["spec"] for p in rec["per_concurrency"]] == [band_key[c] for c in LEVELS]
    for p in rec["per_concurrency"]:
        row = rows[(p["concurrency"], p["spec"])]
        assert p["speedup"] == pytest.approx(float(row["speedup"]), abs=1e-3)
        assert p["tpot_ms"] == pytest.approx(float(row["tpot_ms"]), abs=1e-3)
    speedups = [float(rows[(c, band_key[c])]["speedup"]) for c in LEVELS]
    assert rec["predicted_speedup"] == pytest.approx(geometric_mean(speedups), rel=1e-3)
    assert float(cm["predicted_speedup"]) == pytest.approx(geometric_mean(speedups), rel=5e-3)
    assert rec["predicted_tpot_ms"] == pytest.approx(geometric_mean([float(rows[(c, band_key[c])]["tpot_ms"])
                                                               for c in LEVELS]), rel=1e-3)
    served = yaml.safe_load(cm["served.yaml"])
    assert any("projected for h100x8" in n and "not measured there" in n for n in served["notes"])
    # Deterministic: the same run renders the same bytes.
    again = tmp_path / "again"
    assert main(["render", "--from", str(run), "--projected", "hardware=h100x8", "deploy=vllm", "--out", str(again)]) == 0
    assert all((again / p.name).read_bytes() == p.read_bytes() for p in out.iterdir())


def test_sglang_at_the_workloads_one_level_serves_the_projections_best(run: Path, tmp_path: Path, capsys) -> None:
    """`+workload=chat` (concurrency [1]) on top of the run: the choice is the projection's best at 1."""
    out = tmp_path / "k8s"
    assert main(["render", "--from", str(run), "--projected", "hardware=h100x8", "deploy=sglang", "+workload=chat",
                 "--out", str(out)]) == 0
    summary, _ = _projection(run, tmp_path / "proj", "sglang", [1])
    best = summary["best"][0]["spec"]  # e.g. 'eagle3 d5 k8 b16'
    assert best != MEASURED.key() and best.startswith("eagle3")
    _, d, k, b = best.split()
    args = _args(out)
    assert (_opt(args, "--speculative-num-steps"), _opt(args, "--speculative-eagle-topk"),
            _opt(args, "--speculative-num-draft-tokens")) == (d[1:], k[1:], b[1:])
    assert _opt(args, "--speculative-draft-model-path") == H
    cm = _docs(out)["configmap.yaml"]["data"]
    assert cm["spec"] == best and cm["predicted_at_concurrency"] == "1"
    assert float(cm["predicted_speedup"]) == pytest.approx(summary["best"][0]["speedup"], rel=5e-3)
    assert float(cm["predicted_tpot_ms"]) == pytest.approx(summary["best"][0]["tpot_ms"], rel=5e-3)


def test_without_the_flag_another_hardware_still_renders_the_measured_winner(run: Path, tmp_path: Path) -> None:
    from tuner.run.rundir import render_run

    plan, _ = render_run(run, ["hardware=h100x8", "deploy=vllm"], tmp_path / "k8s")
    assert plan.served.spec == MEASURED_CHAIN and plan.best.projection is None
    assert any("tuned for model llama-3.1-8b-instruct on h200x1" in n and "--projected" in n for n in plan.served.notes)
    cm = _docs(tmp_path / "k8s")["configmap.yaml"]["data"]
    assert cm["source"] == "best.yaml" and "projected" not in cm and cm["speedup"] == "2.4"


def test_a_run_without_profile_is_one_line_naming_the_fix(run: Path, tmp_path: Path, capsys) -> None:
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.yaml", "best.yaml"):
        (bare / name).write_text((run / name).read_text())
    rc = main(["render", "--from", str(bare), "--projected", "hardware=h100x8", "deploy=vllm"])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert f"`tuner profile --from {bare}`" in err and "profile.json" in err
    assert not (bare / "k8s").exists()
    assert main(["render", "--projected", "hardware=h100x8"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--projected needs --from RUN" in err
    # a profile measures one model: projecting it for another is refused, in one line
    assert main(["render", "--from", str(run), "--projected", "model=llama-3.3-70b-instruct", "hardware=h100x8",
                 "deploy=vllm", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "measured llama-3.1-8b-instruct" in err


def _pred(spec: SpecConfig, c: int, speedup: float, base: float = 100.0) -> Prediction:
    return Prediction(spec=spec, concurrency=c, tau=2.0, step_s=1.0, verify_s=1.0, draft_s=0.0, tpot_ms=10 / speedup,
                      tok_s=base * c * speedup, speedup=speedup)


def test_choose_projected_over_several_levels() -> None:
    off = SpecConfig(method="off")
    tree = SpecConfig(method="eagle", depth=5, topk=4, budget=16)
    small = SpecConfig(method="eagle", depth=5, topk=4, budget=8)
    d2 = SpecConfig(method="eagle", depth=2, topk=1, budget=3)
    d4 = SpecConfig(method="eagle", depth=4, topk=1, budget=5)
    ng = SpecConfig(method="ngram", depth=3, topk=1, budget=4)
    preds = [_pred(off, 1, 1.0), _pred(tree, 1, 2.6), _pred(small, 1, 2.2), _pred(d2, 1, 1.8), _pred(d4, 1, 2.0),
             _pred(ng, 1, 2.7),
             _pred(off, 64, 1.0), _pred(tree, 64, 0.7), _pred(small, 64, 1.1), _pred(d2, 64, 1.5), _pred(d4, 64, 1.1),
             _pred(ng, 64, 0.8)]
    # One spec for both levels: the highest geometric mean of speedup, not the best at either level
    # (d2: 1.64; small 1.56, d4 1.48, ngram 1.47, tree 1.35).
    spec, rows = choose_projected(preds, "builtin")
    assert spec == d2 and [r.speedup for r in rows] == [1.8, 1.5]
    # SGLang serves eagle / eagle3 only: n-gram is not a candidate even where it is fastest.
    one = [p for p in preds if p.concurrency == 1]
    assert choose_projected(one, "builtin")[0] == ng and choose_projected(one, "sglang")[0] == tree
    # Ties within 1%: the smaller budget.
    tie = [_pred(off, 1, 1.0), _pred(tree, 1, 2.0), _pred(small, 1, 1.985)]
    assert choose_projected(tie, "sglang")[0] == small
    # A configuration predicted to serve nothing at one level (speedup 0) averages to 0 there.
    dead = Prediction(spec=tree, concurrency=64, tau=2.0, step_s=1.0, verify_s=1.0, draft_s=0.0, tpot_ms=1e9,
                      tok_s=0.0, speedup=0.0)
    assert choose_projected([p for p in preds if p.spec != tree or p.concurrency == 1] + [dead], "builtin")[0] == d2
    # vLLM: chains only, one K per band, each level predicted with its band's chain.
    spec, rows = choose_projected([p for p in preds if p.spec.method != "ngram"], "vllm")
    assert spec.topk == 1 and spec.depth == 4 and spec.k_per_batch_size == [(1, 1, 4), (2, 64, 2)]
    assert [r.spec for r in rows] == [d4, d2]
    # Nothing beats off on chains: off.
    slow = [_pred(off, 1, 1.0), _pred(d2, 1, 0.9), _pred(tree, 1, 1.5)]
    spec, rows = choose_projected(slow, "vllm")
    assert spec.method == "off" and rows[0].spec.method == "off"


def test_projecting_and_rendering_need_no_torch(run: Path, tmp_path: Path) -> None:
    """The stored profile is read without PyTorch: rendering a projection works where only the
    deployment side of spectune is installed (a CI job that renders manifests)."""
    import subprocess
    import sys

    code = ("import sys; from tuner.cli import main; "
            f"rc = main(['render', '--from', {str(run)!r}, '--projected', 'hardware=h100x8', '--out', {str(tmp_path / 'k8s')!r}]); "
            "assert rc == 0, rc; assert 'torch' not in sys.modules, 'torch was imported'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).parents[2])
    assert out.returncode == 0, out.stderr[-2000:]
