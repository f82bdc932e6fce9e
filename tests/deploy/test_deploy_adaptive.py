"""An adaptive winner (spec.adaptive, measured on the built-in engine) rendered for each target: the
built-in server serves it as it is; SGLang runs `--speculative-adaptive` with its knobs file only from
the release that has the flag (else, like vLLM, whose adaptive verification is dspark-only, the study's
static schedule measured second best is served, said in one line). Manifests strictly validated."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from deploy.validate import check_dir
from tuner.cli import main
from tuner.schema.compose import load_config, save_config
from tuner.schema.config import ArmLevel, Arms, BestResult, Figures, Provenance, SpecConfig

HEAD = "org/eagle3-head"
ADAPTIVE = SpecConfig(method="eagle3", depth=6, topk=1, budget=7, head_path=HEAD, adaptive=True)
STATIC = SpecConfig(method="eagle3", depth=4, topk=1, budget=5, head_path=HEAD,
                    k_per_batch_size=[(1, 1, 4), (2, 8, 2)])


def _best(spec: SpecConfig, static: SpecConfig | None, beats_off: bool = True) -> BestResult:
    arms = Arms(choice="adaptive", adaptive=spec, static=static, static_beats_off=beats_off and static is not None,
                adaptive_speedup=1.41, static_speedup=1.22 if static else None,
                levels=[ArmLevel(level="c=1", off_tok_s=40.0, static_speedup=1.3, static_tok_s=52.0,
                                 adaptive_speedup=1.5, adaptive_tok_s=60.0)])
    return BestResult(spec=spec, metrics=Figures(output_tokens_per_s=60.0, tau=2.1),
                      baseline=Figures(output_tokens_per_s=40.0), speedup=1.41, reason="adaptive won", arms=arms,
                      provenance=Provenance(study="s", date="2026-12-02T15:00:00+00:00", model="smollm2-135m",
                                            hardware="cpu", engine="builtin", workload="code"))


def _render(tmp_path: Path, best: BestResult, args: list[str], capsys: pytest.CaptureFixture) -> tuple[dict, list[str]]:
    run = tmp_path / "run"
    save_config(load_config([]), run / "config.yaml")
    (run / "best.yaml").write_text(yaml.safe_dump(best.model_dump(mode="json")))
    out = tmp_path / "k8s"
    assert main(["render", "--from", str(run), *args, "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert check_dir(out, "1.33") == []
    docs = {p.name: yaml.safe_load(p.read_text()) for p in out.glob("*.yaml")}
    notes = [ln for ln in err.splitlines() if "sizes its drafts per step" in ln]
    return docs, notes


def _pod(docs: dict) -> dict:
    return docs["deployment.yaml"]["spec"]["template"]["spec"]


def _arg(args: list[str], flag: str) -> str:
    assert args.count(flag) == 1, (flag, args)
    return args[args.index(flag) + 1]


def test_pinned_sglang_without_the_flag_serves_the_static_second_best(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture) -> None:
    docs, notes = _render(tmp_path, _best(ADAPTIVE, STATIC), ["deploy=sglang", "hardware=h200x1"], capsys)
    args = _pod(docs)["containers"][0]["args"]
    assert "--speculative-adaptive" not in args and "--speculative-adaptive-config" not in args
    assert (_arg(args, "--speculative-num-steps"), _arg(args, "--speculative-num-draft-tokens")) == ("4", "5")
    assert len(notes) == 1 and "SGLang 0.5.9 (deploy.image_tag=v0.5.9-cu129) has no --speculative-adaptive " \
                               "(from 0.5.11)" in notes[0]
    assert "second best, 'eagle3 d4 k1 b5'" in notes[0] and "1.220x against the adaptive 1.410x" in notes[0]
    assert "adaptive" not in {v["name"] for v in _pod(docs)["volumes"]}
    served = yaml.safe_load(docs["configmap.yaml"]["data"]["served.yaml"])
    assert served["tuned_spec"]["adaptive"] is True and served["spec"]["adaptive"] is False


@pytest.mark.parametrize("tag,overlap,knobs", [
    ("v0.5.11-cu129", True, {"candidate_steps": [1, 3, 6]}),
    ("v0.5.12-cu129", False, {"candidate_steps": [1, 3, 6]}),
    ("v0.5.13-cu129", False, {"1": {"candidate_steps": [1, 3, 6]}}),
    ("v0.5.23-cu129", False, {"1": {"candidate_steps": [0, 1, 3, 6]}}),
])
def test_sglang_with_the_flag_renders_adaptive_and_mounts_its_knobs(tag: str, overlap: bool, knobs: dict,
                                                                     tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    docs, notes = _render(tmp_path, _best(ADAPTIVE, STATIC), ["deploy=sglang", "hardware=h200x1",
                                                              f"deploy.image_tag={tag}"], capsys)
    assert notes == []
    pod = _pod(docs)
    c = pod["containers"][0]
    path = _arg(c["args"], "--speculative-adaptive-config")
    assert "--speculative-adaptive" in c["args"] and ("--disable-overlap-schedule" in c["args"]) == overlap
    # the depth bound is where SGLang starts; the chain's draft tokens follow it
    assert (_arg(c["args"], "--speculative-num-steps"), _arg(c["args"], "--speculative-eagle-topk")) == ("6", "1")
    mount = next(m for m in c["volumeMounts"] if m["name"] == "adaptive")
    volume = next(v for v in pod["volumes"] if v["name"] == "adaptive")
    item = volume["configMap"]["items"][0]
    assert mount["readOnly"] and path == f"{mount['mountPath']}/{item['path']}"
    cm = docs["configmap.yaml"]
    assert volume["configMap"]["name"] == cm["metadata"]["name"]
    assert json.loads(cm["data"][item["key"]]) == knobs


def test_sglang_adapts_eagle_chains_only(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    tree = SpecConfig(method="eagle3", depth=6, topk=2, budget=8, head_path=HEAD, adaptive=True)
    docs, notes = _render(tmp_path, _best(tree, STATIC), ["deploy=sglang", "hardware=h200x1",
                                                          "deploy.image_tag=v0.5.14-cu129"], capsys)
    assert len(notes) == 1 and "adapts EAGLE / EAGLE-3 chains only" in notes[0]
    assert "--speculative-adaptive" not in _pod(docs)["containers"][0]["args"]


def test_vllm_serves_the_tuned_k_schedule_and_says_why(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    docs, notes = _render(tmp_path, _best(ADAPTIVE, STATIC), ["deploy=vllm", "hardware=h200x1"], capsys)
    conf = json.loads(_arg(_pod(docs)["containers"][0]["args"], "--speculative-config"))
    assert "enable_adaptive_verification" not in conf
    assert conf["num_speculative_tokens"] == 4 and conf["num_speculative_tokens_per_batch_size"] == [[1, 1, 4], [2, 8, 2]]
    assert len(notes) == 1 and "only for method dspark" in notes[0] and "tuned K per batch size" in notes[0]


def test_no_static_schedule_beat_off_serves_off(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    for static in (None, STATIC):  # none measured, or measured slower than off
        docs, notes = _render(tmp_path / str(static), _best(ADAPTIVE, static, beats_off=False),
                              ["deploy=vllm", "hardware=h200x1"], capsys)
        assert "--speculative-config" not in _pod(docs)["containers"][0]["args"]
        assert len(notes) == 1 and "speculation off, second best" in notes[0]


def test_builtin_serves_adaptive_as_measured(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    ngram = SpecConfig(method="ngram", depth=8, topk=1, budget=9, adaptive=True)
    docs, notes = _render(tmp_path, _best(ngram, None), [], capsys)
    assert notes == [] and "spec.adaptive=true" in _pod(docs)["containers"][0]["args"]


def test_adaptive_without_a_study_is_refused_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    args = ["render", "deploy=vllm", "hardware=h200x1", "spec.adaptive=true", "--out", str(tmp_path / "o")]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot be served adaptively by deploy=vllm" in err[0] and "spec.adaptive=false" in err[0]
    assert not (tmp_path / "o").exists()
