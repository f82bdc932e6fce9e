"""`tuner bench`: measure the configured engine and spec on a workload, thin over engine.measure.runner
and the study's targets (tuner.study.measurer); `bench()` is the library function the command prints.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from tuner.schema.config import Config, SpecConfig, UserError
from tuner.cli.help import examples

OFF = SpecConfig(method="off")


@contextmanager
def _targets(cfg: Config, url: str | None = None, model: str | None = None) -> Iterator[Callable[[SpecConfig], Any]]:
    """Yields target_for(spec) -> a load-generator target serving that spec (one engine or server
    reused, as in a study). With `url`, every spec is the endpoint's own: nothing is started."""
    from engine.measure.runner import HttpTarget
    from tuner.study.measurer import LAUNCHED, engine_target_for, open_engine, open_launcher, server_target_for

    assert cfg.workload is not None
    chat = cfg.workload.chat_template
    if url is not None:
        served = model or cfg.model.name
        yield lambda _spec: HttpTarget(url, served, chat)
        return
    if cfg.engine.kind not in LAUNCHED:
        yield engine_target_for(open_engine(cfg), chat)
        return
    from engine.launch.launcher import EngineStartError

    with open_launcher(cfg) as launcher:
        target_for = server_target_for(launcher, chat)

        def launched(spec: SpecConfig) -> Any:
            try:
                return target_for(spec)
            except EngineStartError as exc:
                raise UserError(f"engine={cfg.engine.kind} did not start: {exc}") from None

        yield launched


def _figures(s: Any, spec: SpecConfig) -> dict[str, Any]:
    # Without speculation every target forward yields one token: tau is 1 by definition, also for
    # an HTTP engine that exposes no spec_decode counters when speculation is off (vLLM).
    tau = 1.0 if s.tau is None and spec.method == "off" else s.tau
    return {
        "output_tokens_per_s": s.output_tokens_per_s,
        "ci": [s.ci_low, s.ci_high] if s.ci_low is not None else None,
        "tau": tau,
        "ttft_ms": {"p50": s.ttft_p50_ms, "p99": s.ttft_p99_ms},
        "tpot_ms": {"p50": s.tpot_p50_ms, "p99": s.tpot_p99_ms},
        "itl_ms": {"p50": s.itl_p50_ms, "p99": s.itl_p99_ms},
        "request_throughput": s.request_throughput,
        "accepted_per_pos": s.accepted_per_pos,
        "n_requests": sum(m.n_requests for m in s.runs),
        "errors": s.errors[:5],
    } | (_open_loop_figures(s) if s.runs and s.runs[0].rate is not None else {})


def _open_loop_figures(s: Any) -> dict[str, Any]:
    """A request rate's queueing and the batch sizes the engine ran (summed over the repeats)."""
    sizes: dict[int, int] = {}
    for m in s.runs:
        for n, k in m.batch_sizes.items():
            sizes[n] = sizes.get(n, 0) + k
    p50 = [m.queue_p50_ms for m in s.runs if m.queue_p50_ms is not None]
    p99 = [m.queue_p99_ms for m in s.runs if m.queue_p99_ms is not None]
    return {"queue_ms": {"p50": statistics.median(p50) if p50 else None, "p99": statistics.median(p99) if p99 else None},
            "batch_sizes": dict(sorted(sizes.items()))}


def _level(lvl: dict[str, Any]) -> str:
    return f"rate {lvl['rate']:g} req/s" if "rate" in lvl else f"concurrency {lvl['concurrency']}"


def _served_model(url: str) -> str:
    """The first model an OpenAI-compatible endpoint lists under /v1/models."""
    import httpx

    try:
        r = httpx.get(url.rstrip("/") + "/v1/models", timeout=10)
        return str(r.json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise UserError(f"--url {url}: cannot read a model from /v1/models ({type(exc).__name__}); "
                        "is the endpoint up? (or name the model with --model)") from None


def bench(cfg: Config, url: str | None = None, model: str | None = None) -> dict[str, Any]:
    """Measure cfg.spec (and, with bench.baseline, speculation off) on cfg.workload at each of its
    concurrency levels and request rates. Top-level figures are those of the first level; `levels` has them all.
    With `url`, measure that running OpenAI-compatible endpoint as it is (engine "http")."""
    from engine.measure.runner import arrival_times, measure
    from engine.measure.workloads import load_prompts, sampling_params
    from tuner.schema.compose import require_workload

    require_workload(cfg)
    wl = cfg.workload
    assert wl is not None
    if url is None and cfg.engine.kind == "builtin":
        from tuner.study.measurer import spec_with_trained_draft

        cfg = cfg.model_copy(update={"spec": spec_with_trained_draft(cfg)})
    split = "heldout" if cfg.bench.heldout else "tune"
    if split == "heldout" and wl.num_heldout == 0:
        raise UserError("bench.heldout=true with workload.num_heldout=0: there are no held-out prompts")
    from tuner.study.measurer import request_encoder

    enc = request_encoder(cfg)  # the user's requests: ShareGPT budgets in tokens, the context check
    prompts = load_prompts(wl, split, enc, cfg.model.max_context if enc is not None else None)
    params = sampling_params(wl)
    b = cfg.bench
    levels: list[dict[str, Any]] = [{"concurrency": c} for c in wl.concurrency]
    levels += [{"rate": r} for r in sorted(set(wl.request_rate))]
    rate_prompts = [prompts[i % len(prompts)] for i in range(max(len(prompts), wl.rate_requests))]

    def at_level(target: Any, lvl: dict[str, Any]) -> Any:
        """The bench's figures of one level: a concurrency, or a request rate (workload.arrival)."""
        if "concurrency" in lvl:
            return measure(target, prompts, params, lvl["concurrency"], b.warmup, b.repeats)
        at = arrival_times(len(rate_prompts), lvl["rate"], wl.arrival, wl.seed, [p.arrival_s for p in rate_prompts])
        return measure(target, rate_prompts, params, 1, b.warmup, b.repeats, arrivals_s=at, rate=lvl["rate"])

    if url is not None and b.baseline:
        raise UserError("bench.baseline=true with --url: a running endpoint cannot switch speculation off")
    if url is not None and model is None:
        model = _served_model(url)
    note = launched_cache_note(cfg, len(levels)) if url is None else None
    if note:
        import sys

        print(note, file=sys.stderr)
    with _targets(cfg, url, model) as target_for:
        # All levels of one spec before the other: a launched engine restarts only once.
        for lvl in levels:
            lvl.update(_figures(at_level(target_for(cfg.spec), lvl), cfg.spec))
        from engine.drafters.memory import target_draft_memory

        draft_mem = target_draft_memory(target_for(cfg.spec), prompts, wl.max_new_tokens, wl.chat_template)
        if b.baseline:
            for lvl in levels:
                base = _figures(at_level(target_for(OFF), lvl), OFF)
                lvl["baseline"] = base
                lvl["speedup"] = (lvl["output_tokens_per_s"] / base["output_tokens_per_s"]
                                  if base["output_tokens_per_s"] > 0 else None)
    for lvl in levels:
        if lvl["n_requests"] == 0:
            raise UserError(f"every request failed at {_level(lvl)}: {lvl['errors'][0]}")
    out: dict[str, Any] = {
        "engine": "http" if url else cfg.engine.kind, "model": model or cfg.model.name, "hardware": cfg.hardware.name,
        "spec": None if url else cfg.spec.model_dump(mode="json"), "spec_key": url or cfg.spec.key(),
        "workload": wl.name, "split": split, "n_prompts": len(prompts),
        "max_new_tokens": wl.max_new_tokens, "temperature": wl.temperature,
        "warmup": b.warmup, "repeats": b.repeats,
        "draft_memory": draft_mem,  # built-in engine: parameters + KV of the drafter, MB
    }
    out.update(levels[0])
    out["levels"] = levels
    return out


def launched_cache_note(cfg: Config, n_levels: int) -> str | None:
    """The line a bench of a launched engine prints when several passes of a spec that remembers
    earlier requests (suffix) share one server: unlike the built-in engine's, vLLM's suffix cache
    cannot be put back between passes, so the later ones draft from the earlier ones' responses."""
    from tuner.study.measurer import LAUNCHED

    b, spec = cfg.bench, cfg.spec
    if cfg.engine.kind not in LAUNCHED or not spec.remembers_requests or int(b.warmup > 0) + b.repeats * n_levels < 2:
        return None
    return (f"note: engine={cfg.engine.kind} spec.method={spec.method}: the warm-up, repeats and concurrency levels "
            f"share one server, whose suffix cache keeps their responses (spec.suffix_max_requests="
            f"{spec.suffix_max_requests}): repeated prompts draft from them, so tau and tok/s read above what new "
            "prompts get (bench.warmup=0 bench.repeats=1 at one level measures one pass on an empty cache; a "
            "study restarts the server per pass)")


def _ms(d: dict[str, Any], key: str) -> str:
    p50, p99 = d[key]["p50"], d[key]["p99"]
    return "-" if p50 is None else f"{p50:.1f} / {p99:.1f}"


def _row(name: str, c: int | str, f: dict[str, Any], speedup: float | None) -> list[str]:
    tps = f"{f['output_tokens_per_s']:.1f}"
    if f["ci"]:
        tps += f" [{f['ci'][0]:.1f}, {f['ci'][1]:.1f}]"
    acc = " ".join(f"{a:.2f}" for a in f["accepted_per_pos"][:6]) or "-"
    return [str(c), name, tps, "-" if f["tau"] is None else f"{f['tau']:.2f}", _ms(f, "ttft_ms"), _ms(f, "tpot_ms"),
            _ms(f, "itl_ms"), acc, "-" if speedup is None else f"{speedup:.2f}x", str(len(f["errors"]))]


def print_table(result: dict[str, Any]) -> None:
    """The bench result as a rich table."""
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"{result['engine']} · {result['model']} · workload {result['workload']} ({result['split']}, "
                    f"{result['n_prompts']} prompts, {result['repeats']} repeats)")
    for col in ("conc/rate", "spec", "tok/s [95% CI]", "tau", "TTFT p50/p99 ms", "TPOT p50/p99 ms",
                "ITL p50/p99 ms", "accept/pos", "speedup", "errors"):
        t.add_column(col, justify="left" if col == "spec" else "right")
    for lvl in result["levels"]:
        where = f"{lvl['rate']:g}/s" if "rate" in lvl else lvl["concurrency"]
        t.add_row(*_row(result["spec_key"], where, lvl, lvl.get("speedup")))
        if "baseline" in lvl:
            t.add_row(*_row("off (baseline)", where, lvl["baseline"], None))
    Console().print(t)
    mem = result.get("draft_memory")
    if mem:
        Console().print(f"draft memory {mem['total_mb']:.1f} MB (parameters {mem['params_mb']:.1f} + KV {mem['kv_mb']:.1f} "
                        f"at {mem['kv_tokens']} tokens) = {100 * (mem['share_of_target'] or 0):.1f}% of the target's "
                        f"{mem['target_params_mb']:.0f} MB of parameters", highlight=False)


def _cmd_bench(args: argparse.Namespace) -> int:
    from tuner.schema.compose import load_config

    result = bench(load_config(args.overrides), args.url, args.model)
    if args.json:
        print(json.dumps(result))
    else:
        print_table(result)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add `bench` to the tuner CLI."""
    b = sub.add_parser("bench", help="measure the configured engine and spec on a workload (rich table or --json)",
                       **examples(
                           "tuner bench +workload=code spec.method=ngram spec.depth=3",
                           "tuner bench +workload=chat bench.baseline=true --json",
                           "tuner bench +workload=code --url http://127.0.0.1:8000 --model smollm2-135m",
                       ))
    b.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. spec.depth=6 bench.baseline=true +workload=code")
    b.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    b.add_argument("--url", help="measure this running OpenAI-compatible endpoint instead of starting an engine")
    b.add_argument("--model", help="with --url: the model name to request (default: the first in /v1/models)")
    b.set_defaults(func=_cmd_bench)
