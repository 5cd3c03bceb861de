"""Context parallelism's pieces on one process: the layout, the online softmax, the ring's message
plan against the byte formulas, the score-count formulas, one-rank equality with dense attention,
the saved-tensor ledger, and bad input. The C-rank runs are in test_context_parallel_mpi.py."""

import math
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refimpl.autograd.saved import saved_tensors
from refimpl.autograd.tensor import Tensor
from refimpl.nn import functional as F
from refimpl.parallel.comm import LocalComm
from refimpl.parallel.context_parallel import accounting, layout
from refimpl.parallel.context_parallel.blockwise import (
    EMPTY,
    Work,
    causal_attention,
    finish,
    forward_block,
    merge,
    pair_kind,
)
from refimpl.parallel.context_parallel.ring_attention import chunks_sent, needs_key_chunk, ring_attention
from refimpl.parallel.context_parallel.ulysses import ulysses_attention

RTOL, ATOL = 1e-10, 1e-12
LAYOUTS = st.sampled_from(layout.LAYOUTS)


# --- layout --------------------------------------------------------------------------------------
@given(C=st.integers(1, 6), m=st.integers(1, 4), lay=LAYOUTS)
def test_the_shards_partition_the_sequence_and_unshard_restores_it(C, m, lay):
    T = 2 * C * m
    x = np.arange(3 * T).reshape(3, T, 1) * 1.0  # (b, T, 1)
    shards = [layout.shard(x, C, r, axis=1, layout=lay) for r in range(C)]
    seen = np.sort(np.concatenate([layout.positions(T, C, r, lay) for r in range(C)]))
    assert (seen == np.arange(T)).all()  # every position on exactly one rank
    assert all(s.shape == (3, T // C, 1) for s in shards)
    assert (layout.unshard(shards, axis=1, layout=lay) == x).all()


def test_the_balanced_layout_pairs_an_early_chunk_with_a_late_one():
    assert [layout.rank_chunks(4, r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert [layout.rank_chunks(4, r, "contiguous") for r in range(4)] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert layout.positions(8, 2, 1).tolist() == [2, 3, 4, 5] and layout.positions(8, 2, 0).tolist() == [0, 1, 6, 7]


# --- the online softmax ----------------------------------------------------------------------------
@given(blocks=st.integers(1, 5), c=st.integers(1, 4), seed=st.integers(0, 2 ** 32 - 1), order=st.randoms())
def test_merging_blocks_in_any_order_equals_softmax_over_the_whole_row(blocks, c, seed, order):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(1, 1, 1, c, 3)) * 3
    k, v = rng.normal(size=(1, 1, 1, blocks * c, 3)), rng.normal(size=(1, 1, 1, blocks * c, 2))
    s = (q @ k.swapaxes(-1, -2))[0, 0, 0] / math.sqrt(3)  # (c, blocks·c) all scores, no mask
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    want = (p / p.sum(axis=-1, keepdims=True)) @ v[0, 0, 0]
    lse_want = s.max(axis=-1) + np.log(np.exp(s - s.max(axis=-1, keepdims=True)).sum(axis=-1))
    state = None
    indices = list(range(blocks))
    order.shuffle(indices)
    for j in indices:
        cols = slice(j * c, (j + 1) * c)
        state = merge(state, forward_block(q, k[..., cols, :], v[..., cols, :], "full", 1 / math.sqrt(3)))
    y, lse = finish(state)
    np.testing.assert_allclose(y[0, 0, 0], want, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(lse[0, 0, 0], lse_want, rtol=RTOL, atol=ATOL)


def test_a_fully_masked_block_merges_as_nothing():
    rng = np.random.default_rng(0)
    q, k, v = rng.normal(size=(1, 1, 1, 2, 3)), rng.normal(size=(1, 1, 1, 2, 3)), rng.normal(size=(1, 1, 1, 2, 3))
    kept = forward_block(q, k, v, "full", 0.5)
    empty = forward_block(q, k, v, EMPTY, 0.5)
    assert np.isneginf(empty[0]).all() and (empty[1] == 0).all() and (empty[2] == 0).all()
    for got, want in zip(merge(kept, empty), kept):
        assert (got == want).all()


# --- the ring's message plan and the formulas ---------------------------------------------------------
@settings(max_examples=40)
@given(C=st.integers(1, 8), lay=LAYOUTS, skip=st.booleans())
def test_every_chunk_a_rank_attends_to_reaches_it_and_the_plan_sends_what_the_byte_formula_says(C, lay, skip):
    """Simulate the plan: the K/V chunks each rank holds at each step are those its left neighbour
    sent, and they include every chunk it attends to; the chunk count per rank is the formula's."""
    shape = accounting.AttentionShape(batch=1, heads=1, kv_heads=1, seq_len=2 * C, d_head=1, ranks=C, itemsize=1)
    k = shape.chunk_kv_bytes  # 2 bytes: one chunk of K and V
    for r in range(C):
        kv = sum(len(chunks_sent(C, r, t, lay, skip, gradient=False)) for t in range(C - 1))
        grad = sum(len(chunks_sent(C, r, t, lay, skip, gradient=True)) for t in range(1, C))
        assert {"forward": kv * k, "backward": (kv + grad) * k} == accounting.ring_bytes(shape, r, lay, skip)
        for t in range(1, C):  # the block of rank (r − t) arrives from r − 1, sent at step t − 1
            owner, held = (r - t) % C, chunks_sent(C, (r - 1) % C, t - 1, lay, skip, gradient=False)
            keys = layout.rank_chunks(C, owner, lay)
            for a in (0, 1):
                used = any(pair_kind(i, keys[a]) != EMPTY for i in layout.rank_chunks(C, r, lay))
                assert not (used and a not in held), (r, t, a)
                assert used == needs_key_chunk(C, r, keys[a], lay)


@given(C=st.integers(1, 8), m=st.integers(1, 5), b=st.integers(1, 3), H=st.integers(1, 4), lay=LAYOUTS)
def test_score_counts_add_up_to_the_causal_triangle_and_balance_only_with_the_balanced_layout(C, m, b, H, lay):
    T = 2 * C * m
    shape = accounting.AttentionShape(b, H, 1, T, 1, C)
    counts = [accounting.score_elements(shape, r, "ring", lay) for r in range(C)]
    assert sum(n["unmasked"] for n in counts) == b * H * T * (T + 1) // 2
    computed = [n["computed"] for n in counts]
    if lay == "balanced":
        assert len(set(computed)) == 1
        assert computed[0] == accounting.score_elements(shape, 0, "ulysses")["computed"]
    else:
        assert computed == sorted(computed) and (C == 1 or computed[-1] > computed[0])
    assert all(accounting.score_elements(shape, r, "ring", lay, causal_skip=False)["computed"] == b * H * T * T // C
               for r in range(C))


def test_the_contiguous_layouts_last_rank_computes_about_twice_the_mean():
    shape = accounting.AttentionShape(1, 1, 1, 2 * 8 * 100, 1, 8)
    counts = [accounting.score_elements(shape, r, "ring", "contiguous")["computed"] for r in range(8)]
    assert counts[-1] / (sum(counts) / 8) == pytest.approx(31 / 17)  # (4·7 + 3) / mean(4r + 3) = 31 / 17


# --- one rank: the same arithmetic as dense attention ---------------------------------------------------
def dense(q, k, v, g):
    b, H, T, D = q.shape
    Hkv = k.shape[1]
    qt, kt, vt = (Tensor(x.copy(), requires_grad=True) for x in (q, k, v))
    k5 = kt.reshape(b, Hkv, 1, T, D).transpose(0, 1, 2, 4, 3)
    att = F.causal_softmax(qt.reshape(b, Hkv, H // Hkv, T, D) @ k5, np.triu(np.ones((T, T), bool), k=1),
                           1 / math.sqrt(D))
    y = (att @ vt.reshape(b, Hkv, 1, T, D)).reshape(b, H, T, D)
    (y * Tensor(g)).sum().backward()
    return y.data, qt.grad, kt.grad, vt.grad


ONE_RANK = {
    "ring": lambda q, k, v, skip: ring_attention(q, k, v, LocalComm(), causal_skip=skip),
    "ulysses": lambda q, k, v, skip: ulysses_attention(q, k, v, LocalComm(), causal_skip=skip),
    "blockwise": lambda q, k, v, skip: causal_attention(q, k, v, chunks=q.shape[2] // 2 or 1, causal_skip=skip),
}


@given(impl=st.sampled_from(sorted(ONE_RANK)), b=st.integers(1, 2), kv=st.integers(1, 3), group=st.integers(1, 3),
       m=st.integers(1, 4), D=st.integers(1, 5), skip=st.booleans(), seed=st.integers(0, 2 ** 32 - 1))
def test_on_one_rank_every_implementation_equals_dense_causal_attention(impl, b, kv, group, m, D, skip, seed):
    rng = np.random.default_rng(seed)
    T, H = 2 * m, kv * group
    q, k, v, g = (rng.normal(size=s) for s in [(b, H, T, D), (b, kv, T, D), (b, kv, T, D), (b, H, T, D)])
    qt, kt, vt = (Tensor(x.copy(), requires_grad=True) for x in (q, k, v))
    y = ONE_RANK[impl](qt, kt, vt, skip)
    (y * Tensor(g)).sum().backward()
    for got, want in zip((y.data, qt.grad, kt.grad, vt.grad), dense(q, k, v, g)):
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("impl", ["ring", "ulysses"])
def test_the_ledger_holds_q_k_v_the_output_and_the_log_sum_exp_and_nothing_per_block(impl):
    b, H, Hkv, T, D = 2, 4, 2, 16, 3
    rng = np.random.default_rng(1)
    q, k, v = (Tensor(rng.normal(size=(b, h, T, D)), requires_grad=True) for h in (H, Hkv, Hkv))
    before = saved_tensors.live_bytes
    work = Work()
    y = ONE_RANK[impl](q, k, v, True) if impl == "ring" else ulysses_attention(q, k, v, LocalComm(), work=work)
    shape = accounting.AttentionShape(b, H, Hkv, T, D, 1, 8)
    by_hand = (2 * 2 * 4 + 2 * 2 * 2) * 16 * 3 * 8 + 2 * 4 * 16 * 8  # q, y; k, v; the log-sum-exp
    assert saved_tensors.live_bytes - before == accounting.saved_bytes(shape) == by_hand
    y.sum().backward()
    assert saved_tensors.live_bytes == before  # released after backward
    if impl == "ulysses":
        assert work.forward_scores == work.backward_scores == accounting.score_elements(shape, 0, "ulysses")["computed"]


# --- bad input: one line ---------------------------------------------------------------------------------
def ranks(C):
    return SimpleNamespace(size=C, rank=0)  # the checks run before any message


@pytest.mark.parametrize("call,shapes,C,message", [
    (ring_attention, [(1, 2, 3, 4), (1, 2, 3, 4)], 2, "a sequence of 6 tokens cannot be cut into 2·2 = 4 equal chunks"),
    (ulysses_attention, [(1, 2, 5, 4), (1, 2, 5, 4)], 1, "a sequence of 5 tokens cannot be cut into 2·1 = 2 equal"),
    (ulysses_attention, [(1, 6, 4, 4), (1, 6, 4, 4)], 4, "Ulysses splits the heads over 4 ranks, but there are 6"),
    (ulysses_attention, [(1, 8, 4, 4), (1, 2, 4, 4)], 4, "8 query heads and 2 key/value heads; use head counts"),
    (ring_attention, [(1, 6, 4, 4), (1, 4, 4, 4)], 2, "6 query heads cannot share 4 key/value heads equally"),
])
def test_bad_shapes_are_one_line_errors(call, shapes, C, message):
    q, k = (Tensor(np.zeros(s)) for s in shapes)
    with pytest.raises(ValueError, match=message.replace("(", r"\(")) as raised:
        call(q, k, Tensor(np.zeros(shapes[1])), ranks(C))
    assert "\n" not in str(raised.value)
