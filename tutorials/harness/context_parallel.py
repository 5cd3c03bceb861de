"""Checks for tutorial 14 (context parallelism): the online-softmax merge, the load-balanced chunk
assignment, the causal work per rank and the ring's bytes, against
refimpl/parallel/context_parallel/ (blockwise.py, layout.py, accounting.py).

The merge is checked on rows drawn anew every run (NumPy's generator seeded from the operating
system), so no table of answers passes it: against refimpl's `blockwise.merge` on rows made to trip
the usual mistakes (a block whose row the mask empties, scores near 1000 whose exponentials
overflow), and by merging the blocks of whole rows in two orders and comparing with the softmax of
each row. NaN or ±inf where the answer is finite is a failure, never a pass.
"""

from __future__ import annotations

import numpy as np

from refimpl.parallel.context_parallel import accounting, blockwise, layout

from . import Wrong, shown

# -- Exercise 1: the online-softmax merge ------------------------------------------------------------

ROW_KINDS = ["an ordinary row", "a row whose second block's maximum is 40 above the first's",
             "a row the mask empties in the first block", "a row the mask empties in the second block",
             "a row the mask empties in both blocks", "a row of scores near 1000 (e^s overflows float64)"]


def partial(s, v):
    """(m, l, o) of rows of scores s (R, n), −inf where masked, against values v (n, D):
    m (R,) the row's maximum, l (R,) Σ exp(s − m), o (R, D) Σ exp(s − m)·v; an empty row (−inf, 0, 0)."""
    m = s.max(axis=1)
    shift = np.where(np.isfinite(m), m, 0.0)  # an empty row: exp(−∞ − 0) = 0, not NaN
    p = np.exp(s - shift[:, None])
    return m, p.sum(axis=1), p @ v


def _special_rows(rng, D: int):
    """Two blocks of scores (6, n1), (6, n2) and their values, one row per ROW_KINDS entry."""
    n1, n2 = int(rng.integers(2, 6)), int(rng.integers(2, 6))
    s1, s2 = rng.normal(size=(6, n1)) * 3, rng.normal(size=(6, n2)) * 3
    s2[1] += 40.0
    s1[2] = -np.inf
    s2[3] = -np.inf
    s1[4] = s2[4] = -np.inf
    s1[5] += 1000.0
    s2[5] += 1000.0 + rng.normal()
    return (s1, rng.normal(size=(n1, D))), (s2, rng.normal(size=(n2, D)))


def _answer(got, R: int, D: int, what: str):
    """The student's (m, l, o) as float arrays of shapes (R,), (R,), (R, D), or Wrong."""
    if not isinstance(got, (tuple, list)) or len(got) != 3:
        raise Wrong(f"{what}: merge must return the triple (m, l, o), not {type(got).__name__}"
                    + (f" of {len(got)}" if isinstance(got, (tuple, list)) else ""))
    arrays = [np.asarray(x, dtype=np.float64) for x in got]
    for name, x, shape in zip("mlo", arrays, [(R,), (R,), (R, D)]):
        if x.shape != shape:
            raise Wrong(f"{what}: {name} has shape {x.shape}, expected {shape} (one {name} per row"
                        + (", D numbers each)" if name == "o" else ")"))
    return arrays


def _call(merge, a, b, what: str):
    """merge(a, b), with copies of the inputs to catch an answer that changes them in place."""
    before = [x.copy() for x in (*a, *b)]
    got = merge(a, b)
    for name, x, old in zip(["m₁", "l₁", "o₁", "m₂", "l₂", "o₂"], (*a, *b), before):
        if not np.array_equal(np.asarray(x), old, equal_nan=True):
            raise Wrong(f"{what}: your merge changed its argument {name} in place; return new arrays (the ring "
                        "merges each block into a running result and may still need both inputs)")
    return got


def _compare_state(got, expected, rows: list[str], what: str) -> None:
    m, l, o = got
    em, el, eo = expected
    for name, x in zip("mlo", got):
        bad = np.isnan(x) if name == "m" else ~np.isfinite(x)
        if bad.any():
            r = int(np.argwhere(bad)[0][0])
            hint = (": e^(m₁ − m) with m₁ = m = −∞ is e^(−∞ + ∞) = NaN; shift by a maximum that is 0 where it is −∞"
                    if "both" in rows[r] else
                    ": rescale by e^(mᵢ − m) with m the larger maximum, never e^(mᵢ) itself" if "1000" in rows[r]
                    else "")
            raise Wrong(f"{what}: {name} is {shown(x[r] if x.ndim == 1 else x[r].tolist())} for {rows[r]}{hint}")
    if not np.array_equal(np.isneginf(m), np.isneginf(em)) or not np.allclose(
            m[np.isfinite(em)], em[np.isfinite(em)], rtol=1e-10, atol=1e-12):
        r = int(np.argmax(~np.isclose(m, em, rtol=1e-10, atol=1e-12) & ~(np.isneginf(m) & np.isneginf(em))))
        raise Wrong(f"{what}: m is {shown(m[r])} for {rows[r]}, expected {shown(em[r])}: the merged maximum is the "
                    "larger of the two (−∞ only where both blocks are empty)")
    for name, x, e in (("l", l, el), ("o", o, eo)):
        close = np.isclose(x, e, rtol=1e-10, atol=1e-12)
        if not close.all():
            r = int(np.argwhere(~close)[0][0])
            raise Wrong(f"{what}: {name} is {shown(np.round(x[r], 12).tolist())} for {rows[r]}, expected "
                        f"{shown(np.round(e[r], 12).tolist())}: each block's {name} was computed against its own "
                        "maximum; rescale both by e^(mᵢ − m) to the merged maximum m before adding")


def _whole_rows(rng):
    """Scores (R, n) with a random mask (every row keeps at least one key), values (n, D), and block cuts."""
    R, n, D = int(rng.integers(3, 7)), int(rng.integers(8, 25)), int(rng.integers(1, 5))
    s = rng.normal(size=(R, n)) * rng.choice([1.0, 10.0, 100.0])
    cuts = np.sort(rng.choice(np.arange(1, n), size=int(rng.integers(2, 5)), replace=False))
    blocks = np.split(np.arange(n), cuts)
    masked = rng.random((R, n)) < 0.3
    masked[0, blocks[0]] = True  # row 0 empty in the first block, row 1 in the last
    masked[1, blocks[-1]] = True
    for i in range(R):
        if masked[i].all():
            masked[i, rng.choice([j for j in range(n) if j not in blocks[0]])] = False
    s[masked] = -np.inf
    return s, rng.normal(size=(n, D)), blocks


def check_merge(merge) -> None:
    """Check: the online-softmax merge of two partial attention results."""
    rng = np.random.default_rng()  # new rows every run
    D = int(rng.integers(1, 5))
    (s1, v1), (s2, v2) = _special_rows(rng, D)
    a, b = partial(s1, v1), partial(s2, v2)
    for first, second, order in ((a, b, "merge(block 1, block 2)"), (b, a, "merge(block 2, block 1)")):
        got = _answer(_call(merge, first, second, order), 6, D, order)
        _compare_state(got, blockwise.merge(first, second), ROW_KINDS, order)
    for trial in range(3):
        s, v, blocks = _whole_rows(rng)
        R = s.shape[0]
        parts = [partial(s[:, cols], v[cols]) for cols in blocks]
        finite = np.where(np.isfinite(s), s, -np.inf)
        top = finite.max(axis=1, keepdims=True)
        p = np.exp(finite - top)
        y_ref = (p / p.sum(axis=1, keepdims=True)) @ v  # the softmax over the whole row, then its values
        lse_ref = top[:, 0] + np.log(p.sum(axis=1))
        for order in (list(range(len(blocks))), list(rng.permutation(len(blocks)))):
            what = (f"{R} rows of {s.shape[1]} keys in {len(blocks)} blocks of {[len(c) for c in blocks]} keys, "
                    f"merged in the order {order}")
            state = parts[order[0]]
            for j in order[1:]:
                state = _answer(_call(merge, state, parts[j], what), R, v.shape[1], what)
            m, l, o = state
            if not (np.isfinite(m).all() and np.isfinite(l).all() and np.isfinite(o).all()) or (l <= 0).any():
                raise Wrong(f"{what}: every row keeps some key, yet the merged (m, l, o) is not finite with l > 0: "
                            f"m {shown(m.tolist())}, l {shown(l.tolist())}")
            y = o / l[:, None]
            if not np.allclose(y, y_ref, rtol=1e-10, atol=1e-12):
                r = int(np.argmax(np.abs(y - y_ref).max(axis=1)))
                raise Wrong(f"{what}: o / l for row {r} is {shown(np.round(y[r], 12).tolist())}, but the softmax "
                            f"over the whole row gives {shown(np.round(y_ref[r], 12).tolist())}")
            if not np.allclose(m + np.log(l), lse_ref, rtol=1e-10, atol=1e-12):
                raise Wrong(f"{what}: m + log l should be each row's log-sum-exp {shown(lse_ref.tolist())}; "
                            f"yours is {shown((m + np.log(l)).tolist())}")


# -- Exercise 2: which chunks each rank holds --------------------------------------------------------

def check_rank_chunks(rank_chunks) -> None:
    """Check: the two chunks rank r holds, balanced and contiguous."""
    for C in range(1, 9):
        for r in range(C):
            for lay in layout.LAYOUTS:
                expected = layout.rank_chunks(C, r, lay)
                got = rank_chunks(C, r, lay)
                if isinstance(got, (tuple, list)) and len(got) == 2 and tuple(int(x) for x in got) == expected:
                    continue
                hint = ""
                if lay == "balanced" and isinstance(got, (tuple, list)) and len(got) == 2:
                    got_t = tuple(int(x) for x in got)
                    if got_t == (r, 2 * C - r):
                        hint = ": the 2C chunks are numbered 0 … 2C − 1, so the last one is 2C − 1"
                    elif got_t == expected[::-1]:
                        hint = ": in the order the shard holds them, the early chunk first"
                    elif got_t == (2 * r, 2 * r + 1):
                        hint = ": that is the contiguous layout"
                raise Wrong(f"C = {C}, rank {r}, {lay}: rank {r} holds chunks {expected}; you said {shown(got)}{hint}")


# -- Exercise 3: causal work per rank -----------------------------------------------------------------

def _scores(C: int, r: int, c: int, lay: str, **kwargs) -> dict:
    shape = accounting.AttentionShape(1, 1, 1, 2 * C * c, 1, C)
    return accounting.score_elements(shape, r, "ring", lay, **kwargs)


def check_causal_work(causal_work) -> None:
    """Check: the score elements each rank computes under the causal mask, balanced and contiguous."""
    for C in (1, 2, 3, 4, 8):
        for c in (1, 2, 5):
            for lay in layout.LAYOUTS:
                for r in range(C):
                    expected = _scores(C, r, c, lay)["computed"]
                    got = causal_work(C, r, c, lay)
                    if isinstance(got, (int, float, np.number)) and not isinstance(got, bool) and got == expected:
                        continue
                    mistakes = {
                        "you counted the scores the mask keeps; the diagonal block is computed whole, c² of them, "
                        "and masked afterwards": _scores(C, r, c, lay)["unmasked"],
                        "that is without the causal skip: a block the mask empties is not computed":
                            _scores(C, r, c, lay, causal_skip=False)["computed"],
                        "that is the other layout's count": _scores(C, r, c, [x for x in layout.LAYOUTS
                                                                            if x != lay][0])["computed"],
                    }
                    hint = next((why for why, wrong in mistakes.items() if wrong == got and wrong != expected), "")
                    raise Wrong(f"C = {C}, rank {r}, chunks of c = {c} tokens, {lay}: the rank computes {expected:,} "
                                f"score elements per (batch row, head); you said {shown(got)}"
                                + (f": {hint}" if hint else ""))


# -- Exercises 4 and 5: the ring's bytes --------------------------------------------------------------

BYTE_CASES = [  # (C, b, kv_heads, T, d_head, itemsize)
    (1, 2, 4, 8, 16, 8), (2, 1, 1, 4, 8, 8), (2, 2, 8, 64, 16, 2), (3, 1, 2, 12, 4, 4), (4, 2, 4, 24, 3, 8),
    (4, 1, 8, 8192, 128, 2), (5, 3, 1, 30, 2, 4), (8, 1, 8, 131072, 128, 2),
]


def _bytes_of(answer, what: str) -> tuple:
    if not (isinstance(answer, (tuple, list)) and len(answer) == 2
            and all(isinstance(x, (int, float, np.number)) and not isinstance(x, bool) for x in answer)):
        raise Wrong(f"{what}: return the pair (forward bytes, backward bytes), not {shown(answer)}")
    return tuple(answer)


def check_ring_bytes(ring_bytes) -> None:
    """Check: the bytes one rank sends in a ring attention call, without the causal skip."""
    for C, b, Hkv, T, D, item in BYTE_CASES:
        shape = accounting.AttentionShape(b, Hkv, Hkv, T, D, C, item)
        expected = accounting.ring_bytes(shape, 0, causal_skip=False)
        expected = (expected["forward"], expected["backward"])
        what = f"C = {C}, b = {b}, Hkv = {Hkv}, T = {T}, d_head = {D}, itemsize {item}"
        got = _bytes_of(ring_bytes(C, b, Hkv, T, D, item), what)
        if got == expected:
            continue
        k = shape.chunk_kv_bytes
        forward = {
            "a hop carries a rank's whole block, two chunks of c = T/(2C) tokens, keys and values: "
            "2k bytes with k = 2·b·Hkv·c·D·itemsize": (C - 1) * k,
            "there are C − 1 hops: at the last step the block a rank holds is not passed on": 2 * C * k,
            "count bytes, not elements: multiply by the itemsize": 2 * (C - 1) * k // item,
            "a rank holds T/C tokens, not the whole sequence": 2 * (C - 1) * k * C,
        }
        hint = next((why for why, wrong in forward.items() if wrong == got[0] and wrong != expected[0]), "")
        if not hint and got[0] == expected[0] and got[1] == got[0]:
            hint = ("backward sends the K/V blocks around again and, beside them, their gradients dK/dV back "
                    "to their owners: twice the forward's bytes")
        raise Wrong(f"{what}: one rank sends {expected[0]:,} bytes forward and {expected[1]:,} backward; you said "
                    f"{shown(got)}" + (f": {hint}" if hint else ""))


def check_ring_bytes_skipped(ring_bytes_skipped) -> None:
    """Check: the bytes rank r sends in a ring attention call with the causal skip (balanced)."""
    for C, b, Hkv, T, D, item in BYTE_CASES[:6]:
        shape = accounting.AttentionShape(b, Hkv, Hkv, T, D, C, item)
        for r in range(C):
            expected = accounting.ring_bytes(shape, r, "balanced", causal_skip=True)
            expected = (expected["forward"], expected["backward"])
            what = f"C = {C}, rank {r}, b = {b}, Hkv = {Hkv}, T = {T}, d_head = {D}, itemsize {item}"
            got = _bytes_of(ring_bytes_skipped(C, r, b, Hkv, T, D, item), what)
            if got == expected:
                continue
            plain_ring = accounting.ring_bytes(shape, r, causal_skip=False)
            k = shape.chunk_kv_bytes
            if got[0] == expected[0] and got[1] == 2 * got[0]:
                hint = ("the dK/dV chunks do not follow the K/V ones: a gradient chunk is sent only once a rank on "
                        "its way has contributed to it (before that it is zeros and stays)")
            elif got[0] == expected[0]:
                hint = (f"backward is {expected[1] // k} chunks of k = {k:,} bytes here (the forward's again, and "
                        f"the gradients); you have {got[1] / k:g}")
            elif got == (plain_ring["forward"], plain_ring["backward"]):
                hint = "that is without the causal skip: some chunks never need to travel"
            else:
                hint = (f"forward is {expected[0] // k} chunks of k = {k:,} bytes here; you have {got[0] / k:g}: "
                        "a K/V chunk is passed on only while a rank further along the ring attends to it")
            raise Wrong(f"{what}: rank {r} sends {expected[0]:,} bytes forward and {expected[1]:,} backward; you "
                        f"said {shown(got)}: {hint}")


__all__ = ["check_merge", "check_rank_chunks", "check_causal_work", "check_ring_bytes", "check_ring_bytes_skipped",
           "partial", "ROW_KINDS", "BYTE_CASES"]
