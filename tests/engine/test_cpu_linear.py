"""engine/models/kernels.py: oneDNN linears give nn.Linear's results, keep gradients working, and are
what the built-in engine's CPU fp32 target uses (with an off switch)."""

from __future__ import annotations

import pytest
import torch

from engine.models.kernels import OneDnnLinear, onednn_available, use_onednn_linears
from engine.models.target import load_target
from tuner.schema.compose import load_config

pytestmark = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN linear op")


@pytest.mark.parametrize("rows,out", [(1, 96), (1, 9000), (5, 96), (16, 9000)])
def test_same_results_as_nn_linear(rows: int, out: int) -> None:
    torch.manual_seed(0)
    ref = torch.nn.Linear(64, out)
    fast = torch.nn.Linear(64, out)
    fast.load_state_dict(ref.state_dict())
    assert use_onednn_linears(fast) == 1 and type(fast) is OneDnnLinear
    x = torch.randn(1, rows, 64)
    with torch.inference_mode():
        torch.testing.assert_close(fast(x), ref(x), rtol=1e-5, atol=1e-5)
        assert torch.equal(fast(x).argmax(-1), ref(x).argmax(-1))


def test_gradients_flow_through_a_switched_layer() -> None:
    # EAGLE training back-propagates through the frozen lm_head: the grad path must stay nn.Linear's.
    lin = torch.nn.Linear(8, 9000, bias=False)
    use_onednn_linears(lin)
    lin.requires_grad_(False)
    x = torch.randn(3, 8, requires_grad=True)
    lin(x).square().sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_the_engine_target_uses_them_unless_switched_off() -> None:
    on = load_config(["model=tiny-random"])
    off = load_config(["model=tiny-random", "engine.builtin.onednn_linears=false"])
    m_on = load_target(on.model, on.engine.builtin, on.cache_dir).model
    m_off = load_target(off.model, off.engine.builtin, off.cache_dir).model
    assert m_on is not m_off
    assert type(m_on.lm_head) is OneDnnLinear and type(m_off.lm_head) is torch.nn.Linear
    assert all(type(m) is not torch.nn.Linear for m in m_on.modules())
    ids = torch.randint(0, m_on.config.vocab_size, (1, 12))
    with torch.inference_mode():
        torch.testing.assert_close(m_on(ids).logits, m_off(ids).logits, rtol=1e-4, atol=1e-4)
