#!/usr/bin/env bash
# The images' base built from Debian's own packages, for machines that reach Debian's mirror but
# no container registry (so `python:3.11-slim` cannot be pulled): debootstrap a minimal Debian with
# its python3 (3.11 on bookworm, the version the Dockerfile's default base carries) and import that
# root filesystem into buildah as an image, FROM scratch.
#
#   scripts/image_base.sh TAG [SUITE]      (root; DEBIAN_MIRROR overrides the mirror)
#
# BUILDAH (default "buildah --storage-driver vfs") is the command, the same one `make image-check` runs.
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: $0 TAG [SUITE]" >&2; exit 2; }
TAG=$1
SUITE=${2:-bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
read -r -a BUILDAH <<<"${BUILDAH:-buildah --storage-driver vfs}"
WORK=$(mktemp -d "${TMPDIR:-/var/tmp}/spectune-base.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

# minbase: dpkg, apt, bash, coreutils and passwd (useradd, which the Dockerfiles run); python3-venv
# brings ensurepip for scripts/setup.sh's `python3 -m venv`; ca-certificates lets pip reach PyPI.
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
  "$SUITE" "$WORK/rootfs" "$MIRROR"
# the downloaded .debs and package lists are not part of an image
rm -rf "$WORK"/rootfs/var/cache/apt/archives/*.deb "$WORK"/rootfs/var/lib/apt/lists/*
tar -C "$WORK/rootfs" --numeric-owner -cf "$WORK/rootfs.tar" .
rm -rf "$WORK/rootfs"

CTR=$("${BUILDAH[@]}" from scratch)
"${BUILDAH[@]}" add "$CTR" "$WORK/rootfs.tar" /
"${BUILDAH[@]}" config --env LANG=C.UTF-8 --cmd python3 \
  --label org.opencontainers.image.description="Debian $SUITE minbase with python3 (debootstrap)" "$CTR"
"${BUILDAH[@]}" commit --rm "$CTR" "$TAG"
