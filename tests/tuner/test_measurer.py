"""tuner.study.measurer.Measurer over the built-in engine (tiny random model): a level of N plays at
least N requests; every suffix run starts from one cache state, so a later trial never wins by a
cache earlier trials warmed, and held-out runs meet a cache that saw the tuning prompts only. Over a
launched server (the fake vLLM) every suffix pass runs on a server that served no pass before."""

from __future__ import annotations

import json

import pytest

from engine.drafters.suffix import clear_caches
from engine.measure.workloads import Prompt
from helpers import engine_for, fake_engine_exe, free_port
from tuner.schema.compose import load_config
from tuner.schema.config import SpecConfig, UserError
from tuner.study.measurer import Measurer, engine_target_for, make_measure, open_launcher

pytestmark = pytest.mark.usefixtures("one_torch_thread")
SUFFIX = SpecConfig(method="suffix", depth=4, topk=1, budget=5, suffix_min_prob=0.0, suffix_spec_factor=2.0)


@pytest.fixture(scope="module")
def setup():
    cfg = load_config(["model=tiny-random", "+workload=code", "workload.max_new_tokens=16", "spec.method=off"])
    engine = engine_for(cfg)
    prompts = {"tune": [Prompt("t0", "def fib(n):", "x"), Prompt("t1", "a b c d a b", "x")],
               "heldout": [Prompt("h0", "def fib(n):", "x")]}
    return cfg, engine, prompts


def test_every_suffix_run_starts_from_the_same_cache(setup) -> None:
    cfg, engine, prompts = setup
    clear_caches(engine.target)
    m = make_measure(engine, cfg, prompts)
    first, second = m(SUFFIX, "tune", 1), m(SUFFIX, "tune", 1)
    assert first.tau == second.tau
    # the held-out prompt repeats a tuning prompt: its cache holds the tuning responses, so it drafts
    assert m(SUFFIX, "heldout", 1).tau > 1.0
    # the control: without the restore the second run meets its own first run in the cache
    clear_caches(engine.target)
    bare = Measurer(engine_target_for(engine, cfg.workload.chat_template), cfg, prompts)
    a, b = bare(SUFFIX, "tune", 1), bare(SUFFIX, "tune", 1)
    assert b.tau > a.tau


def test_a_level_plays_at_least_that_many_requests(setup) -> None:
    cfg, engine, prompts = setup
    m = make_measure(engine, cfg, prompts)
    played = []
    real = m.target_for

    def spy(spec):
        t = real(spec)
        run = t.run
        t.run = lambda ps, params, c: played.append(len(ps)) or run(ps, params, c)
        return t

    m.target_for = spy
    m(SpecConfig(method="off"), "tune", 4)
    assert played == [2, 4]  # the untimed pass that caches the 2 prompts' prefill, then the level's 4 requests


def test_the_first_timed_pass_copies_every_prompts_prefill(setup) -> None:
    """The prefix cache holds each prompt of a split before its first timed pass (Measurer._warm_prefix),
    so the first pass does not run prefills that every later pass copies."""
    cfg, engine, prompts = setup
    m = make_measure(engine, cfg, prompts)
    pc = engine.prefix_cache
    real = m.target_for
    hits: list[tuple[int, int]] = []

    def spy(spec):
        t = real(spec)
        run = t.run

        def timed(ps, params, c, **kw):
            q0, h0 = pc.queries, pc.hits
            out = run(ps, params, c, **kw)
            hits.append((pc.queries - q0, pc.hits - h0))
            return out

        t.run = timed
        return t

    m.target_for = spy
    pc.entries.clear()
    m(SpecConfig(method="ngram", depth=2, topk=1, budget=3), "heldout", 1)
    (warm_q, warm_h), (q, h) = hits
    assert warm_h == 0 and q > 0 and h == q - len(prompts["heldout"])  # all but each prompt's last token copied


def test_a_level_above_max_batch_is_allowed_with_a_line_saying_requests_queue() -> None:
    from tuner.study.measurer import queue_note

    cfg = load_config(["model=tiny-random", "+workload=code", "workload.concurrency=[1,4,16]", "engine.builtin.max_batch=4"])
    note = queue_note(cfg)
    assert note is not None and "[16]" in note and "max_batch=4" in note and "queue" in note
    assert queue_note(load_config(["model=tiny-random", "+workload=code", "workload.concurrency=[1,4]"])) is None


# ---- a launched engine: what tuner.study.measurer.open_launcher assembles from the config

def _opt(argv: list[str], flag: str) -> str:
    assert argv.count(flag) == 1, f"{flag} must appear once in {argv}"
    return argv[argv.index(flag) + 1]


def test_open_launcher_on_gpus_uses_the_hub_id_and_the_deployments_tp_context_and_fp8_flags(tmp_path) -> None:
    from tuner.schema.fit import max_model_len, tensor_parallel_size

    exe = fake_engine_exe(tmp_path, "vllm")
    cfg = load_config(["engine=vllm", "deploy=vllm", "model=llama-3.3-70b-instruct", "hardware=h100x8",
                       f"engine.vllm.executable={exe}"])
    launcher = open_launcher(cfg, log_dir=tmp_path)
    argv = launcher.command(SpecConfig(method="eagle3", depth=3, budget=4, head_path="/h"))
    assert argv[2] == cfg.model.hf_id and launcher.model == cfg.model.name
    assert _opt(argv, "--quantization") == "fp8" and _opt(argv, "--kv-cache-dtype") == "fp8"
    # the fit check's TP (a 70B model needs more than one H100) and the deployed context, not engine.vllm's
    tp = tensor_parallel_size(cfg.model, cfg.hardware, cfg.deploy)
    assert tp > 1 and _opt(argv, "--tensor-parallel-size") == str(tp)
    assert _opt(argv, "--max-model-len") == str(max_model_len(cfg.model, cfg.hardware, cfg.deploy, tp)) != "2048"
    assert launcher.base_url == f"http://127.0.0.1:{cfg.engine.vllm.port}"


def test_open_launcher_on_cpu_serves_the_local_checkpoint(tmp_path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    cfg = load_config(["engine=vllm", f"model.local_path={ckpt}", f"engine.vllm.executable={fake_engine_exe(tmp_path, 'vllm')}"])
    launcher = open_launcher(cfg, log_dir=tmp_path)
    argv = launcher.command(SpecConfig(method="off"))
    assert argv[2] == str(ckpt) and "--quantization" not in argv
    assert launcher.env()["HF_HUB_OFFLINE"] == "1"


def test_open_launcher_refuses_the_builtin_engine() -> None:
    with pytest.raises(UserError, match="not a launched engine"):
        open_launcher(load_config([]))


def test_every_suffix_pass_on_a_launched_server_meets_an_empty_cache(tmp_path) -> None:
    # vLLM keeps its suffix cache in its process: a trial's second repeat, its second concurrency
    # level or the held-out pass would draft from the responses of the passes before it. Each
    # suffix pass therefore runs on a server that served nothing before (fake vLLM, two levels).
    import optuna

    from engine.launch.launcher import Launcher
    from tuner.schema.config import LaunchedEngineConfig
    from tuner.search.space import SearchSpace
    from tuner.study.measurer import make_launched_measure
    from tuner.study.objective import Objective

    cfg = load_config(["model=tiny-random", "+workload=code", "workload.concurrency=[1,2]", "workload.max_new_tokens=3",
                       "search=quick", "search.repeats_min=2", "search.repeats_max=2"])
    record, requests = tmp_path / "record.jsonl", tmp_path / "requests.jsonl"
    ecfg = LaunchedEngineConfig(executable=fake_engine_exe(tmp_path, "vllm"), port=free_port(), startup_timeout_s=20,
                                env={"FAKE_RECORD": str(record), "FAKE_REQUESTS": str(requests), "FAKE_STARTUP_S": "0",
                                     "FAKE_CHILD": "0", "FAKE_TOKEN_S": "0.001"})
    launcher = Launcher("vllm", ecfg, "/models/m", served_model_name="m", log_dir=tmp_path / "logs",
                        stop_timeout_s=3.0, poll_s=0.02)
    prompts = {"tune": [Prompt("t0", "def fib(n):", "x")], "heldout": [Prompt("h0", "def f(x):", "x")]}
    m = make_launched_measure(launcher, cfg, prompts)
    passes: list[tuple[int, str, int]] = []  # (server pid, method, requests played)
    real = m.target_for

    def spy(spec):
        t = real(spec)
        run = t.run
        t.run = lambda ps, params, c: passes.append((launcher.pid, spec.method, len(ps))) or run(ps, params, c)
        return t

    m.target_for = spy
    objective = Objective(optuna.create_study(), SearchSpace.from_config(cfg), m, cfg.workload, cfg.search)
    suffix = SUFFIX.model_copy(update={"suffix_max_requests": 100})
    with launcher:
        tune = objective.evaluate(suffix, "tune")
        heldout = objective.evaluate(suffix, "heldout", repeats_max=1)
    # tune: 4 suffix passes on 4 servers + 1 for the baseline (its 4 passes share one server: they
    # keep nothing); held-out: 2 suffix servers + the baseline's. Reusing servers would start 3 + 1.
    assert (tune["repeats"], tune["server_starts"], heldout["server_starts"], launcher.starts) == (2, 5, 3, 8)
    served = [p for p, method, _ in passes if method == "suffix"]
    assert len(served) == 6 and len(set(served)) == 6  # no suffix pass on a server that served one before
    by_pid: dict[int, int] = {}
    for line in requests.read_text().splitlines():
        pid = json.loads(line)["pid"]
        by_pid[pid] = by_pid.get(pid, 0) + 1
    for pid, method, n in passes:  # what each suffix server received is its one pass, nothing more
        if method == "suffix":
            assert by_pid[pid] == n
    assert all("suffix" in " ".join(json.loads(r)["argv"]) for r in record.read_text().splitlines()
               if json.loads(r)["pid"] in served)


def test_a_study_of_closed_loop_levels_times_the_step_cost_curve_to_its_largest_level(setup, tmp_path) -> None:
    """engine.builtin.max_batch 8 against concurrency [1, 2]: an adaptive trial timed the curve at batch
    sizes 4 and 8 that no pass reads (three quarters of its timing in the main command): within the
    study the engine's curve stops at 2, and leaving gives the engine back its own cap. Request rates
    and a capacity search queue up to max_batch: no cap."""
    from tuner.study.measurer import closed_loop_batch, study_measure

    cfg, engine, prompts = setup
    assert closed_loop_batch(load_config(["model=tiny-random", "+workload=code"])) == 2
    assert closed_loop_batch(load_config(["model=tiny-random", "+workload=code", "workload.concurrency=[4,1]"])) == 4
    assert closed_loop_batch(load_config(["model=tiny-random", "+workload=code", "workload.request_rate=[2.0]"])) is None
    study = load_config(["model=tiny-random", "+workload=code", "workload.max_new_tokens=16"])
    assert engine.batch_cap is None
    with study_measure(study, engine, prompts, tmp_path):
        assert engine.batch_cap == 2
    assert engine.batch_cap is None, "the engine's own again after the study"


def test_the_check_sides_answers_are_each_prompts_lone_answer_decoded_together(setup, tmp_path, monkeypatch) -> None:
    """check_proxies answers the candidate and held-out prompts in one closed loop of
    engine.builtin.max_batch clients, speculation off: each proxy is the one of that prompt's own
    greedy answer generated alone (prompt order kept though shorter answers finish first), the
    engine's spec is given back, a second call reads the cache, and a failed answer raises."""
    from engine.api import SamplingParams
    from engine.decode.batch import Request
    from engine.drafters.ngram import replayed_forwards
    from engine.measure.workloads import encode, params_of, sampling_params
    from tuner.projection.profiling import PROXY_DEPTHS, PromptProxy
    from tuner.study.measurer import check_proxies

    _, engine, _ = setup
    cfg = load_config(["model=tiny-random", "+workload=code", "workload.max_new_tokens=16", "spec.method=off",
                       "engine.builtin.max_batch=3", f"cache_dir={tmp_path}"])
    monkeypatch.setattr(engine, "max_batch", cfg.engine.builtin.max_batch)
    # answers of unlike lengths: a later prompt finishes before an earlier one
    prompts = [Prompt(f"p{i}", text, "x", params=SamplingParams(max_new_tokens=n))
               for i, (text, n) in enumerate([("def fib(n):", 14), ("a b c d a b", 3), ("import os", 9),
                                              ("x = [1, 2, 3]", 5), ("class A:", 12)])]
    ids = [encode(engine, p, cfg.workload.chat_template) for p in prompts]
    engine.set_spec(SpecConfig(method="off"))
    want = []
    for x, p in zip(ids, prompts):
        answer = list(engine.generate(x, params_of(p, sampling_params(cfg.workload, seed=cfg.seed))).tokens)
        want.append(PromptProxy(len(x), len(answer), tuple(replayed_forwards(x, answer, d) for d in PROXY_DEPTHS)))
    assert len({w.answer_tokens for w in want}) > 2
    chain = SpecConfig(method="ngram", depth=3, topk=1, budget=4)
    engine.set_spec(chain)
    together, real = [], engine.batcher

    def spy():
        b = real()
        loop = b.closed_loop
        b.closed_loop = lambda ps, params, concurrency: together.append(
            ([s.key() for _, _, s in b.schedule], concurrency)) or loop(ps, params, concurrency)
        return b

    monkeypatch.setattr(engine, "batcher", spy)
    monkeypatch.setattr(engine, "generate", lambda *a, **k: pytest.fail("answered one at a time"))
    assert check_proxies(cfg, engine, prompts) == want
    assert together == [([SpecConfig(method="off").key()], 3)] and engine.spec == chain
    monkeypatch.setattr(engine, "batcher", lambda: pytest.fail("answered again"))
    assert check_proxies(cfg, engine, prompts) == want  # from the cache

    class Failing:
        def closed_loop(self, ps, params, concurrency):
            return [Request(list(x), p, error="ValueError: planted", exception=ValueError("planted")) for x, p in
                    zip(ps, params)]

    monkeypatch.setattr(engine, "batcher", Failing)
    with pytest.raises(ValueError, match="planted"):
        check_proxies(cfg, engine, prompts[:2])
