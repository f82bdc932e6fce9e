"""The container images, checked without a Docker daemon: both Dockerfiles parse, are multi-stage,
pinned, non-root and install through scripts/setup.sh (the script `make setup` runs); the commands
they run exist in the venv that script built and answer --help; and every spectune image a
manifest references is one that `make image` tags (with the package version)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from dockerfile_parse import DockerfileParser

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent  # the venv `make setup` (scripts/setup.sh) built
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def _parse(name: str) -> DockerfileParser:
    import io

    return DockerfileParser(fileobj=io.BytesIO((ROOT / name).read_bytes()))


def _stages(dfp: DockerfileParser) -> list[list[dict]]:
    stages: list[list[dict]] = []
    for ins in dfp.structure:
        if ins["instruction"] == "FROM":
            stages.append([])
        if stages:
            stages[-1].append(ins)
    return stages


def _make_image_tags() -> list[str]:
    out = subprocess.run(["make", "-n", "image"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [t for line in out.splitlines() for t in re.findall(r"-t (\S+)", line)]


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.vllm"])
def test_dockerfile_is_multi_stage_pinned_non_root_and_installs_with_the_setup_script(name: str) -> None:
    dfp = _parse(name)
    stages = _stages(dfp)
    assert len(stages) == 2, "a build stage and a runtime stage"
    # the base is pinned to an exact version through an ARG default (never 'latest', never a bare name)
    arg_defaults = dict(a.split("=", 1) for ins in dfp.structure if ins["instruction"] == "ARG"
                        for a in [ins["value"]] if "=" in a)
    for stage in stages:
        base = stage[0]["value"].split()[0]
        image = arg_defaults.get(base.strip("${}"), base)
        assert re.fullmatch(r"[\w./-]+:v?\d+\.\d+\.\d+[\w.-]*", image), f"{name}: base {image} is not pinned"
    build, runtime = stages
    runs = " ".join(i["value"] for i in build if i["instruction"] == "RUN")
    assert "scripts/setup.sh /opt/spectune --torch" in runs
    assert any(i["instruction"] == "COPY" and i["value"].startswith("--from=build /opt/spectune")
               for i in runtime)
    users = [i["value"] for i in runtime if i["instruction"] == "USER"]
    assert users and users[-1].split(":")[0] == "1000"  # the uid the manifests run as
    if name == "Dockerfile":  # the built-in engine compiles at run time (inductor, the few-row kernel)
        assert "g++" in " ".join(i["value"] for i in runtime if i["instruction"] == "RUN")
    from deploy.manifests import BUILTIN_UID

    assert BUILTIN_UID == 1000
    # every path the build copies exists in the repository
    for i in build:
        if i["instruction"] == "COPY" and not i["value"].startswith("--from"):
            for src in i["value"].split()[:-1]:
                assert (ROOT / src).exists(), f"{name}: COPY {src}: missing"


def test_the_variants_choose_the_torch_build() -> None:
    dfp = _parse("Dockerfile")
    assert any(i["instruction"] == "ARG" and i["value"] == "VARIANT=cpu" for i in dfp.structure)
    out = subprocess.run(["bash", str(ROOT / "scripts/setup.sh"), "/nonexistent", "--torch", "gpu"],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "allowed auto, cpu, cuda" in out.stderr  # VARIANT must be cpu or cuda


def test_make_setup_runs_the_same_script() -> None:
    out = subprocess.run(["make", "-n", "-B", "setup"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "scripts/setup.sh .venv --torch auto --dev" in out
    assert "pip install" not in out  # no second copy of the install steps in the Makefile


def test_the_image_commands_exist_in_the_venv_and_run_help() -> None:
    from deploy.manifests import COMMANDS

    argvs = []
    for name in ("Dockerfile", "Dockerfile.vllm"):
        runtime = _stages(_parse(name))[-1]
        cmds = [yaml.safe_load(i["value"]) if i["value"].startswith("[") else shlex.split(i["value"])
                for i in runtime if i["instruction"] in ("CMD", "ENTRYPOINT")]
        argvs.append([c for c in cmds if c][-1])
    # and what the manifests run in these images: `tuner serve` (deploy=builtin), `tuner optimize`
    # (workers), `hf download` (the init container fetching a hub drafter)
    argvs += [COMMANDS["builtin"], ["tuner", "optimize"], ["hf", "download"]]
    for argv in {tuple(a) for a in argvs}:
        exe = VENV_BIN / argv[0]
        assert exe.is_file(), f"{argv[0]} is not in {VENV_BIN}"
        r = subprocess.run([str(exe), *argv[1:], "--help"], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and "usage" in r.stdout.lower(), (argv, r.stderr[-500:])


def test_manifests_reference_exactly_the_tags_make_image_builds() -> None:
    tags = _make_image_tags()
    assert tags == [f"ghcr.io/spectune/spectune:{VERSION}", f"ghcr.io/spectune/spectune:{VERSION}-cuda",
                    f"ghcr.io/spectune/spectune-vllm:{VERSION}",
                    f"ghcr.io/spectune/spectune-vllm-suffix:{VERSION}-vllm-v{_make_var('VLLM_VERSION')}"]
    # the defaults the renderers use
    from tuner.schema.compose import load_config

    from tuner.schema.config import SpecConfig, deploy_image, spectune_image

    cfg = load_config([])
    assert cfg.image_tag == VERSION
    assert deploy_image(cfg, cfg.spec) in tags
    assert [spectune_image(cfg, v) for v in ("cpu", "cuda", "vllm")] == tags[:3]  # one setting, every variant
    vllm = load_config(["deploy=vllm", "hardware=h200x1"])
    assert deploy_image(vllm, SpecConfig(method="suffix", depth=4, budget=5)) == tags[3]  # vLLM + arctic-inference
    # every spectune image in a committed or golden manifest
    refs = set()
    for f in [*(ROOT / "k8s").rglob("*.yaml"), *(ROOT / "tests" / "golden").rglob("*.yaml")]:
        refs |= set(re.findall(r"image:\s*(ghcr\.io/spectune/\S+)", f.read_text()))
    assert refs and refs <= set(tags), refs - set(tags)


def _make_n(*args: str) -> str:
    # --no-print-directory: under a parent make (make test) the first line would be "Entering directory"
    return subprocess.run(["make", "-n", "--no-print-directory", *args], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout


def _make_var(name: str) -> str:
    """The value make gives a Makefile variable (VLLM_VERSION is read from conf/deploy/vllm.yaml's pin)."""
    out = subprocess.run(["make", "-s", "--no-print-directory", "--eval", "print-var-%: ; @echo $($*)",
                          f"print-var-{name}"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert out, f"Makefile: no value for {name}"
    return out


def test_the_vllm_suffix_image_pins_what_make_vllm_suffix_installs() -> None:
    """Dockerfile.vllm-suffix (vLLM's server for a suffix winner) builds arctic-inference as `make
    vllm-suffix` does, from the same pinned versions, on the vLLM image the deploy config names."""
    dfp = _parse("Dockerfile.vllm-suffix")
    args = dict(a.split("=", 1) for ins in dfp.structure if ins["instruction"] == "ARG" for a in [ins["value"]] if "=" in a)
    vllm = yaml.safe_load((ROOT / "conf/deploy/vllm.yaml").read_text())
    assert args["VLLM_BASE"] == f"vllm/vllm-openai:v{_make_var('VLLM_VERSION')}" == f"{vllm['image']}:{vllm['image_tag']}"
    assert args["ARCTIC_VERSION"] == _make_var("ARCTIC_VERSION") and args["NANOBIND_VERSION"] == _make_var("NANOBIND_VERSION")
    assert [i["value"] for i in dfp.structure if i["instruction"] == "FROM"] == ["${VLLM_BASE}"]
    runs = " ".join(i["value"] for i in dfp.structure if i["instruction"] == "RUN")
    assert "pip install --no-cache-dir -q --no-build-isolation --no-deps arctic-inference==${ARCTIC_VERSION}" in runs
    assert "nanobind==${NANOBIND_VERSION}" in runs and "from arctic_inference.suffix_decoding import" in runs
    make = _make_n("-B", "vllm-suffix")
    assert f"--no-build-isolation --no-deps arctic-inference=={args['ARCTIC_VERSION']}" in make
    assert f"nanobind=={args['NANOBIND_VERSION']}" in make
    build = next(ln for ln in _make_n("image").replace("\\\n", " ").splitlines() if "Dockerfile.vllm-suffix" in ln)
    for name in ("VLLM_BASE", "ARCTIC_VERSION", "NANOBIND_VERSION"):
        assert f"--build-arg {name}={args[name]}" in build


def test_push_sends_the_tags_image_builds_to_image_repo() -> None:
    """`make push IMAGE_REPO=R` pushes exactly what `make image IMAGE_REPO=R` tags, and the renderers
    name the same images from image_repo=R (tests/deploy/test_distributed_manifests.py checks every one)."""
    from tuner.schema.compose import load_config
    from tuner.schema.config import spectune_image

    repo = "registry.example.com/team"
    built = [t for line in _make_n("image", f"IMAGE_REPO={repo}").splitlines() for t in re.findall(r"-t (\S+)", line)]
    pushed = re.search(r"for tag in ([^;]+);", _make_n("push", f"IMAGE_REPO={repo}")).group(1).split()
    assert built == pushed and all(t.startswith(repo + "/") for t in built)
    cfg = load_config([f"image_repo={repo}"])
    assert [spectune_image(cfg, v) for v in ("cpu", "cuda", "vllm")] == built[:3]
    from tuner.schema.config import vllm_suffix_image

    assert vllm_suffix_image(load_config([f"image_repo={repo}", "deploy=vllm"])) == built[3]


def test_image_check_builds_from_a_debian_base_with_buildah_and_runs_the_image() -> None:
    """Issue 24: `make image-check` (not part of `make test`) builds the CPU image with buildah from a
    debootstrap base given as the Dockerfile's FROM argument, then runs tuner inside it; the CPU
    variant can only take torch's CPU build (the +cpu pin), never a bare `torch`."""
    out = _make_n("image-check")
    # a fresh machine: buildah and debootstrap installed first when missing (issue 38.7), as make postgres does
    install = out.splitlines()[:5]
    assert "for t in buildah debootstrap; do command -v $t" in install[0] and "apt-get install -y -q $missing" in install[3]
    assert "scripts/image_base.sh localhost/spectune-base:bookworm" in out
    bud = next(line for line in out.splitlines() if " bud " in line)
    assert "--isolation chroot" in bud and "--build-arg PYTHON_BASE=localhost/spectune-base:bookworm" in bud
    assert "--build-arg VARIANT=cpu" in bud and f"-t ghcr.io/spectune/spectune:{VERSION} ." in bud
    assert f"scripts/image_check.sh ghcr.io/spectune/spectune:{VERSION}" in out
    assert "buildah" not in _make_n("-B", "test") and "image" not in _make_n("-B", "test")
    base = (ROOT / "scripts/image_base.sh").read_text()
    assert "debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates" in base
    assert "from scratch" in base
    check = (ROOT / "scripts/image_check.sh").read_text()
    for cmd in ("run tuner --help", "run tuner render --out", "run tuner bench model=tiny-random", "torch.compile",
                "smallm.library()", "attention.library()"):
        assert cmd in check
    dfp = _parse("Dockerfile")
    assert [i["value"].split()[0] for i in dfp.structure if i["instruction"] == "FROM"] == ["${PYTHON_BASE}"] * 2
    setup = (ROOT / "scripts/setup.sh").read_text()
    cpu = re.search(r'elif \[ "\$TORCH" = cpu \]; then\n(.*?)\nelse\n', setup, re.S).group(1)  # the cpu branch
    installs = re.findall(r'install -q "(torch[^"]*)"', cpu)
    assert len(installs) == 2 and set(installs) == {"torch==$TORCH_VERSION+cpu"}, installs  # index URL or directory
