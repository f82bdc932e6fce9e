"""`tuner push-head` against a loopback hub (tests/hub_server.py) with huggingface_hub's real client:
the head's files land in the repository with the token from HF_TOKEN, best.yaml and the run's
manifests then reference the repository (the built-in server through an init container that
downloads it, vLLM directly), and render refuses a head path that no pod can read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from hub_server import Hub

from deploy.render import load_best, render
from tuner.cli import main
from tuner.schema.compose import load_config, save_config
from tuner.report.figures import write_best
from tuner.schema.config import BestResult, Provenance, SpecConfig, UserError

REPO = "me/smol-eagle"


def _head(tmp_path: Path) -> Path:
    """A head directory in the layout `tuner train-draft` writes (config.json + safetensors)."""
    import numpy as np
    from safetensors.numpy import save_file

    head = tmp_path / "heads" / "smollm2-eagle"
    head.mkdir(parents=True)
    (head / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1}))
    save_file({"fc.weight": np.arange(12, dtype=np.float32).reshape(3, 4)}, str(head / "model.safetensors"))
    return head


def _run(tmp_path: Path, head: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    save_config(load_config(["model=smollm2-135m", "+workload=code"]), run / "config.yaml")
    spec = SpecConfig(method="eagle", depth=3, topk=2, budget=5, head_path=str(head))
    chain = SpecConfig(method="eagle", depth=3, topk=1, budget=4, head_path=str(head))
    write_best(BestResult(spec=spec, chain_spec=chain, speedup=1.4, provenance=Provenance(
        study="s", date="2026-11-30T12:00:00+00:00", model="smollm2-135m", hardware="cpu", engine="builtin",
        workload="code")), run / "best.yaml")
    return run


@pytest.fixture
def hub(monkeypatch):
    with Hub(require_token="hf_write") as h:
        monkeypatch.setenv("HF_ENDPOINT", h.url)
        monkeypatch.setenv("HF_TOKEN", "hf_write")
        monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        yield h


def test_render_refuses_a_head_only_this_machine_has(tmp_path: Path, capsys) -> None:
    run = _run(tmp_path, _head(tmp_path))
    assert main(["render", "--from", str(run), "--out", str(tmp_path / "k8s")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no pod can read" in err[0] and "tuner push-head" in err[0], err
    assert not (tmp_path / "k8s").exists()


def test_push_a_run_then_its_manifests_reference_the_repository(tmp_path: Path, hub: Hub, capsys) -> None:
    head = _head(tmp_path)
    run = _run(tmp_path, head)
    assert main(["push-head", str(run), "--to", REPO]) == 0, capsys.readouterr().err
    # the repository holds the head, byte for byte, uploaded with the token
    assert hub.repos[REPO] == {f.name: f.read_bytes() for f in head.iterdir()}
    assert "Bearer hf_write" in hub.auth
    best = load_best(run / "best.yaml")
    assert best.spec.head_path == REPO and best.chain_spec.head_path == REPO
    # built-in server: an init container downloads the repository into the volume the server reads
    dep = yaml.safe_load((run / "k8s" / "deployment.yaml").read_text())["spec"]["template"]["spec"]
    init = dep["initContainers"][0]
    assert init["command"] == ["hf", "download", REPO, "--local-dir", "/models/drafts/me--smol-eagle"]
    assert {"name": "model-cache", "mountPath": "/models"} in init["volumeMounts"]
    assert "spec.head_path=/models/drafts/me--smol-eagle" in dep["containers"][0]["args"]
    assert init["image"] == dep["containers"][0]["image"]
    # vLLM on a GPU pulls the repository itself: the speculative config names it, no init container
    _, files = render(load_config(["model=smollm2-135m", "hardware=h200x1", "deploy=vllm"]), best, tmp_path / "v")
    vdep = yaml.safe_load((tmp_path / "v" / "deployment.yaml").read_text())["spec"]["template"]["spec"]
    args = vdep["containers"][0]["args"]
    spec_cfg = json.loads(args[args.index("--speculative-config") + 1])
    assert spec_cfg["model"] == REPO and "initContainers" not in vdep


def test_push_a_head_directory_and_bad_input(tmp_path: Path, hub: Hub, capsys) -> None:
    head = _head(tmp_path)
    assert main(["push-head", str(head), "--to", "org/other"]) == 0
    assert f"spec.head_path=org/other" in capsys.readouterr().out
    assert set(hub.repos["org/other"]) == {"config.json", "model.safetensors"}
    for source, repo, needle in [(head, "no-slash", "ORG/NAME"), (tmp_path, "org/x", "not a draft head"),
                                 (tmp_path / "missing", "org/x", "no such directory")]:
        assert main(["push-head", str(source), "--to", repo]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0], err


def test_a_wrong_token_is_one_line(tmp_path: Path, hub: Hub, monkeypatch, capsys) -> None:
    monkeypatch.setenv("HF_TOKEN", "read-only")
    assert main(["push-head", str(_head(tmp_path)), "--to", REPO]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "answered 401" in err[0] and "HF_TOKEN set" in err[0], err
    assert REPO not in hub.repos


def test_a_path_inside_the_model_volume_is_served_as_is() -> None:
    from deploy.winner import served_spec

    cfg = load_config(["model=smollm2-135m", "spec.method=eagle", "spec.depth=2", "spec.budget=3",
                       "spec.head_path=/models/drafts/mine"])
    served = served_spec(cfg, None)
    assert served.spec.head_path == "/models/drafts/mine" and served.fetches == ()
    with pytest.raises(UserError, match="tuner push-head /srv/heads/mine --to ORG/NAME"):
        served_spec(load_config(["model=smollm2-135m", "spec.method=eagle", "spec.depth=2", "spec.budget=3",
                                 "spec.head_path=/srv/heads/mine"]), None)


def test_the_report_job_pushes_the_winners_head_or_says_there_is_none(tmp_path: Path, hub: Hub, capsys) -> None:
    """Issue 24: a distributed study's EAGLE winner could not be pushed (its head died with the
    worker). The report Job now reads the head from the cache volume and, with
    distributed.push_head_to, `tuner report --storage ... --push-head ORG/NAME` pushes it and writes
    the manifests against the repository; a training-free winner pushes nothing."""
    from tuner.cli.hub import push_winner

    head = _head(tmp_path)
    run = _run(tmp_path, head)
    assert push_winner(run, REPO).startswith(f"pushed the winner's head to {REPO}")
    assert hub.repos[REPO] == {f.name: f.read_bytes() for f in head.iterdir()}
    assert load_best(run / "best.yaml").spec.head_path == REPO
    assert (run / "k8s" / "deployment.yaml").is_file()  # rendered now that a pod can fetch the head
    plain = tmp_path / "plain"
    plain.mkdir()
    save_config(load_config(["model=smollm2-135m", "+workload=code"]), plain / "config.yaml")
    write_best(BestResult(spec=SpecConfig(method="ngram", depth=3), speedup=1.2, provenance=Provenance(
        study="s", date="2026-11-30T12:00:00+00:00", model="smollm2-135m", hardware="cpu", engine="builtin",
        workload="code")), plain / "best.yaml")
    assert push_winner(plain, "me/other") == "the winner (ngram d3 k1 b4) has no trained head here: nothing pushed to me/other"
    assert "me/other" not in hub.repos
    for argv, needle in ([["report", str(run), "--push-head", REPO], "--push-head me/smol-eagle is for a shared study"],
                         [["report", "--storage", f"journal:{tmp_path}/j.log", "--study", "s", "--push-head", "bad"],
                          "--push-head bad: not a hub repository id"]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0], err
