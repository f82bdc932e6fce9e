"""The CPU decode attention kernel (engine/models/attention.py) against SDPA over the same pool: one-row
decodes, causal chains and branching trees of different lengths in one call, each over exactly its
own positions; rows outside the call untouched; any thread count."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.models import attention, native

pytestmark = pytest.mark.skipif(attention.library() is None, reason=f"no C++ compiler: {attention.error()}")

TREE = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 0, 1, 1, 0], [1, 1, 0, 0, 1]],
                    dtype=torch.bool)


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot: int, n: int, length: int,
               visible: torch.Tensor | None) -> torch.Tensor:
    """SDPA of one sequence's query rows q [n, H, d] over slot `slot` of k/v [slots, K, C, d]."""
    p = length - n
    mask = torch.zeros(n, length, dtype=torch.bool)
    mask[:, :p] = True
    mask[:, p:] = torch.ones(n, n, dtype=torch.bool).tril() if visible is None else visible
    return F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[slot][None, :, :length], v[slot][None, :, :length],
                                          attn_mask=mask, enable_gqa=True)[0].transpose(0, 1)


_BUILT: dict[int, native.Native] = {}


def _vector_width(vw: int) -> native.Native:
    """The kernel built for `vw` lanes (AVX2 machines build 8, AVX-512 ones 16): both variants are
    checked wherever the CPU runs them."""
    if vw == 16 and not native.avx512():
        pytest.skip("16-lane vectors need AVX-512")
    if vw not in _BUILT:
        _BUILT[vw] = native.Native("attention", attention._SOURCE, [f"-DVW={vw}"], attention._bind)
        assert _BUILT[vw].library() is not None, _BUILT[vw].error
    return _BUILT[vw]


@pytest.mark.parametrize("vw", [8, 16])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("head_dim", [16, 64])
def test_every_sequence_attends_over_exactly_its_own_positions(head_dim: int, threads: int, vw: int,
                                                               monkeypatch) -> None:
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    monkeypatch.setattr(attention, "_NATIVE", _vector_width(vw))
    torch.manual_seed(0)
    slots, n_kv, g, cap = 6, 3, 3, 96
    heads = n_kv * g
    k, v = torch.randn(slots, n_kv, cap, head_dim), torch.randn(slots, n_kv, cap, head_dim)
    # (slot, rows, length, visible): a decode row, a tree, a chain, a long decode, a row at position 0, a
    # two-row chain; with 3 heads a kv head their 3, 15, 9, 6 query rows end the weighted sums' blocks
    # of 4 with each of the remainders 3, 1 and 2
    seqs = [(4, 1, 37, None), (0, 5, 61, TREE), (2, 3, 9, None), (5, 1, 90, None), (1, 1, 1, None), (3, 2, 20, None)]
    rows = 2 + sum(n for _, n, _, _ in seqs)  # two rows of the step (a prompt's, say) stay out of the call
    qkv = torch.randn(rows, heads + 2 * n_kv, head_dim)  # q a strided view of the step's fused q/k/v rows
    q = qkv[:, :heads]
    o = torch.full((rows, heads, head_dim), 7.0)
    spec, at = [], 2
    for slot, n, length, visible in seqs:
        spec.append((slot, at, n, length, visible))
        at += n
    garbage = k.clone()
    k[:, :, 91:] = float("nan")  # positions past every length: reading them would poison the output
    v[:, :, 91:] = float("nan")
    attention.attend(q, k, v, o, attention.DecodeBatch.of(spec))
    for slot, start, n, length, visible in spec:
        torch.testing.assert_close(o[start:start + n], _reference(q[start:start + n], k, v, slot, n, length, visible),
                                   rtol=1e-5, atol=2e-6)
    assert torch.equal(o[:2], torch.full((2, heads, head_dim), 7.0))
    assert torch.equal(k[:, :, :91], garbage[:, :, :91])  # reads only


def test_a_tree_row_sees_only_its_ancestors() -> None:
    """Changing the value of a node a row does not see leaves that row's output alone."""
    torch.manual_seed(1)
    k, v = torch.randn(1, 1, 32, 16), torch.randn(1, 1, 32, 16)
    q = torch.randn(5, 2, 16)
    batch = attention.DecodeBatch.of([(0, 0, 5, 20, TREE)])
    before, after = torch.empty(5, 2, 16), torch.empty(5, 2, 16)
    attention.attend(q, k, v, before, batch)
    v[0, 0, 15 + 3] += 10.0  # node 3: seen by itself only
    attention.attend(q, k, v, after, batch)
    changed = [bool((after[r] != before[r]).any()) for r in range(5)]
    assert changed == [False, False, False, True, False]


def test_a_head_size_it_was_not_built_for_is_refused() -> None:
    k = torch.zeros(1, 1, 16, 24)
    with pytest.raises(ValueError, match="head size 24"):
        attention.attend(torch.zeros(1, 1, 24), k, k, torch.zeros(1, 1, 24), attention.DecodeBatch.of([(0, 0, 1, 4, None)]))
    assert not attention.usable(torch.device("cpu"), torch.float32, 24)
    assert not attention.usable(torch.device("cpu"), torch.bfloat16, 64)
