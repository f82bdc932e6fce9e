#!/usr/bin/env bash
# Run a built spectune image (`make image-check`): a working container from IMAGE, and inside it, as
# the image's own non-root user, `tuner --help`, `tuner render` (plus `render --check` of what it
# wrote) and a short `tuner bench` of the tiny random model. Removes the container on exit.
#
#   scripts/image_check.sh IMAGE      (BUILDAH: the command, default "buildah --storage-driver vfs")
set -euo pipefail
[ $# -eq 1 ] || { echo "usage: $0 IMAGE" >&2; exit 2; }
read -r -a BUILDAH <<<"${BUILDAH:-buildah --storage-driver vfs}"
CTR=$("${BUILDAH[@]}" from --pull-never "$1")
trap '"${BUILDAH[@]}" rm "$CTR" >/dev/null' EXIT
run() { echo "+ $*"; "${BUILDAH[@]}" run --isolation chroot "$CTR" -- "$@"; }

run id -u
run tuner --help | head -3
run tuner render --out /tmp/k8s
run tuner render --check /tmp/k8s
# the tiny random Llama (the packaged SmolLM2 tokenizer, no download): 2 prompts, 16 tokens, one repeat
run tuner bench model=tiny-random +workload=code workload.num_prompts=2 workload.max_new_tokens=16 \
  bench.warmup=0 bench.repeats=1 spec.method=ngram
# the compiler the engine needs at run time: an inductor CPU compile and the builds of the few-row
# linear and the decode attention kernels
run python -c "import torch; f = torch.compile(lambda x: (x * 2).sum()); assert f(torch.ones(4)).item() == 8.0; print('inductor ok')"
run python -c "from engine.models import smallm; assert smallm.library() is not None, smallm.error(); print('smallm ok')"
run python -c "from engine.models import attention; assert attention.library() is not None, attention.error(); print('attention ok')"
