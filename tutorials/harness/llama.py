"""Checks for tutorial 15 (the Llama block): rotary positions, their relative property, the key/value
bytes of grouped-query attention and a Llama block's parameters, against refimpl/nn/ (functional.rotary,
layers.GroupedQueryAttention, layers.LlamaBlock) and refimpl/memory.py (llama_parameter_tensors).

Every check draws new inputs each run (NumPy's generator seeded from the operating system) beside
its fixed cases, so no table of answers passes it, and takes its expected values from refimpl's code:
the rotation from `functional.rotary`, the scores from two calls of it, the key/value bytes from the
arrays a built GroupedQueryAttention's `wk` and `wv` produce, the parameters from a built LlamaBlock
(small shapes) and `memory.llama_parameter_tensors` (the published shapes, too large to build).
NaN or ±inf where the answer is finite is a failure, never a pass.
"""

from __future__ import annotations

import numpy as np

from refimpl.autograd import Tensor, no_grad
from refimpl.memory import llama_parameter_tensors
from refimpl.nn import functional as F
from refimpl.nn.layers import GroupedQueryAttention, LlamaBlock

from . import Wrong, shown

# -- Exercise 1: rotary positions -------------------------------------------------------------------------


def _rope_numpy(x, positions, base, pairing="adjacent", exponent=2.0, sign=1.0):
    """RoPE written out in NumPy with a choice of the usual mistakes (the hints below): pairing "adjacent"
    (x₂ᵢ, x₂ᵢ₊₁) or "halves" (xᵢ, xᵢ₊D/2); θᵢ = base^(−exponent·i/D); sign −1 rotates the other way."""
    D = x.shape[-1]
    theta = base ** (-exponent * np.arange(D // 2) / D)  # (D/2,)
    angles = np.asarray(positions, dtype=np.float64)[:, None] * theta  # (T, D/2)
    cos, sin = np.cos(angles), sign * np.sin(angles)
    if pairing == "adjacent":
        a, b = x[..., 0::2], x[..., 1::2]
    else:
        a, b = x[..., :D // 2], x[..., D // 2:]
    first, second = a * cos - b * sin, a * sin + b * cos
    y = np.empty_like(x)
    if pairing == "adjacent":
        y[..., 0::2], y[..., 1::2] = first, second
    else:
        y[..., :D // 2], y[..., D // 2:] = first, second
    return y


ROTARY_MISTAKES = {
    "you paired dimension i with i + D/2 (GPT-NeoX's and Hugging Face's \"rotate_half\"); refimpl, like RoFormer "
    "and Meta's Llama code, rotates adjacent pairs (x₂ᵢ, x₂ᵢ₊₁)": {"pairing": "halves"},
    "your frequencies are θᵢ = base^(−i/D); pair i turns at θᵢ = base^(−2i/D), so the slowest pair's angle "
    "per token is about 1/base": {"exponent": 1.0},
    "you rotated the other way: y₂ᵢ = x₂ᵢ cos − x₂ᵢ₊₁ sin and y₂ᵢ₊₁ = x₂ᵢ sin + x₂ᵢ₊₁ cos": {"sign": -1.0},
}


def _array(got, shape, what: str):
    try:
        got = np.asarray(got, dtype=np.float64)
    except (TypeError, ValueError):
        raise Wrong(f"{what}: return a NumPy array of x's shape {shape}, not {type(got).__name__}") from None
    if got.shape != shape:
        raise Wrong(f"{what}: your output has shape {got.shape}, expected x's shape {shape}")
    if not np.isfinite(got).all():
        at = tuple(int(i) for i in np.argwhere(~np.isfinite(got))[0])
        raise Wrong(f"{what}: your output holds NaN or ±inf at {at}; a rotation of finite numbers is finite")
    return got


def _compare_rotation(got, x, positions, base, what: str) -> None:
    expected = F.rotary(Tensor(x.copy()), positions, base).data  # refimpl's rotation
    if np.allclose(got, expected, rtol=1e-9, atol=1e-9):
        return
    if np.allclose(got, _rope_numpy(x, np.arange(x.shape[-2]), base), rtol=1e-9, atol=1e-9):
        raise Wrong(f"{what}: you rotated row t by t·θᵢ; use positions[t], the token's global position (a shard of a "
                    "sequence, or the tokens after a KV cache, do not start at 0)")
    for hint, mistake in ROTARY_MISTAKES.items():
        if np.allclose(got, _rope_numpy(x, positions, base, **mistake), rtol=1e-9, atol=1e-9):
            raise Wrong(f"{what}: {hint}")
    at = np.unravel_index(np.argmax(np.abs(got - expected)), got.shape)
    raise Wrong(f"{what}: at index {tuple(int(i) for i in at)} you have {got[at]:.12g}, refimpl's rotary gives "
                f"{expected[at]:.12g}")


def _drawn_rotary_case(rng):
    lead = [(), (int(rng.integers(1, 4)),), (int(rng.integers(1, 3)), int(rng.integers(1, 5)))][int(rng.integers(3))]
    T, D = int(rng.integers(1, 10)), int(rng.choice([2, 4, 6, 8, 16, 64, 128]))
    positions = [np.arange(T), np.arange(T) + int(rng.integers(1, 5000)), rng.integers(0, 100_000, T)][
        int(rng.integers(3))]
    base = float(rng.choice([10_000.0, 500_000.0, float(rng.uniform(50.0, 1e6))]))
    return rng.normal(size=(*lead, T, D)), positions, base


def check_rotary(rotary) -> None:
    """Check: rotary position embedding of adjacent pairs, against refimpl's"""
    x, positions = np.array([[1.0, 0.0, 1.0, 0.0]]), np.array([2])
    what = "rotary([[1, 0, 1, 0]], positions [2], base 10000)"
    got = _array(rotary(x.copy(), positions.copy(), 10_000.0), x.shape, what)
    _compare_rotation(got, x, positions, 10_000.0, what)
    rng = np.random.default_rng()  # new inputs every run
    cases = [_drawn_rotary_case(rng) for _ in range(8)]
    T = int(rng.integers(2, 6))
    cases.append((rng.normal(size=(2, 3, T, 8)), np.arange(T) + 17, 10_000.0))  # a shard of a sequence, from 17
    for x, positions, base in cases:
        what = (f"x of shape {x.shape}, positions {shown(positions.tolist())}, base {base:g}")
        before = x.copy()
        got = rotary(x, positions.copy(), base)
        if not np.array_equal(x, before):
            raise Wrong(f"{what}: your rotary changed x in place; return a new array (attention still needs the "
                        "projection's output for its backward)")
        _compare_rotation(_array(got, x.shape, what), x, positions, base, what)


# -- Exercise 2: the relative property ----------------------------------------------------------------------

def _rotated_score(q, k, m: int, n: int, base: float) -> float:
    """(R_m q)·(R_n k), both rotated by refimpl's rotary: q at position m, k at position n."""
    qm = F.rotary(Tensor(q[None, :]), [m], base).data[0]
    kn = F.rotary(Tensor(k[None, :]), [n], base).data[0]
    return float(qm @ kn)


def _score_of(got, what: str) -> float:
    if isinstance(got, np.ndarray) and got.size == 1:
        got = got.reshape(())[()]
    if not isinstance(got, (int, float, np.number)) or isinstance(got, bool):
        raise Wrong(f"{what}: return the score, one number, not {shown(got)}")
    if not np.isfinite(float(got)):
        raise Wrong(f"{what}: your score is {got}; the score of finite vectors is finite")
    return float(got)


def check_relative_score(relative_score) -> None:
    """Check: the score of rotated q and k from their offset alone, at drawn positions and shifts"""
    rng = np.random.default_rng()  # new vectors, positions and shifts every run
    for trial in range(6):
        D = 2 * int(rng.integers(1, 33))
        base = float(rng.choice([10_000.0, 500_000.0, float(rng.uniform(50.0, 1e6))]))
        q, k = rng.normal(size=D), rng.normal(size=D)
        tol = 1e-9 * max(1.0, float(np.linalg.norm(q) * np.linalg.norm(k)))
        pairs = [(0, 0), (int(rng.integers(0, 50)), int(rng.integers(0, 50)))]
        pairs += [tuple(int(p) for p in rng.integers(0, 8192, 2)) for _ in range(3)]
        for m, n in pairs:
            shift = int(rng.integers(-min(m, n), 8192))  # both positions stay ≥ 0
            scores = [_rotated_score(q, k, m + s, n + s, base) for s in (0, shift)]
            what = (f"D = {D}, base {base:g}: q at position m = {m}, k at n = {n} (and both shifted by {shift}), "
                    f"delta = n − m = {n - m}")
            got = _score_of(relative_score(q.copy(), k.copy(), n - m, base), what)
            if all(abs(got - s) <= tol for s in scores):
                continue
            wrong = {
                "the score depends on n − m through the rotation R_(n−m) of k; you returned q·k, as if there were "
                "no rotation": float(q @ k),
                "the sign of the offset: (R_m q)·(R_n k) = q·(R_m)ᵀR_n k = q·(R_(n−m) k); rotating k by m − n "
                "(or q by n − m) turns the other way": _rotated_score(q, k, 0, m - n, base),
                "that is the score with the pairs of \"rotate_half\" (i, i + D/2); refimpl rotates adjacent pairs":
                    float(_rope_numpy(q[None], [m], base, "halves")[0] @ _rope_numpy(k[None], [n], base, "halves")[0]),
            }
            hint = next((why for why, value in wrong.items() if abs(got - value) <= tol), "")
            raise Wrong(f"{what}: (R_m q)·(R_n k) is {scores[0]:.12g} by refimpl's rotary ({scores[1]:.12g} after the "
                        f"shift); you said {got:.12g}" + (f": {hint}" if hint else ""))


# -- Exercise 3: the key/value bytes of grouped-query attention ------------------------------------------------

def kv_bytes_of_layer(b: int, T: int, n_head: int, kv_heads: int, d_head: int, dtype: str) -> tuple[int, int]:
    """(bytes of the keys and values one GroupedQueryAttention layer computes for b sequences of T tokens, the
    itemsize): a layer built by refimpl with width n_head·d_head, wk and wv run on an input of that shape."""
    rng = np.random.default_rng(0)
    layer = GroupedQueryAttention(n_head * d_head, n_head, kv_heads, T, rng, dtype=dtype)
    x = Tensor(rng.normal(size=(b, T, n_head * d_head)).astype(dtype))
    with no_grad():
        k, v = layer.wk(x), layer.wv(x)  # (b, T, kv_heads·d_head) each
    return k.data.nbytes + v.data.nbytes, k.data.itemsize


KV_CASES = [  # (b, T, n_head, kv_heads, d_head, dtype)
    (1, 4, 4, 4, 2, "float64"), (2, 5, 4, 2, 4, "float64"), (2, 3, 8, 1, 4, "float32"), (3, 7, 6, 3, 2, "float32"),
    (1, 16, 16, 4, 8, "float64"),
]


def _drawn_kv_case(rng):
    kv, group = int(rng.integers(1, 5)), int(rng.integers(1, 5))
    return (int(rng.integers(1, 4)), int(rng.integers(1, 9)), kv * group, kv, 2 * int(rng.integers(1, 5)),
            str(rng.choice(["float32", "float64"])))


def check_kv_bytes(kv_bytes) -> None:
    """Check: the key/value bytes of one layer with grouped-query attention, and the saving"""
    rng = np.random.default_rng()  # new shapes every run
    for b, T, H, Hkv, D, dtype in KV_CASES + [_drawn_kv_case(rng) for _ in range(4)]:
        measured, item = kv_bytes_of_layer(b, T, H, Hkv, D, dtype)
        multi_head, _ = kv_bytes_of_layer(b, T, H, H, D, dtype)
        expected = (measured, multi_head / measured)
        what = f"b = {b}, T = {T}, n_head = {H}, kv_heads = {Hkv}, d_head = {D}, itemsize {item}"
        got = kv_bytes(b, T, H, Hkv, D, item)
        if not (isinstance(got, (tuple, list)) and len(got) == 2 and all(
                isinstance(x, (int, float, np.number)) and not isinstance(x, bool) for x in got)):
            raise Wrong(f"{what}: return the pair (bytes of K and V, saving factor), not {shown(got)}")
        if not all(np.isfinite(float(x)) for x in got):
            raise Wrong(f"{what}: you said {shown(got)}; both numbers are finite")
        if float(got[0]) == expected[0] and abs(float(got[1]) - expected[1]) <= 1e-12 * expected[1]:
            continue
        wrong_bytes = {
            "that is multi-head attention's: with grouped-query attention the layer computes only kv_heads heads of "
            "keys and values (the shapes of wk's and wv's outputs), and refimpl never copies one for each of its "
            "query heads (the matrix products broadcast over the group)": multi_head,
            "count the keys and the values: two tensors": measured // 2,
            "count bytes, not elements: multiply by the itemsize": measured // item,
        }
        hint = next((why for why, value in wrong_bytes.items()
                     if float(got[0]) == value and value != measured), "")
        if not hint and float(got[0]) == measured:
            hint = ("the saving is multi-head attention's bytes over grouped-query attention's, n_head / kv_heads"
                    + (" (you have it upside down)" if abs(float(got[1]) * expected[1] - 1) < 1e-12 else ""))
        raise Wrong(f"{what}: wk and wv produce {measured:,} bytes and multi-head attention's {multi_head:,}, a "
                    f"saving of {expected[1]:g}x; you said {shown(got)}" + (f": {hint}" if hint else ""))


# -- Exercise 4: a Llama block's parameters -----------------------------------------------------------------------

# (name, d_model, n_head, kv_heads, ffn_size): the public model cards' shapes (REFERENCE.md; Llama 2 7B's
# config: 4096 wide, 32 heads, no grouped-query attention, SwiGLU width 11008)
PUBLISHED = [("Llama 2 7B", 4096, 32, 32, 11008), ("Llama 3 8B", 4096, 32, 8, 14336),
             ("Llama 3 70B", 8192, 64, 8, 28672), ("Llama 3 405B", 16384, 128, 8, 53248)]


def built_block_parameters(d_model: int, n_head: int, kv_heads: int, ffn_size: int) -> int:
    """The parameters of a LlamaBlock that refimpl builds with this shape (float32, to build fast)."""
    block = LlamaBlock(d_model, n_head, kv_heads, ffn_size, 2, np.random.default_rng(0), dtype="float32")
    return sum(p.size for p in block.parameters())


def formula_block_parameters(d_model: int, n_head: int, kv_heads: int, ffn_size: int) -> int:
    """One block's parameters by refimpl's memory model (memory.llama_parameter_tensors, one block, no
    embedding and no head): what the trainers' memory ledger and the cluster model count."""
    kv_width = kv_heads * (d_model // n_head)
    tensors = llama_parameter_tensors(1, d_model, 1, kv_width, ffn_size, embedding=False, head=False)
    return sum(elements * count for elements, count, _ in tensors)


def check_block_parameters(block_parameters) -> None:
    """Check: the parameters of one Llama block: RMSNorm, grouped-query attention, SwiGLU"""
    rng = np.random.default_rng()  # new small shapes every run, built by refimpl
    small = []
    for _ in range(4):
        kv, group, d_head = int(rng.integers(1, 4)), int(rng.integers(1, 4)), 2 * int(rng.integers(1, 4))
        small.append((kv * group * d_head, kv * group, kv, int(rng.integers(1, 40))))
    cases = [(f"a block of shape {s}", *s, built_block_parameters(*s)) for s in [(16, 4, 2, 24)] + small]
    cases += [(name, d, H, Hkv, F_, formula_block_parameters(d, H, Hkv, F_)) for name, d, H, Hkv, F_ in PUBLISHED]
    for name, d, H, Hkv, F_, expected in cases:
        what = f"{name}: d_model = {d}, n_head = {H}, kv_heads = {Hkv}, ffn_size = {F_}"
        got = block_parameters(d, H, Hkv, F_)
        if isinstance(got, (int, float, np.number)) and not isinstance(got, bool) and got == expected:
            continue
        kv = Hkv * d // H
        wrong = {
            "the key and value projections map d_model to kv_heads·d_head, not to d_model": expected + 2 * d * (d - kv),
            "the MLP has three matrices (the gate W₁, the up projection W₃ and W₂), not two":
                expected - d * F_,
            "RMSNorm has a gain and no bias: d_model parameters per norm, two norms per block": expected + 2 * d,
            "each block has two RMSNorms, of d_model gains each": expected - 2 * d,
            "the Llama block has no biases": expected + d + 2 * kv + d + 2 * F_ + d,
        }
        hint = next((why for why, value in wrong.items() if got == value), "")
        raise Wrong(f"{what}: the block has {expected:,} parameters; you said {shown(got)}"
                    + (f": {hint}" if hint else ""))


__all__ = ["check_rotary", "check_relative_score", "check_kv_bytes", "check_block_parameters", "kv_bytes_of_layer",
           "built_block_parameters", "formula_block_parameters", "KV_CASES", "PUBLISHED", "ROTARY_MISTAKES"]
