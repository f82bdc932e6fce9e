"""Draft heads on the lean layer (engine.drafters.lean_head): the same outputs as the head modules
(the training and checkpoint form) over a catch-up, a second catch-up after a prefix, and tree
levels with an ancestor mask, for EAGLE-1 and EAGLE-3 (with and without norm_before_residual); the
cache grows past its first capacity; a head with an o_proj bias falls back to its module."""

from __future__ import annotations

import pytest
import torch

from engine.models.cache import KVBuffer
from engine.drafters.lean_head import LeanHead, lean_head, supports
from engine.models.eagle_head import EagleHead, head_config, random_head
from engine.models.eagle3_head import init_eagle3
from engine.decode.loop import Engine
from tuner.study.measurer import open_engine
from tuner.schema.compose import load_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def engine() -> Engine:
    return open_engine(load_config(["model=tiny-random", "model.num_layers=4", "spec.method=off"]))


def _randomize(head: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            scale = 0.3 if name.endswith("norm.weight") else 0.05
            p.add_(torch.randn(p.shape, generator=g) * scale)


def _heads(engine: Engine) -> list[tuple[str, torch.nn.Module]]:
    e1 = random_head(engine.model.config, seed=1)
    _randomize(e1, 1)
    vocab = engine.model.config.vocab_size
    e3 = init_eagle3(engine.model, torch.arange(0, vocab, 7), (1, 2, 3), seed=2)
    _randomize(e3, 2)
    e3n = init_eagle3(engine.model, torch.arange(0, vocab, 5), (1, 2, 3), seed=3)
    e3n.norm_before_residual = True
    _randomize(e3n, 3)
    return [("eagle", e1), ("eagle3", e3), ("eagle3-nbr", e3n)]


def _steps(h: int, g: torch.Generator):
    """(embeds, feats, positions, mask) of: a 5-token catch-up (causal), a 3-token catch-up after it,
    then two tree levels (3 nodes, then 2 whose parents are nodes 0 and 2 of the first level)."""
    def rnd(n: int) -> torch.Tensor:
        return torch.randn(1, n, h, generator=g)

    out = [(rnd(5), rnd(5), torch.arange(5)[None], None)]
    m = torch.ones(3, 8, dtype=torch.bool).tril(5)[None, None]
    out.append((rnd(3), rnd(3), torch.arange(5, 8)[None], m))
    lvl1 = torch.ones(3, 11, dtype=torch.bool)
    lvl1[:, 8:] = torch.eye(3, dtype=torch.bool)
    out.append((rnd(3), rnd(3), torch.full((1, 3), 8), lvl1[None, None]))
    lvl2 = torch.zeros(2, 13, dtype=torch.bool)
    lvl2[:, :8] = True
    lvl2[0, 8], lvl2[1, 10] = True, True  # parents
    lvl2[0, 11], lvl2[1, 12] = True, True  # themselves
    out.append((rnd(2), rnd(2), torch.full((1, 2), 9), lvl2[None, None]))
    return out


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "eagle3-nbr"])
def test_lean_layer_equals_the_head_module(engine: Engine, kind: str) -> None:
    head = dict(_heads(engine))[kind].eval()
    h = engine.model.config.hidden_size
    steps = _steps(h, torch.Generator().manual_seed(0))
    ref_cache, want = KVBuffer(), []
    with torch.no_grad():
        for e, f, pos, mask in steps:
            out = head(e, f, pos, mask, ref_cache)
            want.append(out[0] if kind == "eagle" else out)
        lean = LeanHead(head)  # fuses the weights into views: the module must still give the same
        cache, got = lean.new_cache(), []
        cache.length = 0
        for e, f, pos, mask in steps:
            got.append(lean.step(cache, e[0], f[0], pos[0], None if mask is None else mask[0, 0])[None])
        again = head(*steps[0][:3], None, KVBuffer())
    for w, o in zip(want, got):  # fp32, other kernels and row blockings: 1.6e-5 apart on an AVX-512 Xeon
        torch.testing.assert_close(o, w, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(again[0] if kind == "eagle" else again, want[0], rtol=1e-5, atol=1e-6)
    assert cache.length == 13
    if kind != "eagle":
        feat = got[-1][0]
        torch.testing.assert_close(lean.logits(feat), head.logits(feat), rtol=1e-4, atol=1e-5)


def test_cache_grows_past_its_first_capacity(engine: Engine) -> None:
    head = random_head(engine.model.config, seed=4).eval()
    lean = LeanHead(head)
    h = engine.model.config.hidden_size
    g = torch.Generator().manual_seed(1)
    cache, ref = lean.new_cache(), KVBuffer()
    first = cache.capacity
    with torch.no_grad():
        for start in range(0, first + 40, 100):  # crosses the first capacity mid-step
            n = min(100, first + 40 - start)
            e, f = torch.randn(1, n, h, generator=g), torch.randn(1, n, h, generator=g)
            pos = torch.arange(start, start + n)[None]
            mask = None if start == 0 else torch.ones(n, start + n, dtype=torch.bool).tril(start)[None, None]
            want = head(e, f, pos, mask, ref)[0]
            got = lean.step(cache, e[0], f[0], pos[0], None if mask is None else mask[0, 0])
            torch.testing.assert_close(got, want[0], rtol=1e-4, atol=1e-5)
    assert cache.capacity > first and cache.length == first + 40


def test_a_head_with_an_output_bias_runs_its_module(engine: Engine) -> None:
    cfg = head_config(engine.model.config)
    cfg.attention_bias = True  # biases on q/k/v AND o_proj: the lean layer carries only the first
    head = EagleHead(cfg)
    assert not supports(head) and lean_head(head) is None
    plain = random_head(engine.model.config, seed=5)
    assert lean_head(plain) is lean_head(plain)  # built once per head module
