"""`tuner check`: a live built-in server (what `tuner serve` runs, here in a thread of this process;
the command itself is tested in tests/engine/test_server.py) measured on a run's held-out prompts
against its best.yaml; the same spec passes, a different one fails with one line per regressed figure."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from tests.helpers import engine_for, serving
from tuner.cli import main
from tuner.run.regression import Comparison, compare, measure_endpoint
from tuner.schema.compose import load_config, save_config
from tuner.schema.config import BestResult, Figures, Provenance, SpecConfig

# A small held-out pass: 2 prompts of 12 tokens at concurrency 1 and 2.
RUN = ["model=tiny-random", "+workload=code", "workload.num_prompts=4", "workload.num_heldout=2",
       "workload.max_new_tokens=12"]


@pytest.fixture(scope="module")
def draft_dir() -> Path:
    """The tiny target's own checkpoint as a draft model: under greedy decoding it drafts exactly
    what the target says, so its tau is far above 1 (speculation off has tau 1)."""
    from engine.models.target import hf_checkpoint_dir

    cfg = load_config(["model=tiny-random"])
    return hf_checkpoint_dir(cfg.model, cfg.cache_dir)


@contextmanager
def serve(spec: list[str]) -> Iterator[str]:
    """The built-in server of tiny-random under `spec` on 127.0.0.1, for the block; its URL."""
    cfg = load_config(["model=tiny-random", *spec])
    with serving(cfg, engine_for(cfg)) as url:
        yield url


def test_check_passes_on_the_tuned_spec_and_fails_on_another(draft_dir: Path, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture) -> None:
    tuned = ["spec.method=draft_model", f"spec.draft_model={draft_dir}", "spec.depth=3"]
    cfg = load_config(RUN + tuned)
    run = tmp_path / "run"
    save_config(cfg, run / "config.yaml")
    with serve(tuned) as url:
        # the run's held-out figures, measured as the study measures them (one load generator)
        heldout = measure_endpoint(url, "tiny-random", cfg, repeats=1)
        assert heldout.tau is not None and heldout.tau > 2.0
        # A 3 ms step's TPOT p99 doubles under a neighbour's load in every pass (CI: 3.0 -> 6.5 ms three times):
        # the tuned figures here are tau and tok/s; the latency comparison has its planted-figure test below.
        heldout = heldout.model_copy(update={"tpot_p99_ms": None})
        best = BestResult(spec=cfg.spec, heldout=heldout,
                          provenance=Provenance(study="s", date="2026-12-01T00:00:00+00:00", model="tiny-random",
                                                hardware="cpu", engine="builtin", workload="code"))
        (run / "best.yaml").write_text(yaml.safe_dump(best.model_dump(mode="json")))
        # Timing figures of a 3 ms step move a lot between passes on a shared machine (one scheduler
        # hiccup doubles a p99 of one pass; CI saw 3.3 -> 7.5 ms): a wide tolerance, and up to 3 passes
        # for them. tau, which is what this test is about, holds within the default 5% in every pass.
        for _ in range(3):
            rc = main(["check", "--url", url, "--against", str(run), "--repeats", "1", "--tolerance", "0.9"])
            out = capsys.readouterr().out.splitlines()
            assert not any(ln.startswith("tau: ") and "below the tuned" in ln for ln in out), out
            if rc == 0:
                break
        assert rc == 0, out
        assert out[0].startswith("tau: ") and "within noise of the tuned" in out[0]
        assert out[-1].startswith(f"{url} performs as tuned in {run} (spec 'draft_model d3 k1 b4'")
        # a launched server's study has no held-out tau (its check counts forwards over both sides' pass): said
        no_tau = best.model_copy(update={"heldout": heldout.model_copy(update={"tau": None})})
        (run / "best.yaml").write_text(yaml.safe_dump(no_tau.model_dump(mode="json")))
        main(["check", "--url", url, "--against", str(run), "--repeats", "1", "--tolerance", "0.9"])
        out = capsys.readouterr().out.splitlines()
        assert out[0] == f"tau: not compared: {run}/best.yaml has no held-out tau", out
        assert not any(ln.startswith("tau: ") and " the tuned " in ln for ln in out), out
        (run / "best.yaml").write_text(yaml.safe_dump(best.model_dump(mode="json")))
    with serve(["spec.method=off"]) as url:
        assert main(["check", "--url", url, "--against", str(run), "--repeats", "1", "--tolerance", "0.9"]) == 1
        out = capsys.readouterr().out.splitlines()
        # one line per regressed figure, tau first (the timing figures may or may not regress with it)
        assert out[0].startswith("tau: 1 below the tuned "), out
        assert all(" below the tuned " in ln or " above the tuned " in ln for ln in out), out


def test_compare_says_one_line_per_regressed_figure() -> None:
    tuned = Figures(output_tokens_per_s=100.0, ci_low=80.0, ci_high=120.0, tau=3.0, tpot_p99_ms=20.0)
    ok = compare(tuned, Figures(output_tokens_per_s=85.0, tau=2.9, tpot_p99_ms=23.0), 0.1, 0.05)
    assert not any(c.regressed for c in ok)  # 85 within the interval's 20% noise, 2.9 within 5%
    bad = {c.name: c for c in compare(tuned, Figures(output_tokens_per_s=70.0, tau=2.0, tpot_p99_ms=30.0), 0.1, 0.05)}
    assert all(c.regressed for c in bad.values())
    assert bad["tok/s"].line() == "tok/s: 70 below the tuned 100 (at least 80 allowed)"
    assert bad["TPOT p99 ms"].line() == "TPOT p99 ms: 30 above the tuned 20 (at most 24 allowed)"
    assert not Comparison("tau", 3.0, None, 2.85, True).regressed  # no counters: said, not failed


def test_a_run_without_held_out_figures_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cfg = load_config(RUN)
    save_config(cfg, tmp_path / "config.yaml")
    best = BestResult(spec=SpecConfig(method="off"), metrics=Figures(output_tokens_per_s=10.0),
                      provenance=Provenance(study="s", date="d", model="m", hardware="cpu", engine="builtin",
                                            workload="code"))
    (tmp_path / "best.yaml").write_text(yaml.safe_dump(best.model_dump(mode="json")))
    assert main(["check", "--url", "http://127.0.0.1:9", "--against", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "best.yaml has no held-out figures" in err[0]
