"""engine/models/decode_step.py, the native step: logits, hidden states, layer inputs and the KV cache it
writes equal the lean forward's torch path for a decode row, a chain, a branching tree, a pool slot
and the rows of several sequences in one call; the engine takes it by default and greedy output
stays identical; native_step=true refuses, in one line, where it cannot run."""

from __future__ import annotations

import random

import pytest
import torch

from engine.api import SamplingParams
from engine.models import decode_step
from engine.models.forward import LeanForward, lean_forward, native_calls, native_step_refusal
from engine.models.kvpool import KVPool
from engine.models.llama import LeanLlama
from engine.models.target import load_target
from engine.trees.tree import Tree
from tests.conftest import TINY
from tuner.schema.compose import load_config
from tuner.schema.config import SpecConfig, UserError
from tuner.study.measurer import open_engine

# fp32: another summation order, nothing else. bf16 / fp8: the linears' inputs are rounded to bf16 in
# both paths, and another summation order now and then moves an activation across a rounding boundary
# (2^-8 of it): on the tiny model's logits (up to ~8) that measured up to 1.6e-2 (bf16) and 3.0e-2 (fp8)
# after a 37-token prompt. A wrong layout, scale, column or k order is off by O(1).
ATOL = {"fp32": 1e-4, "bf16": 0.1, "fp8": 0.1}

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.skipif(decode_step.library() is None, reason=f"no C++ compiler: {decode_step.error()}")]


@pytest.fixture(scope="module", params=["fp32", "bf16", "fp8"])
def pair(request) -> tuple[LeanForward, LeanForward]:
    """(the torch lean forward, the native one) over one LeanLlama of the tiny random target, at each
    weight format: the torch path computes with the rounded values in fp32, the native step reads its
    packed copy in the format itself, so the two agree to fp32 rounding at every format."""
    cfg = load_config([*TINY, f"engine.builtin.weights={request.param}"])
    model = LeanLlama(load_target(cfg.model, cfg.engine.builtin).model)
    torch_fw, native_fw = LeanForward(model), LeanForward(model, native=True)
    assert torch_fw.native is None and native_fw.native is not None
    assert native_fw.native.fmt == {"fp32": 0, "bf16": 1, "fp8": 2}[request.param]
    return torch_fw, native_fw


def _tol(pair) -> float:
    return ATOL[pair[0].model.weights]


def _tree(rng: random.Random, n: int) -> Tree:
    parents, depths = [-1], [0]
    for i in range(1, n):
        p = rng.randrange(i)
        parents.append(p)
        depths.append(depths[p] + 1)
    return Tree([rng.randrange(49152) for _ in range(n)], parents, depths)


def _both(pair, caches, tokens, depths=None, ancestors=None, last_only=False, aux=None):
    return [fw.step(c, tokens, depths, ancestors, last_only, aux) for fw, c in zip(pair, caches)]


def test_rows_equal_torch_path_and_cache(pair) -> None:
    """One row, a chain, branching trees of 7 and 20 nodes (past 8 rows: further passes over each
    weight block) and 64 rows with only the last row's logits: every output and every cache entry
    within fp32 rounding of the torch path."""
    rng = random.Random(0)
    prompt = [rng.randrange(49152) for _ in range(37)]
    with torch.inference_mode():
        caches = [fw.new_cache(128) for fw in pair]
        _both(pair, caches, prompt)
        tree = _tree(rng, 7)
        assert not tree.is_chain
        big = _tree(rng, 20)
        cases = [([5], None, None, False), ([7, 8, 9, 10, 11], None, None, False),
                 (tree.tokens, tree.depths, tree.ancestors(), False), (big.tokens, big.depths, big.ancestors(), False),
                 ([rng.randrange(49152) for _ in range(64)], None, None, True)]
        for tokens, depths, anc, last in cases:
            (xa, la, aa), (xb, lb, ab) = _both(pair, caches, tokens, depths, anc, last, (0, 1))
            n = len(tokens)
            assert lb.shape == la.shape == (1 if last else n, 49152)
            assert torch.allclose(la, lb, atol=_tol(pair)) and torch.allclose(xa, xb, atol=_tol(pair)) and torch.allclose(aa, ab, atol=_tol(pair))
            ka, kb = caches[0].k[:, :, :caches[0].length], caches[1].k[:, :, :caches[1].length]
            assert caches[0].length == caches[1].length == len(prompt) + n
            assert torch.allclose(ka, kb, atol=_tol(pair))
            assert torch.allclose(caches[0].v[:, :, :caches[0].length], caches[1].v[:, :, :caches[1].length], atol=_tol(pair))
            for c in caches:
                c.crop(len(prompt))


def test_long_context_in_chunks_and_any_thread_count(pair) -> None:
    """After a context long enough that each kv head's attention splits into two chunks of positions
    (the rows just written in the last one), one row, a chain and a branching tree equal the torch
    path; and the step at 2 threads (the tiny model's 64-column linears then split by half blocks,
    the last eighth of the lm_head's blocks go to whichever thread asks first, the chunks go to
    either thread) is bit-identical to the step at 1, cache entries included: a lost chunk, a wrong
    merge, a half block computed twice or not at all, or a tail block left out (a counter shared by
    two linears) would differ."""
    rng = random.Random(4)
    prompt = [rng.randrange(49152) for _ in range(150)]
    tree = _tree(rng, 7)
    cases = [([5], None, None), ([7, 8, 9, 10, 11], None, None), (tree.tokens, tree.depths, tree.ancestors())]
    threads = torch.get_num_threads()
    with torch.inference_mode():
        caches = [fw.new_cache(192) for fw in pair]
        _both(pair, caches, prompt)
        for tokens, depths, anc in cases:
            (xa, la, _), (xb, lb, _) = _both(pair, caches, tokens, depths, anc)
            assert torch.allclose(la, lb, atol=_tol(pair)) and torch.allclose(xa, xb, atol=_tol(pair))
            k1 = caches[1].k[:, :, :caches[1].length].clone()
            caches[1].crop(len(prompt))
            caches[1].k[:, :, len(prompt):].zero_()
            torch.set_num_threads(2)
            try:
                x2, l2, _ = pair[1].step(caches[1], tokens, depths, anc)
            finally:
                torch.set_num_threads(threads)
            assert torch.equal(l2, lb) and torch.equal(x2, xb), len(tokens)
            assert torch.equal(caches[1].k[:, :, :caches[1].length], k1)
            for c in caches:
                c.crop(len(prompt))


def test_a_verified_chain_is_its_rows_in_any_steps(pair) -> None:
    """Speculation's exactness at the step: a 5-row chain after 126 positions (its rows straddle the
    attention's chunk boundary at 128) gives each row bit for bit the logits it gets in steps of 2 and
    3 rows and in steps of one row each, one decode step after another, at every format: the linears
    sum each row in one order at every row count, the attention's chunks sit at fixed positions. A
    lone row summed in another order (two chains of alternate k-rows) or chunks placed by the step's
    own rows would differ in the last bits, which at fp8 moved greedy n-gram output off AR's."""
    fw = pair[1]
    rng = random.Random(6)
    prompt = [rng.randrange(49152) for _ in range(126)]
    chain = [rng.randrange(49152) for _ in range(5)]
    with torch.inference_mode():
        cache = fw.new_cache(192)
        fw.step(cache, prompt)
        _, together, _ = fw.step(cache, chain)
        cache.crop(len(prompt))
        pieces = torch.cat([fw.step(cache, chain[:2])[1], fw.step(cache, chain[2:])[1]])
        cache.crop(len(prompt))
        alone = torch.cat([fw.step(cache, [t])[1] for t in chain])
    assert torch.equal(together, pieces)
    assert torch.equal(together, alone)


def test_native_calls_cut_prompts_and_keep_trees_whole() -> None:
    """How a step past a call's rows is spread: every row of every sequence once, in order; no call
    over its rows; a cut sequence's pieces in successive calls (a piece attends to the keys the one
    before it wrote), near-equal; sequences that fit share calls; a tree past a call's rows cannot
    be cut (None); a step that fits is one call."""
    assert native_calls([1, 5, 9], [True, True, False], 16) == [[(0, 0, 1), (1, 0, 5), (2, 0, 9)]]
    assert native_calls([1, 20], [True, False], 16) is None
    rows, cut = [3, 37, 2, 16, 1], [True, True, False, True, True]
    calls = native_calls(rows, cut, 16)
    assert all(sum(b - a for _, a, b in c) <= 16 for c in calls)
    assert all(len({i for i, _, _ in c}) == len(c) for c in calls)
    for i, n in enumerate(rows):
        where = [(k, a, b) for k, c in enumerate(calls) for j, a, b in c if j == i]
        assert [k for k, _, _ in where] == sorted({k for k, _, _ in where}), i  # one piece a call, in order
        assert where[0][1] == 0 and where[-1][2] == n and all(w[2] == x[1] for w, x in zip(where, where[1:])), i
    assert [b - a for j, a, b in (p for c in calls for p in c) if j == 1] == [12, 12, 13]
    assert calls[0] == [(0, 0, 3), (1, 0, 12)] and len(calls) == 5


def test_a_long_prompt_is_its_rows_in_any_steps(pair) -> None:
    """A prompt past a call's rows (native calls in pieces) writes bit for bit the keys and values,
    hidden states and last logits that the same prompt gets as all but its last token and then that
    token alone, which is what runs when the prefix cache holds the rest, and in steps of 50 rows;
    and it stays within rounding of the torch path. The torch path's other summation order for the
    long prompt (what ran before) made a greedy near-tie differ between a prompt's first pass and
    every later pass at bf16."""
    torch_fw, fw = pair
    rng = random.Random(8)
    prompt = [rng.randrange(49152) for _ in range(decode_step.MAX_ROWS + 41)]
    with torch.inference_mode():
        caches = [fw.new_cache(256) for _ in range(3)]
        x, logits, _ = fw.step(caches[0], prompt, last_only=True)
        head, _, _ = fw.step(caches[1], prompt[:-1], last_only=True)
        last, alone, _ = fw.step(caches[1], prompt[-1:])
        steps = [fw.step(caches[2], prompt[i:i + 50]) for i in range(0, len(prompt), 50)]
        ref = torch_fw.new_cache(256)
        xt, lt, _ = torch_fw.step(ref, prompt, last_only=True)
    assert torch.equal(logits, alone) and torch.equal(logits, steps[-1][1][-1:])
    assert torch.equal(x, torch.cat([head, last])) and torch.equal(x, torch.cat([h for h, _, _ in steps]))
    n = len(prompt)
    assert caches[0].length == caches[1].length == caches[2].length == n
    for c in caches[1:]:
        assert torch.equal(c.k[:, :, :n], caches[0].k[:, :, :n]) and torch.equal(c.v[:, :, :n], caches[0].v[:, :, :n])
    assert torch.allclose(logits, lt, atol=_tol(pair)) and torch.allclose(x, xt, atol=_tol(pair))


def test_a_row_beside_a_long_prompt_is_the_row_alone(pair) -> None:
    """Batch invariance past a call's rows: a decode row and a 3-row chain beside another request's
    prompt of more rows than a call takes (a prompt arriving while others decode) give bit for bit
    what they give alone, and the prompt what it gives alone (hidden states and layer inputs too).
    On the torch path, which such a step took before, every row of the step summed in its order."""
    _, fw = pair
    rng = random.Random(10)
    prompts = [[rng.randrange(49152) for _ in range(n)] for n in (21, 30)]
    long = [rng.randrange(49152) for _ in range(decode_step.MAX_ROWS + 7)]
    rows = [[rng.randrange(49152)], [rng.randrange(49152) for _ in range(3)]]
    with torch.inference_mode():
        pool = KVPool(fw.model, 3, 256)
        a, b, c = pool.acquire(256), pool.acquire(256), pool.acquire(256)
        fw.step(a, prompts[0])
        fw.step(b, prompts[1])
        alone = [fw.step_batch([s], [t], [None], [None], [False], (1,))[0] for s, t in zip((a, b), rows)]
        first = fw.step_batch([c], [long], [None], [None], [True], (1,))[0]
        for s, n in zip((a, b, c), (21, 30, 0)):
            s.crop(n)
        together = fw.step_batch([a, c, b], [rows[0], long, rows[1]], [None] * 3, [None] * 3, [False, True, False], (1,))
    for got, want in zip([together[0], together[2], together[1]], [*alone, first]):
        assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_batched_rows_equal_torch_path(pair) -> None:
    """Several sequences in pool slots, one native call: a decode row, a chain, a branching tree and
    a chain past 8 rows (further passes over each weight block), some wanting only their last row's
    logits, give the torch path's outputs and caches, sequence by sequence."""
    rng = random.Random(3)
    tree = _tree(rng, 6)
    tokens = [[rng.randrange(49152)], [rng.randrange(49152) for _ in range(5)], tree.tokens,
              [rng.randrange(49152) for _ in range(13)]]
    depths, ancestors = [None, None, tree.depths, None], [None, None, tree.ancestors(), None]
    last_only = [False, True, False, True]
    prompts = [[rng.randrange(49152) for _ in range(n)] for n in (17, 40, 9, 25)]
    outs, pools = [], []
    with torch.inference_mode():
        for fw in pair:
            pool = KVPool(fw.model, 4, 64)
            caches = [pool.acquire(64) for _ in prompts]
            for c, pr in zip(caches, prompts):
                fw.step(c, pr)
            outs.append(fw.step_batch(caches, tokens, depths, ancestors, last_only, (1,)))
            pools.append((pool, caches))
    for i, ((xa, la, aa), (xb, lb, ab)) in enumerate(zip(*outs)):
        assert la.shape == lb.shape == (1 if last_only[i] else len(tokens[i]), 49152), i
        assert torch.allclose(la, lb, atol=_tol(pair)) and torch.allclose(xa, xb, atol=_tol(pair)) and torch.allclose(aa, ab, atol=_tol(pair)), i
    (pa, ca), (pb, cb) = pools
    assert [c.length for c in ca] == [c.length for c in cb] == [len(p) + len(t) for p, t in zip(prompts, tokens)]
    for a, b in zip(ca, cb):
        assert torch.allclose(a.k[:, :, :a.length], b.k[:, :, :b.length], atol=_tol(pair))
        assert torch.allclose(a.v[:, :, :a.length], b.v[:, :, :b.length], atol=_tol(pair))


def test_tree_rows_see_only_their_ancestors(pair) -> None:
    """Each node's logits equal those of its root-to-node path run as a chain (a row that saw a
    sibling, or a later node, would differ)."""
    rng = random.Random(1)
    native = pair[1]
    prompt = [rng.randrange(49152) for _ in range(20)]
    tree = _tree(rng, 8)
    with torch.inference_mode():
        cache = native.new_cache(64)
        native.step(cache, prompt)
        _, logits, _ = native.step(cache, tree.tokens, tree.depths, tree.ancestors())
        for node in range(tree.size):
            path = [node]
            while tree.parents[path[-1]] >= 0:
                path.append(tree.parents[path[-1]])
            cache.crop(len(prompt))
            _, chain, _ = native.step(cache, [tree.tokens[i] for i in reversed(path)])
            assert torch.allclose(logits[node], chain[-1], atol=_tol(pair)), node


def test_pool_slot_writes_only_its_slot(pair) -> None:
    """A cache that is a view of one pool slot: the step equals a lone cache's and leaves the other
    slots' memory untouched."""
    torch_fw, native = pair
    rng = random.Random(2)
    prompt = [rng.randrange(49152) for _ in range(30)]
    with torch.inference_mode():
        pool = KVPool(native.model, 3, 64)
        pool.k.normal_()
        pool.v.normal_()
        others = pool.k[:, [0, 2]].clone(), pool.v[:, [0, 2]].clone()
        slot = pool.acquire(64)
        slot = pool.acquire(64) if slot.slot == 0 else slot
        pool.acquire(64)
        lone = torch_fw.new_cache(64)
        for fw, c in ((native, slot), (torch_fw, lone)):
            fw.step(c, prompt)
        (_, la, _), (_, lb, _) = [fw.step(c, [3, 4, 5]) for fw, c in ((torch_fw, lone), (native, slot))]
    assert slot.slot == 1 and torch.allclose(la, lb, atol=_tol(pair))
    assert torch.equal(pool.k[:, [0, 2]], others[0]) and torch.equal(pool.v[:, [0, 2]], others[1])


def test_engine_default_takes_it_and_greedy_is_identical() -> None:
    """native_step=auto (the default) runs decoding through the native step; greedy output, plain and
    with n-gram speculation (chains of up to 5 rows), equals native_step=false token for token."""
    on = open_engine(load_config(TINY))
    off = open_engine(load_config([*TINY, "engine.builtin.native_step=false"]))
    assert on.lean.native is not None and off.lean.native is None
    prompt = on.encode_prompt("a b c d a b c d a b c d a b", True)
    for spec in (SpecConfig(method="off"), SpecConfig(method="ngram", depth=4, topk=1, budget=5)):
        outs = []
        for eng in (on, off):
            eng.set_spec(spec)
            outs.append(eng.generate(prompt, SamplingParams(max_new_tokens=24)).tokens)
        assert outs[0] == outs[1] and len(outs[0]) == 24, spec


def test_native_step_true_refuses_in_one_line() -> None:
    """native_step=true where the step cannot run (bfloat16; a head size it is not built for) is a
    UserError naming the cause; auto then quietly keeps the torch path, false never asks."""
    bf = load_config([*TINY, "engine.builtin.dtype=bfloat16", "engine.builtin.native_step=true"])
    target = load_target(bf.model, bf.engine.builtin)
    with pytest.raises(UserError, match=r"native_step=true: it runs on CPU in float32 only .*bfloat16.*allowed: auto"):
        lean_forward(target, native=True)
    assert lean_forward(target, native="auto").native is None
    odd = load_config([*TINY, "model.hidden_size=96", "model.head_dim=24"])
    why = native_step_refusal(load_target(odd.model, odd.engine.builtin).model)
    assert why is not None and "head size 24" in why and "\n" not in why


def _kernel(vw: int, nb: int, extra: list[str], weights: str) -> object:
    """The few-row kernel built at `vw` lanes and `nb` blocks with `extra` flags (skips what this CPU
    or format cannot run)."""
    from engine.models import native, smallm

    if vw == 16 and not native.avx512():
        pytest.skip("16-lane vectors need AVX-512")
    if extra and weights == "fp32":
        pytest.skip("fp32 uses neither VBMI nor BF16")
    lib = native.Native("smallm", smallm._SOURCE, [f"-DVW={vw}", f"-DNB={nb}", *extra], smallm._bind).library()
    assert lib is not None
    return lib


@pytest.mark.parametrize("weights", ["fp32", "bf16", "fp8"])
@pytest.mark.parametrize("vw, nb, extra", [(8, 1, []), (16, 4, []), (16, 4, ["-mno-avx512vbmi"]),
                                           (16, 4, ["-mno-avx512bf16"])])
def test_few_row_block_every_row_count_and_layout(vw: int, nb: int, extra: list[str], weights: str) -> None:
    """The block both kernels share (engine.models.smallm.BLOCK_SOURCE), built for AVX2's layout (8
    lanes, one vector a block) and AVX-512's (16 lanes, four: bf16 and e4m3 multiplied as bf16 pairs
    by vdpbf16ps where the CPU has AVX-512 BF16, e4m3 widened through VBMI byte permutes, each feature
    also left out), at each weight format: 1-8 rows over an odd and an even K (k-pairs pad an odd K) equal
    F.linear over the weights the packed copy holds, the activations rounded to bf16 at bf16 and fp8.
    The fp8 weight spans e4m3's whole range (448 down to its subnormals, both signs), so a wrong
    exponent bias, a lost sign or subnormal, a missing scale, a wrong column or k order is visible;
    the activations are not bf16 values, so a kernel that skipped their rounding would be off by
    far more than the tolerance."""
    from engine.models import native, smallm
    from engine.models.fp8 import dequantize_e4m3, quantize_e4m3

    lib = _kernel(vw, nb, extra, weights)
    cpu = f" {native.cpu_id()} "
    bf16_dot = vw == 16 and " avx512_bf16 " in cpu and "-mno-avx512bf16" not in extra
    vbmi = vw == 16 and " avx512vbmi " in cpu and "-mno-avx512vbmi" not in extra
    want = {"fp32": 0, "bf16": 2 if bf16_dot or vw == 8 else 0,
            "fp8": 4 if vw == 8 else (3 if bf16_dot else 1) if vbmi else 0}[weights]
    assert smallm.layout(lib, weights) == want  # the layout follows the build
    g = torch.Generator().manual_seed(0)
    for k in (41, 40, 43):
        bw = vw * nb
        w = torch.randn(3 * bw - 5, k, generator=g) * torch.logspace(-4, 0, k)  # columns from 1e-4 to 1: subnormals in e4m3
        if weights == "fp8":
            w8, s = quantize_e4m3(w)
            assert (w8.float() != 0).logical_and(w8.float().abs() < 2 ** -6).any()
            w = dequantize_e4m3(w8, s)
        else:
            w = w.to(smallm.DTYPES[weights]).float()
        packed, scale = smallm.pack(w, weights, lib)
        assert packed.shape == (3, k + -k % smallm.k_group(want), bw)
        torch.testing.assert_close(smallm.unpack(packed, scale, w.shape[0], k, lib), w, rtol=1e-6, atol=0)
        for m in range(1, 9):
            x = torch.randn(m, k, generator=g)
            y = torch.empty(m, 3 * bw)
            assert lib.smallm_linear(x.data_ptr(), packed.data_ptr(), y.data_ptr(), m, 3 * bw, k,
                                     smallm.FORMATS[packed.dtype], scale, 2) == 0
            xr = x if weights == "fp32" else x.bfloat16().float()
            want_y = torch.nn.functional.linear(xr.double(), w.double()).float()
            torch.testing.assert_close(y[:, :w.shape[0]], want_y, rtol=1e-5, atol=1e-5, msg=f"{m} rows, K {k}")
            if weights != "fp32":  # the rounding matters at this tolerance
                assert not torch.allclose(torch.nn.functional.linear(x, w), want_y, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("weights, krows_flag, layout, ks", [("bf16", "-DBF16_KROWS", 2, (41, 576)),
                                                             ("fp8", "-DE4M3_KROWS", 4, (41, 42, 43, 576))])
def test_grouped_k_rows_at_8_lanes_are_the_k_row_kernel_bit_for_bit(weights: str, krows_flag: str, layout: int,
                                                                      ks: tuple[int, ...]) -> None:
    """At 8 lanes a bf16 block is packed in k-pairs (two k-rows widened from one load by a shift and a
    mask), an fp8 block in k-quads (four k-rows from one load by 16-bit shifts), and each column still
    sums k in order: every row count, at every K modulo the group (the pad left out), at 1 and 2
    threads, gives exactly the k-row kernel's results (BF16_KROWS, E4M3_KROWS), so the format's outputs
    did not move. A group's k-rows read in the wrong order, a lost last k-row, a lost sign or
    subnormal (the fp8 weight spans e4m3's range, both signs) would differ."""
    grouped, krows = _kernel(8, 1, [], weights), _kernel(8, 1, [krows_flag], weights)
    from engine.models import smallm
    from engine.models.fp8 import dequantize_e4m3, quantize_e4m3

    assert (smallm.layout(grouped, weights), smallm.layout(krows, weights)) == (layout, 0)
    g = torch.Generator().manual_seed(1)
    for k in ks:
        w = torch.randn(5 * 8 - 3, k, generator=g)
        if weights == "fp8":
            w8, s = quantize_e4m3(w * torch.logspace(-4, 0, k))
            assert (w8.float() != 0).logical_and(w8.float().abs() < 2 ** -6).any() and (w8.float() < 0).any()
            w = dequantize_e4m3(w8, s)
        else:
            w = w.bfloat16().float()
        a, b = smallm.pack(w, weights, grouped), smallm.pack(w, weights, krows)
        for m in range(1, 9):
            x = torch.randn(m, k, generator=g) * 4
            ys = []
            for lib, (packed, scale) in ((grouped, a), (krows, b)):
                for threads in (1, 2):
                    y = torch.empty(m, packed.shape[0] * 8)
                    assert lib.smallm_linear(x.data_ptr(), packed.data_ptr(), y.data_ptr(), m, y.shape[1], k,
                                             smallm.FORMATS[packed.dtype], scale, threads) == 0
                    ys.append(y[:, :w.shape[0]])
            assert all(torch.equal(y, ys[0]) for y in ys[1:]), f"{m} rows, K {k}"


@pytest.mark.parametrize("vw, nb", [(8, 1), (16, 4)])
def test_fp8_subnormals_survive_flush_denormal(vw: int, nb: int) -> None:
    """At 8 lanes an e4m3 subnormal is widened to an fp32 subnormal: with the thread's DAZ bit set
    (torch.set_flush_denormal) the kernel still reads it, so its rows equal those with DAZ off, and
    F.linear's (a kernel that left DAZ alone read those weights as zero and differed)."""
    from engine.models import smallm
    from engine.models.fp8 import dequantize_e4m3, quantize_e4m3

    lib = _kernel(vw, nb, [], "fp8")
    g = torch.Generator().manual_seed(4)
    k, n = 41, 2 * vw * nb
    w8, s = quantize_e4m3(torch.randn(n, k, generator=g) * torch.logspace(-5, 0, k))
    assert (w8.float() != 0).logical_and(w8.float().abs() < 2 ** -6).float().mean() > 0.1
    w = dequantize_e4m3(w8, s)
    packed, scale = smallm.pack(w, "fp8", lib)
    x = torch.randn(3, k, generator=g)
    ys = []
    try:
        for daz in (False, True):
            assert torch.set_flush_denormal(daz)
            ys.append(torch.empty(3, n))
            assert lib.smallm_linear(x.data_ptr(), packed.data_ptr(), ys[-1].data_ptr(), 3, n, k, 2, scale, 1) == 0
    finally:
        torch.set_flush_denormal(False)
    assert torch.equal(ys[0], ys[1])
    want = torch.nn.functional.linear(x.bfloat16().double(), w.double()).float()
    torch.testing.assert_close(ys[1], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("weights", ["bf16", "fp8"])
def test_pack_holds_the_rounded_weight(weights: str) -> None:
    """smallm.pack of a weight already rounded to the format (what the engine packs) is exact: unpacked
    it gives the same values (fp8: to fp32 rounding, the per-tensor scale derived again), with the
    padding columns of the last block zero (and the padding k-rows of a k-pair or k-quad layout), and the kernel reads
    it in its layout as F.linear reads the weight from activations rounded to bf16; kernels.linear
    rounds them the same way on every other form."""
    from engine.models import kernels, smallm
    from engine.models.fp8 import dequantize_e4m3, quantize_e4m3

    w = torch.randn(smallm.BW + 5, 37, generator=torch.Generator().manual_seed(1))
    w = dequantize_e4m3(*quantize_e4m3(w)) if weights == "fp8" else w.bfloat16().float()
    packed, scale = smallm.pack(w, weights)
    pad = -37 % smallm.k_group(smallm.layout(smallm.library(), weights))
    assert packed.dtype == smallm.DTYPES[weights] and packed.shape == (2, 37 + pad, smallm.BW)
    assert (scale != 1.0) == (weights == "fp8")
    torch.testing.assert_close(smallm.unpack(packed, scale, w.shape[0], 37), w, rtol=1e-6, atol=0)
    assert not smallm.unpack(packed, scale, 2 * smallm.BW)[w.shape[0]:].any()
    assert not smallm.unpack(packed, scale, 2 * smallm.BW)[:, 37:].any()
    x = torch.randn(3, 37, generator=torch.Generator().manual_seed(2))
    want = torch.nn.functional.linear(x.bfloat16().float(), w)
    torch.testing.assert_close(smallm.linear(x, packed, w.shape[0], None, scale), want, rtol=1e-5, atol=1e-5)
    plain = w.clone()
    assert kernels.pack_weights([plain], [weights]) and plain._bf16_inputs
    old = kernels.linear_plan()
    for form in ("onednn", "mkl", "wxt", "smallm"):
        kernels.set_linear_plan(kernels.LinearPlan(eager=((3, form),)))
        try:
            torch.testing.assert_close(kernels.linear(x, plain), want, rtol=1e-5, atol=1e-5, msg=form)
        finally:
            kernels.set_linear_plan(old)


def test_a_row_is_the_same_in_any_step(pair) -> None:
    """Batch invariance at every format: a sequence's decode row and its 2-row chain, alone (one pass
    over each weight block) and beside another sequence's 12-row chain (13 and 14 rows: two passes),
    give bit-identical logits and hidden states."""
    _, fw = pair
    rng = random.Random(5)
    prompts = [[rng.randrange(49152) for _ in range(n)] for n in (21, 30)]
    chain = [rng.randrange(49152) for _ in range(12)]
    for tok in ([rng.randrange(49152) for _ in range(2)], [rng.randrange(49152)]):
        with torch.inference_mode():
            pool = KVPool(fw.model, 2, 64)
            a, b = pool.acquire(64), pool.acquire(64)
            fw.step(a, prompts[0])
            fw.step(b, prompts[1])
            (h1, l1, _), = fw.step_batch([a], [tok], [None], [None], [False])
            a.crop(len(prompts[0]))
            (h2, l2, _), _ = fw.step_batch([a, b], [tok, chain], [None, None], [None, None], [False, True])
        assert torch.equal(l1, l2) and torch.equal(h1, h2), f"{len(tok)} rows"


@pytest.mark.parametrize("weights", ["fp32", "bf16", "fp8"])
@pytest.mark.parametrize("vw, nb, extra", [(8, 1, []), (16, 4, []), (16, 4, ["-mno-avx512vbmi"]),
                                           (16, 4, ["-mno-avx512bf16"])])
def test_a_row_alone_is_the_row_among_others(vw: int, nb: int, extra: list[str], weights: str) -> None:
    """Batch invariance of the block both kernels share, at AVX2's layout (8 lanes) and AVX-512's, at
    each format: each of k rows (k = 1..8, one pass) is bit-identical to the same row computed alone,
    at 1 and 2 threads, over an odd and an even K. 11 blocks make the side-by-side blocks of 1-6 rows
    (block_g) end in a shorter group, and at 2 threads split a 4-vector block into halves and leave
    1 block to whichever thread asks first (blocks_share's tail). A lone
    row summed in another order than the rows of a chain (two chains of alternate k-rows, another
    contraction) differs in the last bits."""
    from engine.models import native, smallm

    lib = _kernel(vw, nb, extra, weights)
    g = torch.Generator().manual_seed(7)
    n = 11 * vw * nb
    fmt = smallm.FORMATS[smallm.DTYPES[weights]]
    for k in (41, 40):
        w = torch.randn(n - 3, k, generator=g)
        if weights == "fp8":
            from engine.models.fp8 import dequantize_e4m3, quantize_e4m3

            w = dequantize_e4m3(*quantize_e4m3(w))
        else:
            w = w.to(smallm.DTYPES[weights]).float()
        packed, scale = smallm.pack(w, weights, lib)
        x = torch.randn(8, k, generator=g)
        first = None
        for threads in (1, 2):
            alone = torch.empty(8, n)
            for i in range(8):
                assert lib.smallm_linear(x[i].data_ptr(), packed.data_ptr(), alone[i].data_ptr(), 1, n, k, fmt, scale,
                                         threads) == 0
            for m in range(2, 9):
                y = torch.empty(m, n)
                assert lib.smallm_linear(x.data_ptr(), packed.data_ptr(), y.data_ptr(), m, n, k, fmt, scale,
                                         threads) == 0
                assert torch.equal(y, alone[:m]), f"{m} rows, K {k}, {threads} threads"
            first = alone if first is None else first
            assert torch.equal(alone, first), f"K {k}: 2 threads against 1"


@pytest.fixture
def eight_lanes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The process's few-row kernel and native step at AVX2's layout (8 lanes, one vector a block) for
    the test that takes it: on an AVX-512 machine they are built so (the engine's targets then packed
    for them: a fresh target cache), so CI on any machine kind runs the AVX2 step; elsewhere they are
    the process's own."""
    from engine.models import native, smallm, target

    if not native.avx512():
        return
    few = native.Native("smallm", smallm._SOURCE, ["-DVW=8", "-DNB=1"], smallm._bind)
    step = native.Native("decode_step", decode_step._SOURCE, ["-DVW=8", "-DNB=1"], decode_step._bind)
    for name, value in (("VW", 8), ("NB", 1), ("BW", 8), ("_NATIVE", few), ("TAG", few.tag)):
        monkeypatch.setattr(smallm, name, value)
    monkeypatch.setattr(decode_step, "_NATIVE", step)
    monkeypatch.setattr(decode_step, "TAG", step.tag)
    monkeypatch.setattr(target, "_TARGETS", {})


@pytest.mark.parametrize("weights", ["fp32", "bf16", "fp8"])
def test_greedy_speculation_is_its_precisions_ar_at_8_lanes(eight_lanes, weights: str) -> None:
    """End to end at AVX2's layout (forced on an AVX-512 machine), at each format: greedy output with
    n-gram chains (up to 5 rows a step) and with one-row drafts equals the engine's own AR output at
    that format, token for token (the steps' rows are bit-identical to decode rows: the tests above)."""
    from engine.models import smallm

    eng = open_engine(load_config([*TINY, f"engine.builtin.weights={weights}"]))
    assert eng.lean.native is not None and eng.lean.native.fmt == smallm.FORMATS[smallm.DTYPES[weights]]
    assert eng.lean.model.blocks[0].wo._smallm_packed.shape[-1] == 8
    rng = random.Random(9)
    prompts = [eng.encode_prompt("a b c d a b c d a b c d a b", True),
               [rng.randrange(49152) for _ in range(3)] * 6]
    for prompt in prompts:
        outs = []
        for spec in (SpecConfig(method="off"), SpecConfig(method="ngram", depth=4, topk=1, budget=5),
                     SpecConfig(method="ngram", depth=1, topk=1, budget=2)):
            eng.set_spec(spec)
            outs.append(eng.generate(prompt, SamplingParams(max_new_tokens=32)).tokens)
        assert outs[0] == outs[1] == outs[2] and len(outs[0]) == 32


def _lane_forward(request, lanes: int, weights: str) -> LeanForward:
    """A native LeanForward over the tiny target at `lanes` (8: AVX2's layout, forced on AVX-512)."""
    from engine.models import native, smallm

    if lanes == 16 and not native.avx512():
        pytest.skip("16 lanes need AVX-512F")
    if lanes == 8:
        request.getfixturevalue("eight_lanes")
    cfg = load_config([*TINY, f"engine.builtin.weights={weights}"])
    fw = LeanForward(LeanLlama(load_target(cfg.model, cfg.engine.builtin).model), native=True)
    assert fw.native is not None and fw.model.blocks[0].wo._smallm_packed.shape[-1] == smallm.BW
    assert smallm.VW == lanes
    return fw


@pytest.mark.parametrize("weights", ["fp32", "bf16", "fp8"])
@pytest.mark.parametrize("lanes", [16, 8])
def test_greedy_steps_in_one_call_are_the_steps_one_by_one(request, lanes: int, weights: str) -> None:
    """LeanForward.greedy (decode_greedy: k one-row steps in one C++ call, each step's argmax the next
    token): after a 40-token prompt, 12 steps give the tokens that 12 `step` calls and argmax_rows
    give, and the same cache entries; with a stop token it ends right after that token's first
    occurrence; and where every column block of the lm_head is the same (logits equal in every
    block) it picks the first of equal logits, as argmax_rows does. A step at another position, a
    token fed twice, the last of equal logits or a stop token passed over would differ."""
    import ctypes

    from engine.trees.verify import argmax_rows

    fw = _lane_forward(request, lanes, weights)
    rng = random.Random(12)
    prompt = [rng.randrange(49152) for _ in range(40)]
    with torch.inference_mode():
        for tie in (False, True):
            if tie:  # a copy of the packed lm_head with every block the first one
                st = fw.native
                st.lm = st.lm.clone()
                st.lm[:] = st.lm[0]
                st._head = (st._head[0], st._head[1], ctypes.c_void_p(st.lm.data_ptr()), *st._head[3:])
            one, run, stopped = fw.new_cache(64), fw.new_cache(64), fw.new_cache(64)
            first = argmax_rows(fw.step(one, prompt, last_only=True)[1])[0]
            fw.step(run, prompt, last_only=True)
            fw.step(stopped, prompt, last_only=True)
            want, tok = [], first
            for _ in range(12):
                tok = argmax_rows(fw.step(one, [tok])[1])[0]
                want.append(tok)
            assert fw.greedy(run, first, 12, ()) == want, tie
            assert run.length == one.length == 52
            assert torch.equal(run.k[:, :, :52], one.k[:, :, :52]) and torch.equal(run.v[:, :, :52], one.v[:, :, :52])
            if tie:
                from engine.models import smallm

                assert all(t < smallm.BW for t in want)
                continue
            at = next(i for i in range(3, 12) if want[i] not in want[:i])
            assert fw.greedy(stopped, first, 12, (49151, want[at])) == want[:at + 1]
            assert stopped.length == 40 + at + 1


@pytest.mark.parametrize("weights", ["fp32", "fp8"])
@pytest.mark.parametrize("lanes", [16, 8])
def test_the_greedy_steps_argmax_over_the_threads_slices_is_numpys(request, lanes: int, weights: str) -> None:
    """decode_greedy takes each step's argmax inside the step's region, every thread over its slice of
    the logits, the slices' winners merged in order: at 1, 2 and 3 threads it is numpy's argmax of the
    step's logits (argmax_rows). With a zero lm_head (every logit equal: in every lane, slice and
    slice tail; 5 threads' slices end off whole vectors) the first; where two blocks past the middle
    give NaN (slices after the first), the first NaN. The last of equal logits in a lane, among lanes,
    in a slice's tail or among slices, or a larger number taken over an earlier NaN, would differ."""
    import ctypes

    from engine.models import smallm
    from engine.trees.verify import argmax_rows

    fw = _lane_forward(request, lanes, weights)
    st = fw.native
    lm0 = st.lm
    rng = random.Random(40)
    prompt = [rng.randrange(49152) for _ in range(20)]
    blocks = lm0.shape[0]
    nan_blocks = (blocks * 11 // 20, blocks * 9 // 10)  # in the second of 2 slices, the 3rd and 5th of 5
    threads = torch.get_num_threads()
    with torch.inference_mode():
        for case in ("tie", "nan"):
            lm = lm0.clone()
            if case == "tie":
                lm.zero_()
            else:
                lm[list(nan_blocks)] = float("nan")
            st.lm = lm
            st._head = (st._head[0], st._head[1], ctypes.c_void_p(lm.data_ptr()), *st._head[3:])
            for n in (1, 2, 5):
                torch.set_num_threads(n)
                try:
                    one, run = fw.new_cache(32), fw.new_cache(32)
                    first = argmax_rows(fw.step(one, prompt, last_only=True)[1])[0]
                    fw.step(run, prompt, last_only=True)
                    want, tok = [], first
                    for _ in range(4):
                        tok = argmax_rows(fw.step(one, [tok])[1])[0]
                        want.append(tok)
                    got = fw.greedy(run, first, 4, ())
                finally:
                    torch.set_num_threads(threads)
                assert got == want, (case, n)
                if case == "tie":
                    assert want == [0] * 4
                else:
                    assert want == [nan_blocks[0] * smallm.BW] * 4


def test_a_lone_greedy_request_runs_its_steps_in_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode driver runs a lone greedy request's decode steps GREEDY_RUN at a time in one native
    call (LeanForward.greedy) and commits what as many steps commit: against runs of one step, the
    same tokens, finish reason and forward count, at an end-of-sequence token mid-run (stop), with
    min_tokens past it (kept as text) and at max_new_tokens (29: runs of 8, 8, 8 and 4, never past
    it); a sampled request and a drafting one never take it. A run not bounded by max_new_tokens,
    forwards not counted, or the stop token passed over, would differ."""
    from engine.decode import batch

    eng = open_engine(load_config(TINY))
    runs: list[int] = []
    real = eng.forward.greedy

    def counted(cache, token, k, stops):
        out = real(cache, token, k, stops)
        runs.append(len(out))
        return out

    monkeypatch.setattr(eng.forward, "greedy", counted)
    prompt = eng.encode_prompt("a b c d a b c d", True)
    plain = eng.generate(prompt, SamplingParams(max_new_tokens=29))
    stop = plain.tokens[next(i for i in range(6, 29) if plain.tokens[i] not in plain.tokens[:i])]
    assert len(plain.tokens) == 29 and runs == [8, 8, 8, 4] and batch.GREEDY_RUN == 8

    full = batch.GREEDY_RUN

    def both(params: SamplingParams):
        got = []
        for run in (full, 1):
            monkeypatch.setattr(batch, "GREEDY_RUN", run)
            runs.clear()
            res = eng.generate(prompt, params)
            got.append((res.tokens, res.finish_reason, res.stats.target_forwards, list(runs)))
        assert got[0][:3] == got[1][:3] and got[1][3] == [], params
        return got[0]

    assert both(SamplingParams(max_new_tokens=29))[:3] == (plain.tokens, "length", 29)
    monkeypatch.setattr(eng, "eos", {stop})
    tokens, reason, forwards, used = both(SamplingParams(max_new_tokens=29))
    assert reason == "stop" and tokens == plain.tokens[:plain.tokens.index(stop)] and used
    at = len(tokens)
    tokens, reason, _, _ = both(SamplingParams(max_new_tokens=29, min_tokens=at + 3))
    assert tokens[at] == stop and len(tokens) > at + 1
    runs.clear()
    eng.generate(prompt, SamplingParams(max_new_tokens=12, temperature=0.8, seed=1))
    eng.set_spec(SpecConfig(method="ngram", depth=4, topk=1, budget=5))
    eng.generate(prompt, SamplingParams(max_new_tokens=12))
    assert runs == []


def test_every_linears_tail_is_computed_at_8_lanes(eight_lanes) -> None:
    """At AVX2's layout the tiny model's linears are 8 or more blocks each, so each one's last eighth
    goes to whichever thread asks first (blocks_share's tail, one counter per linear): a decode row,
    a chain and a prompt at 2 threads are bit-identical to the same steps at 1. A counter shared by
    two linears (the second's tail then left out) or a tail block dropped would differ."""
    eng = open_engine(load_config([*TINY, "engine.builtin.weights=fp32"]))
    fw = eng.forward
    assert fw.native is not None and eng.lean.model.blocks[0].w2._smallm_packed.shape[0] >= 8
    rng = random.Random(5)
    prompt = [rng.randrange(49152) for _ in range(40)]
    threads = torch.get_num_threads()
    got = []
    with torch.inference_mode():
        for n in (1, 2):
            torch.set_num_threads(n)
            try:
                cache = fw.new_cache(64)
                outs = [fw.step(cache, prompt)] + [fw.step(cache, t) for t in ([5], [7, 8, 9])]
            finally:
                torch.set_num_threads(threads)
            got.append([(x.clone(), logits.clone()) for x, logits, _ in outs])
    for (x1, l1), (x2, l2) in zip(*got):
        assert torch.equal(x1, x2) and torch.equal(l1, l2)
