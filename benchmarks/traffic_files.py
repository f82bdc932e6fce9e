"""Write request files for a study on mixed traffic: code.jsonl (HumanEval), chat.jsonl (MT-bench) and
math.jsonl (GSM-style problems from reasoning-gym), OpenAI chat bodies made from the packaged sets;
every other request sampled at T=0.7 (with its own seed), the rest greedy; budgets of 32 to 128
tokens. Run: python benchmarks/traffic_files.py DIR [N per file]. Then, for example:

  tuner optimize +workload=mix search=quick \
    "workload.mix=[{path:DIR/code.jsonl,weight:0.5},{path:DIR/chat.jsonl,weight:0.3},{path:DIR/math.jsonl,weight:0.2}]"
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from engine.measure.workloads import gsm_prompts, humaneval_prompts, mtbench_prompts

BUDGETS = (32, 64, 96, 128)


def write(path: Path, texts: list[str]) -> None:
    """One OpenAI chat body per text: odd lines sampled (T=0.7, seed = line), budgets cycling."""
    with path.open("w") as f:
        for i, text in enumerate(texts):
            body: dict = {"model": "m", "messages": [{"role": "user", "content": text}],
                          "max_tokens": BUDGETS[i % len(BUDGETS)]}
            if i % 2:
                body.update(temperature=0.7, seed=i)
            f.write(json.dumps(body) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description="Write code.jsonl, chat.jsonl and math.jsonl request files into DIR.")
    ap.add_argument("dir", type=Path, help="the folder to write the three files into (made if missing)")
    ap.add_argument("n", type=int, nargs="?", default=60, help="requests per file (default 60)")
    args = ap.parse_args()
    out, n = args.dir, args.n
    out.mkdir(parents=True, exist_ok=True)
    write(out / "code.jsonl", [p.text for p in humaneval_prompts()[:n]])
    write(out / "chat.jsonl", [p.text for p in mtbench_prompts()[:n]])
    write(out / "math.jsonl", [p.text for p in gsm_prompts(n, 0)])
    print(out)


if __name__ == "__main__":
    main()
