"""benchmarks/engine_speed.py's bandwidth accounting on planted readings: each AR pass lies between
two copy readings and is judged against them (this host's copy reading jumps between two levels
within a run, so a run-wide figure judges a pass by a level it did not run at); the levels are told
apart by the widest gap between sorted readings."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


def _engine_speed():  # benchmarks/ is no package: loaded by its path
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "engine_speed.py"
    spec = importlib.util.spec_from_file_location("engine_speed_benchmark", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


ES = _engine_speed()


def test_two_copy_levels_are_split_at_their_gap_and_one_level_is_one() -> None:
    readings = [36.2, 57.1, 35.1, 58.9, 38.3, 55.6]
    bound = ES.copy_level_bound(readings)
    assert 38.3 < bound < 55.6
    assert [ES.copy_level(r, bound) for r in readings] == ["high" if r > 50 else "low" for r in readings]
    assert ES.copy_level_bound([55.6, 57.1, 58.9, 56.0]) is None  # a level's own spread is no gap
    assert ES.copy_level_bound([40.0]) is None
    assert ES.copy_level(57.1, None) == "one"


def test_levels_closer_than_a_quarter_are_split_and_a_wide_level_alone_is_not() -> None:
    """Planted on session 32's W1 run 1 (EPYC-512): 4 low readings at 32-34 GB/s and 30 high ones
    from 41.7 to 55, a gap of 1.23x between the levels (the old 1.25x rule called it one level); and
    one level spanning 1.3x in 30 readings, each a few percent above the last: no split."""
    low = [32.1, 33.0, 33.8, 34.0]
    high = [41.7 + 13.3 * i / 29 for i in range(30)]
    bound = ES.copy_level_bound(high[:15] + low + high[15:])
    assert bound is not None and 34.0 < bound < 41.7
    assert ES.copy_level_bound(high) is None
    assert ES.copy_level_bound([42.0, 44.0, 46.5, 49.0, 52.0, 55.0]) is None  # steps of 5-6%: one level


def test_levels_are_told_apart_by_their_gap_against_the_gaps_inside_them() -> None:
    """Planted on session 33's readings (EPYC-512). W6 run 1: a low level at 33-36 GB/s holding a lone
    29.1 reading (1.15x below it) and a high level 1.4x above: split at the 1.4x gap. W3: levels 1.19x
    apart with gaps of up to 1.08x inside: split. Levels 1.12x apart with dense readings on both sides
    (gaps of 1% inside) split, where the fixed 1.15x rule called them one. One level: that low level
    alone (the fixed rule split its lone reading off as a level), the same with a 1.2x outlier at each
    end, a level spanning 1.5x in steps of 6% with one of 12%, and two tight clusters 5% apart. Each
    part of the rule has a case that fails without it: two readings a side (the lone reading),
    LEVEL_CONTRAST (the 12% step; at 3 the W6 run), LEVEL_GAP (the clusters 5% apart)."""
    low = [29.1, 33.5, 34.0, 34.6, 35.2, 35.8]
    high = [50.1, 51.0, 52.4, 53.9, 54.8]
    bound = ES.copy_level_bound(high[:2] + low + high[2:])
    assert bound is not None and 35.8 < bound < 50.1
    w3_low, w3_high = [38.0, 41.0, 42.0, 43.1], [51.3, 53.0, 55.2, 57.5, 59.6]
    bound = ES.copy_level_bound(w3_low + w3_high)
    assert bound is not None and 43.1 < bound < 51.3
    dense = [40.0 * 1.01 ** i for i in range(10)]
    close = [d * 1.12 * dense[-1] / dense[0] for d in dense]
    bound = ES.copy_level_bound(dense + close)
    assert bound is not None and dense[-1] < bound < close[0]
    assert ES.copy_level_bound(low) is None
    assert ES.copy_level_bound([28.0, *low[1:], 43.0]) is None
    assert ES.copy_level_bound([40.0, 42.5, 45.0, 47.8, 53.5, 56.5, 60.0]) is None
    assert ES.copy_level_bound([50.0, 50.2, 50.4, 53.0, 53.2, 53.4]) is None


def _pass(gb_read: float, seconds: float, before: float, after: float, ttft: float = 0.0,
          prompt_gb: float = 0.0) -> dict:
    return {"tokens": 128, "seconds": seconds, "ttft": ttft, "before": before, "after": after,
            "prompt_bytes": prompt_gb * 1e9, "decode_bytes": gb_read * 1e9}


def test_each_pass_is_judged_against_the_readings_beside_it() -> None:
    """Three passes at 80% of the bandwidth of their own time, two on the low level and one on the
    high: 80% each, whatever level; a run-wide median reading (36) would call the high pass 127%."""
    passes = [_pass(28.8, 1.0, 36.0, 36.0), _pass(46.0, 1.0, 57.0, 58.0), _pass(28.0, 1.0, 34.0, 36.0)]
    got = ES.pass_shares(passes, ES.copy_level_bound([36.0, 36.0, 57.0, 58.0, 34.0, 36.0]))
    assert got["share"] == pytest.approx(0.8, abs=1e-3)
    assert [p["share"] for p in got["passes"]] == pytest.approx([0.8, 0.8, 0.8], abs=1e-3)
    assert got["levels"] == {"low": {"passes": 2, "share": 0.8, "decode_share": 0.8},
                             "high": {"passes": 1, "share": 0.8, "decode_share": 0.8}}


def test_a_pass_during_which_the_level_changed_has_no_level() -> None:
    passes = [_pass(30.0, 1.0, 36.0, 36.0), _pass(30.0, 1.0, 36.0, 58.0), _pass(45.0, 1.0, 58.0, 58.0)]
    got = ES.pass_shares(passes, 47.0)
    assert got["levels"]["switched"] == {"passes": 1, "share": round(30 / 47, 3), "decode_share": round(30 / 47, 3)}
    assert got["levels"]["low"]["passes"] == got["levels"]["high"]["passes"] == 1


def test_the_decoding_share_leaves_out_the_prompts_forward_its_bytes_and_its_seconds() -> None:
    """20 GB decoded in 0.8 s and the prompt's 2 GB in 0.2 s at 40 GB/s: decoding 62.5%, the whole
    pass 55%. Counting the prompt's bytes in the decoding share (a bug) reads 68.75%, leaving them
    out of the whole pass 50%."""
    got = ES.pass_shares([_pass(20.0, 1.0, 40.0, 40.0, ttft=0.2, prompt_gb=2.0)], None)
    assert got["share"] == 0.55 and got["decode_share"] == 0.625
    assert got["levels"] == {"one": {"passes": 1, "share": 0.55, "decode_share": 0.625}}


def test_every_ar_pass_lies_between_two_readings_and_back_to_back_passes_share_one() -> None:
    """A planted run order: an HF row, two AR rows back to back, an n-gram row, on two prompts; each
    copy reading returns the next number. The AR passes get the readings right before and after
    them, the second AR pass starts from the first one's closing reading, the n-gram row takes none,
    and a closing reading ends the run."""
    clock = iter(range(1, 100))
    readings: list[float] = []
    order: list[str] = []

    def run(name):
        def fn(prompt, n):
            order.append(name)
            return [7] * n, 2.0, n, 0.5
        return fn

    names = ["hf", "ar fp32", "ar fp8", "ngram"]
    runs = {n: run(n) for n in names}
    acc = {n: {"tokens": 0, "seconds": 0.0, "forwards": 0, "outputs": [], "ttft": 0.0, "kv_positions": 0.0}
           for n in names}
    passes = ES.play([[1, 2, 3], [4, 5]], runs, 4, acc, {"ar fp32", "ar fp8"}, lambda: float(next(clock)),
                     readings, lambda name: 100 if name == "ar fp32" else 25, lambda name: 1)
    assert order == names * 2
    assert [(p["before"], p["after"]) for p in passes["ar fp32"]] == [(1, 2), (4, 5)]
    assert [(p["before"], p["after"]) for p in passes["ar fp8"]] == [(2, 3), (5, 6)]
    assert readings == [1, 2, 3, 4, 5, 6, 7]
    # the prompt's forward: the weights once and its prompt's KV positions written; each of the 3
    # decoding forwards: the weights and the KV positions attended (prompt + half the new tokens; for
    # AR exactly the mean of 3 + 1, 3 + 2, 3 + 3 on the first prompt)
    assert [p["prompt_bytes"] for p in passes["ar fp8"]] == [25 + 3, 25 + 2]
    assert [p["decode_bytes"] for p in passes["ar fp8"]] == [3 * (25 + (3 + 2)), 3 * (25 + (2 + 2))]
    assert acc["ar fp8"]["kv_positions"] == 3 + 3 * 5 + 2 + 3 * 4
    assert acc["ngram"]["tokens"] == 8 and acc["ar fp32"]["ttft"] == 1.0


def test_a_run_ending_on_an_ar_pass_ends_on_its_closing_reading() -> None:
    clock = iter(range(1, 100))
    readings: list[float] = []
    runs = {n: (lambda p, n: ([1] * n, 1.0, n, 0.1)) for n in ("ngram", "ar")}
    acc = {n: {"tokens": 0, "seconds": 0.0, "forwards": 0, "outputs": [], "ttft": 0.0, "kv_positions": 0.0}
           for n in runs}
    passes = ES.play([[1], [2]], runs, 2, acc, {"ar"}, lambda: float(next(clock)), readings, lambda n: 1, lambda n: 1)
    assert [(p["before"], p["after"]) for p in passes["ar"]] == [(1, 2), (3, 4)] and readings == [1, 2, 3, 4]
