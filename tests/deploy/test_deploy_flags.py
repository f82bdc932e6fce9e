"""tuner.schema.flags: SpecConfig -> vLLM / SGLang / built-in flags, for every method."""

from __future__ import annotations

import json

import pytest

from tuner.schema.flags import builtin_args, sglang_args, vllm_args, vllm_speculative_config
from tuner.schema.config import SpecConfig, UserError


def _opt(args: list[str], flag: str) -> str:
    assert args.count(flag) == 1, f"{flag} must appear exactly once in {args}"
    return args[args.index(flag) + 1]


def _spec_json(args: list[str]) -> dict:
    return json.loads(_opt(args, "--speculative-config"))


# ---- vLLM ---------------------------------------------------------------------------------

def test_vllm_off_has_no_speculative_config() -> None:
    spec = SpecConfig(method="off")
    assert vllm_speculative_config(spec) is None
    assert "--speculative-config" not in vllm_args("m", spec)


def test_vllm_ngram() -> None:
    spec = SpecConfig(method="ngram", depth=6, budget=7, ngram_min=3, ngram_max=5)
    assert vllm_speculative_config(spec) == {
        "method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_min": 3, "prompt_lookup_max": 5,
    }


def test_vllm_draft_model_uses_draft_ref_override() -> None:
    spec = SpecConfig(method="draft_model", depth=3, budget=4, draft_model="meta-llama/Llama-3.2-1B-Instruct")
    assert vllm_speculative_config(spec) == {
        "method": "draft_model", "model": "meta-llama/Llama-3.2-1B-Instruct", "num_speculative_tokens": 3,
    }
    assert vllm_speculative_config(spec, "/models/draft")["model"] == "/models/draft"


@pytest.mark.parametrize("method", ["eagle", "eagle3", "medusa"])
def test_vllm_heads(method: str) -> None:
    spec = SpecConfig(method=method, depth=5, budget=6, head_path="org/head")
    assert vllm_speculative_config(spec) == {"method": method, "model": "org/head", "num_speculative_tokens": 5}


def test_vllm_head_without_path_is_a_user_error() -> None:
    with pytest.raises(UserError, match="spec.head_path is required"):
        vllm_speculative_config(SpecConfig(method="eagle3", depth=2, budget=3))


def test_vllm_k_schedule_is_passed_through() -> None:
    spec = SpecConfig(method="ngram", depth=4, budget=5, k_per_batch_size=[(1, 4, 3), (5, 64, 1), (65, 512, 0)])
    conf = vllm_speculative_config(spec)
    assert conf["num_speculative_tokens_per_batch_size"] == [[1, 4, 3], [5, 64, 1], [65, 512, 0]]


def test_vllm_refuses_trees() -> None:
    spec = SpecConfig(method="eagle", depth=5, topk=4, budget=8, head_path="h")
    with pytest.raises(UserError, match="topk=4.*chains only"):
        vllm_speculative_config(spec)


def test_vllm_args_full() -> None:
    spec = SpecConfig(method="eagle3", depth=3, budget=4, head_path="h")
    args = vllm_args(
        "meta-llama/Llama-3.1-8B-Instruct", spec, dtype="bfloat16", max_model_len=8192, tensor_parallel_size=2,
        quantization="fp8", kv_cache_dtype="fp8", gpu_memory_utilization=0.9, served_model_name="llama",
        host="127.0.0.1", port=8100, enforce_eager=True, extra_args=["--seed", "0"],
    )
    assert args[0] == "meta-llama/Llama-3.1-8B-Instruct"
    assert _opt(args, "--host") == "127.0.0.1" and _opt(args, "--port") == "8100"
    assert _opt(args, "--tensor-parallel-size") == "2"
    assert _opt(args, "--max-model-len") == "8192"
    assert _opt(args, "--quantization") == "fp8" and _opt(args, "--kv-cache-dtype") == "fp8"
    assert _opt(args, "--gpu-memory-utilization") == "0.9"
    assert _opt(args, "--served-model-name") == "llama"
    assert "--enforce-eager" in args and args[-2:] == ["--seed", "0"]
    assert _spec_json(args) == {"method": "eagle3", "model": "h", "num_speculative_tokens": 3}


def test_vllm_args_leave_defaults_out() -> None:
    args = vllm_args("m", SpecConfig(method="off"), quantization="none", kv_cache_dtype="auto")
    for flag in ("--quantization", "--kv-cache-dtype", "--tensor-parallel-size", "--enforce-eager"):
        assert flag not in args


def test_vllm_suffix_golden() -> None:
    """vLLM's suffix method (arctic-inference), field names as in vllm/config/speculative.py."""
    spec = SpecConfig(method="suffix", depth=8, budget=9, suffix_tree_depth=32, suffix_max_requests=500,
                      suffix_spec_factor=1.5, suffix_min_prob=0.2)
    assert vllm_speculative_config(spec) == {
        "method": "suffix", "num_speculative_tokens": 8, "suffix_decoding_max_tree_depth": 32,
        "suffix_decoding_max_cached_requests": 500, "suffix_decoding_max_spec_factor": 1.5,
        "suffix_decoding_min_token_prob": 0.2,
    }
    assert _opt(vllm_args("m", spec), "--speculative-config") == (
        '{"method":"suffix","num_speculative_tokens":8,"suffix_decoding_max_cached_requests":500,'
        '"suffix_decoding_max_spec_factor":1.5,"suffix_decoding_max_tree_depth":32,"suffix_decoding_min_token_prob":0.2}')


@pytest.mark.parametrize("spec", [SpecConfig(method="suffix", depth=4, topk=2, budget=6),
                                  SpecConfig(method="recycle", depth=2, budget=3)], ids=lambda s: s.key())
def test_vllm_refuses_suffix_trees_and_recycle(spec: SpecConfig) -> None:
    with pytest.raises(UserError, match=r"topk must be 1|cannot be served by vLLM"):
        vllm_speculative_config(spec)


# ---- SGLang -------------------------------------------------------------------------------

@pytest.mark.parametrize("method,algo", [("eagle", "EAGLE"), ("eagle3", "EAGLE3")])
def test_sglang_tree(method: str, algo: str) -> None:
    spec = SpecConfig(method=method, depth=5, topk=4, budget=8, head_path="org/head")
    args = sglang_args("org/target", spec, tp=4, quantization="fp8", kv_cache_dtype="fp8", port=8000)
    assert _opt(args, "--model-path") == "org/target"
    assert _opt(args, "--tp-size") == "4"
    assert _opt(args, "--quantization") == "fp8"
    assert _opt(args, "--kv-cache-dtype") == "fp8_e4m3"
    assert _opt(args, "--speculative-algorithm") == algo
    assert _opt(args, "--speculative-draft-model-path") == "org/head"
    assert _opt(args, "--speculative-num-steps") == "5"
    assert _opt(args, "--speculative-eagle-topk") == "4"
    assert _opt(args, "--speculative-num-draft-tokens") == "8"


@pytest.mark.parametrize("match", ["bfs", "prob"])
def test_sglang_ngram_tree_golden(match: str) -> None:
    """SGLang's NGRAM (flag names as in python/sglang/srt/server_args.py): no draft model, no EAGLE flags."""
    spec = SpecConfig(method="ngram", depth=6, topk=4, budget=12, ngram_min=2, ngram_max=5, ngram_match=match)
    args = sglang_args("org/target", spec)
    assert args[args.index("--speculative-algorithm"):] == [
        "--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "12",
        "--speculative-ngram-max-bfs-breadth", "4", "--speculative-ngram-min-match-window-size", "2",
        "--speculative-ngram-max-match-window-size", "5", "--speculative-ngram-branch-length", "11",
        "--speculative-ngram-match-type", match.upper()]


def test_sglang_refuses_ngram_chains() -> None:
    with pytest.raises(UserError, match="spec.topk=1 with spec.method=ngram and engine=sglang: sglang runs ngram as a tree only"):
        sglang_args("t", SpecConfig(method="ngram", depth=3, budget=4))


@pytest.mark.parametrize("spec", [SpecConfig(method="off"),
                                  SpecConfig(method="eagle", depth=3, topk=1, budget=4, head_path="h")])
def test_sglang_always_enables_metrics(spec: SpecConfig) -> None:
    """SGLang serves /metrics only with --enable-metrics: tau (spec_accept_length) and the
    rendered ServiceMonitor/HPA (num_queue_reqs) need it, with or without speculation."""
    assert sglang_args("t", spec).count("--enable-metrics") == 1


def test_sglang_chain_draft_tokens_are_steps_plus_one() -> None:
    spec = SpecConfig(method="eagle", depth=3, topk=1, budget=4, head_path="h")
    args = sglang_args("t", spec)
    assert _opt(args, "--speculative-num-draft-tokens") == "4"
    assert _opt(args, "--speculative-eagle-topk") == "1"


def test_sglang_off_has_no_speculative_flags() -> None:
    args = sglang_args("t", SpecConfig(method="off"))
    assert not any(a.startswith("--speculative") for a in args)
    assert "--disable-cuda-graph" not in args and "--tp-size" not in args


def test_sglang_general_flags() -> None:
    args = sglang_args("t", SpecConfig(method="off"), dtype="bfloat16", context_length=4096, mem_fraction_static=0.85,
                       served_model_name="m", disable_cuda_graph=True, host="127.0.0.1", port=8100, extra_args=["--x"])
    assert (_opt(args, "--dtype"), _opt(args, "--context-length"), _opt(args, "--mem-fraction-static")) == (
        "bfloat16", "4096", "0.85")
    assert _opt(args, "--served-model-name") == "m" and _opt(args, "--port") == "8100"
    assert "--disable-cuda-graph" in args and args[-1] == "--x"


@pytest.mark.parametrize("method", ["suffix", "recycle", "draft_model", "medusa"])
def test_sglang_refuses_other_methods(method: str) -> None:
    spec = SpecConfig(method=method, depth=2, budget=3, draft_model="d", head_path="h")
    with pytest.raises(UserError, match=f"spec.method={method} cannot be served by SGLang"):
        sglang_args("t", spec)


# ---- built-in (`tuner serve` Hydra overrides) ----------------------------------------------

def test_builtin_args_round_trip_through_hydra() -> None:
    from tuner.schema.compose import load_config

    spec = SpecConfig(method="eagle", depth=3, topk=2, budget=6, head_path="/models/my head",
                      k_per_batch_size=[(1, 8, 2), (9, 64, 1)])
    args = builtin_args("tiny-random", spec, host="0.0.0.0", port=8000, weights="fp8")
    cfg = load_config(args)
    assert cfg.spec == spec
    assert cfg.model.name == "tiny-random"
    assert (cfg.serve.host, cfg.serve.port) == ("0.0.0.0", 8000)
    assert cfg.engine.builtin.weights == "fp8"


@pytest.mark.parametrize("method", ["off", "ngram", "suffix", "recycle", "draft_model"])
def test_builtin_args_each_method(method: str) -> None:
    spec = SpecConfig(method=method, depth=2, budget=3, draft_model="org/draft")
    args = builtin_args("smollm2-135m", spec)
    assert f"spec.method={method}" in args and "spec.depth=2" in args
    assert "spec.draft_model=org/draft" in args
