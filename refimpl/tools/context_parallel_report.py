"""Context parallelism's accounting measured: one attention call per configuration, against the formulas.

For one attention call (forward and backward, loss = Σ y ⊙ g) on random inputs, run on every rank
of a world of C ranks, this module measures on each rank

    bytes sent        comm's counters over the forward and over the backward: ring attention's
                      "send" kind, Ulysses' "alltoall" (and any other kind, which should send nothing)
    saved bytes       the saved-tensor ledger's growth over the forward (autograd/saved.py)
    score elements    computed in the forward, recomputed in the backward and kept by the causal
                      mask (blockwise.Work)

and sets each beside refimpl/parallel/context_parallel/accounting.py's formula. It also gathers the
output and the gradients of q, k and v back into the global order (layout.unshard) and compares them
with one process's dense causal attention (causal_softmax(q kᵀ/√D) v through refimpl's autograd).

`comparison` evaluates the byte formulas of ring attention and Ulysses over sequence lengths and
ring sizes: where each sends fewer bytes, and how much attention work the ring has per byte it
sends (what lets it hide its transfers behind the block computation).

Used by `python -m refimpl context-parallel` (tools/commands/context_parallel.py) and by the MPI
test program tests/mpi_programs/context_parallel_checks.py.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np

from refimpl import backend
from refimpl.autograd.saved import saved_tensors
from refimpl.autograd.tensor import Tensor
from refimpl.nn import functional as F
from refimpl.parallel.context_parallel import accounting, layout
from refimpl.parallel.context_parallel.blockwise import Work, check_heads
from refimpl.parallel.context_parallel.ring_attention import ring_attention
from refimpl.parallel.context_parallel.ulysses import ulysses_attention

IMPLS = ("ring", "ulysses")
# (impl, layout, causal_skip): every configuration the command measures (Ulysses' bytes and work do not
# depend on the layout, which only orders its tokens: balanced only)
CONFIGURATIONS = tuple((impl, lay, skip) for impl in IMPLS for lay in layout.LAYOUTS for skip in (True, False)
                       if impl == "ring" or lay == "balanced")
KIND = {"ring": "send", "ulysses": "alltoall"}  # the comm kind each implementation's bytes are counted under
TOLERANCE = {"float64": (1e-10, 1e-12), "float32": (1e-4, 1e-6)}  # (rtol, atol) against one process in float64
QUANTITIES = ("forward_bytes", "backward_bytes", "other_bytes", "saved_bytes", "computed", "recomputed", "unmasked")


def check_configuration(C: int, batch: int, heads: int, kv_heads: int, seq_len: int, d_head: int,
                        impls=IMPLS) -> None:
    """One-line ValueErrors for a world of C ranks that cannot run these attention calls."""
    for name, value in (("batch", batch), ("heads", heads), ("kv-heads", kv_heads), ("seq-len", seq_len),
                        ("d-head", d_head)):
        if value < 1:
            raise ValueError(f"--{name} must be positive, got {value}")
    check_heads(heads, kv_heads)
    if seq_len % (2 * C):
        raise ValueError(f"--seq-len {seq_len} cannot be cut into 2·{C} = {2 * C} equal chunks over {C} ranks; "
                         f"use a sequence length divisible by {2 * C}, or launch a number of ranks C with "
                         f"2C dividing {seq_len}")
    if "ulysses" in impls and (heads % C or kv_heads % C):
        raise ValueError(f"Ulysses splits the heads over {C} ranks, but --heads is {heads} and --kv-heads "
                         f"{kv_heads}; use head counts divisible by {C}, or measure ring attention only (--impl ring)")


def global_inputs(cfg: dict, dtype: str = "float64"):
    """q (b, H, T, D), k, v (b, Hkv, T, D) and the output's gradient g (b, H, T, D): the same on every rank."""
    rng = np.random.default_rng(cfg["seed"])
    b, H, Hkv, T, D = (cfg[key] for key in ("batch", "heads", "kv_heads", "seq_len", "d_head"))
    return tuple(rng.normal(size=shape).astype(dtype) for shape in
                 ((b, H, T, D), (b, Hkv, T, D), (b, Hkv, T, D), (b, H, T, D)))


def reference(q, k, v, g):
    """One process, float64: y = causal_softmax(q kᵀ/√D) v with grouped heads; returns y, dq, dk, dv on the host."""
    b, H, T, D = q.shape
    Hkv = k.shape[1]
    qt, kt, vt = (Tensor(backend.asarray(x.astype(np.float64)), requires_grad=True) for x in (q, k, v))
    q5 = qt.reshape(b, Hkv, H // Hkv, T, D)
    k5 = kt.reshape(b, Hkv, 1, T, D).transpose(0, 1, 2, 4, 3)  # (b, Hkv, 1, D, T)
    v5 = vt.reshape(b, Hkv, 1, T, D)
    att = F.causal_softmax(q5 @ k5, backend.asarray(np.triu(np.ones((T, T), dtype=bool), k=1)), 1.0 / math.sqrt(D))
    y = (att @ v5).reshape(b, H, T, D)
    (y * Tensor(backend.asarray(g.astype(np.float64)))).sum().backward()
    return [backend.to_host(x) for x in (y.data, qt.grad, kt.grad, vt.grad)]


def worst(measured, expected, dtype: str = "float64") -> float:
    """The largest |measured − expected| / (atol + rtol·|expected|): at most 1 where they agree."""
    rtol, atol = TOLERANCE[dtype]
    return float(np.max(np.abs(measured - expected) / (atol + rtol * np.abs(expected))))


def shape_of(cfg: dict, C: int, itemsize: int = 8) -> accounting.AttentionShape:
    return accounting.AttentionShape(cfg["batch"], cfg["heads"], cfg["kv_heads"], cfg["seq_len"], cfg["d_head"], C,
                                     itemsize)


def expected(cfg: dict, C: int, r: int, itemsize: int = 8) -> dict:
    """accounting.py's figures for rank r: bytes by comm kind, saved bytes, score elements."""
    shape, impl, lay, skip = shape_of(cfg, C, itemsize), cfg["impl"], cfg["layout"], cfg["causal_skip"]
    sent = accounting.ring_bytes(shape, r, lay, skip) if impl == "ring" else accounting.ulysses_bytes(shape)
    scores = accounting.score_elements(shape, r, impl, lay, skip)
    kind = KIND[impl]
    return {"forward_bytes": {kind: sent["forward"]} if sent["forward"] else {},
            "backward_bytes": {kind: sent["backward"]} if sent["backward"] else {},
            "saved_bytes": accounting.saved_bytes(shape), "computed": scores["computed"],
            "recomputed": scores["computed"], "unmasked": scores["unmasked"]}


def attention_call(world, cfg: dict, dtype: str = "float64", forward_context=None):
    """Run one context-parallel attention call on this rank: ({"measured", "expected"}, outputs).

    cfg: {"batch", "heads", "kv_heads", "seq_len", "d_head", "impl", "layout", "causal_skip", "seed"}.
    outputs: this rank's y, dq, dk, dv (backend arrays). forward_context: a context manager entered
    around the forward only (a test's recorder)."""
    C, r = world.size, world.rank
    q, k, v, g = global_inputs(cfg, dtype)
    lay, skip = cfg["layout"], cfg["causal_skip"]
    mine = [layout.shard(x, C, r, layout=lay) for x in (q, k, v, g)]
    qt, kt, vt = (Tensor(backend.asarray(x), requires_grad=True) for x in mine[:3])
    attention = ring_attention if cfg["impl"] == "ring" else ulysses_attention
    work = Work()
    live, counted = saved_tensors.live_bytes, world.counters.snapshot()
    with forward_context or contextlib.nullcontext():
        y = attention(qt, kt, vt, world, layout=lay, causal_skip=skip, work=work)
    saved = saved_tensors.live_bytes - live
    forward, counted = world.counters.since(counted), world.counters.snapshot()
    (y * Tensor(backend.asarray(mine[3]))).sum().backward()
    backward = world.counters.since(counted)
    measured = {"forward_bytes": {kind: n["bytes"] for kind, n in forward.items() if n["bytes"]},
                "backward_bytes": {kind: n["bytes"] for kind, n in backward.items() if n["bytes"]},
                "saved_bytes": saved, "computed": work.forward_scores, "recomputed": work.backward_scores,
                "unmasked": work.unmasked_scores}
    return {"measured": measured, "expected": expected(cfg, C, r, np.dtype(dtype).itemsize)}, \
        [y.data, qt.grad, kt.grad, vt.grad]


def compare_with_one_process(world, cfg: dict, outputs, dtype: str = "float64") -> dict | None:
    """Collective: every rank's outputs gathered into the global order and, on rank 0, compared with
    one process's attention: {"worst": {"y", "dq", "dk", "dv"}, "finite"}; None on the other ranks."""
    shards = world.allgather_object([backend.to_host(x) for x in outputs])
    if world.rank != 0:
        return None
    gathered = [layout.unshard([s[n] for s in shards], layout=cfg["layout"]) for n in range(4)]
    wanted = reference(*global_inputs(cfg, dtype))
    return {"worst": {name: worst(got, want, dtype) for name, got, want in zip(("y", "dq", "dk", "dv"), gathered,
                                                                               wanted)},
            "finite": bool(all(np.isfinite(x).all() for x in gathered))}


def rows_of(cfg: dict, r: int, figures: dict) -> list[dict]:
    """One rank's figures as rows {"impl", "layout", "causal_skip", "rank", "quantity", "formula", "measured"}:
    bytes of the implementation's kind, bytes of any other kind (formula 0), saved bytes, score elements."""
    kind = KIND[cfg["impl"]]
    measured, formula = figures["measured"], figures["expected"]
    values = {}
    for name in ("forward_bytes", "backward_bytes"):
        values[name] = (formula[name].get(kind, 0), measured[name].get(kind, 0))
    others = sum(n for name in ("forward_bytes", "backward_bytes") for key, n in measured[name].items() if key != kind)
    values["other_bytes"] = (0, others)
    for name in ("saved_bytes", "computed", "recomputed", "unmasked"):
        values[name] = (formula[name], measured[name])
    key = {"impl": cfg["impl"], "layout": cfg["layout"], "causal_skip": cfg["causal_skip"], "rank": r}
    return [{**key, "quantity": name, "formula": int(values[name][0]), "measured": int(values[name][1])}
            for name in QUANTITIES]


def measure(world, batch: int, heads: int, kv_heads: int, seq_len: int, d_head: int, dtype: str = "float64",
            impls=IMPLS, seed: int = 0) -> dict:
    """Collective: every configuration of `impls` measured on every rank. {"rows": [...] (rows_of, every rank),
    "correct": [{"impl", "layout", "causal_skip", "worst", "finite", "ok"}] (rank 0; [] elsewhere)}."""
    C = world.size
    check_configuration(C, batch, heads, kv_heads, seq_len, d_head, impls)
    rows, correct = [], []
    for n, (impl, lay, skip) in enumerate(c for c in CONFIGURATIONS if c[0] in impls):
        cfg = {"batch": batch, "heads": heads, "kv_heads": kv_heads, "seq_len": seq_len, "d_head": d_head,
               "impl": impl, "layout": lay, "causal_skip": skip, "seed": seed + n}
        figures, outputs = attention_call(world, cfg, dtype)
        for r, each in enumerate(world.allgather_object(figures)):
            rows += rows_of(cfg, r, each)
        compared = compare_with_one_process(world, cfg, outputs, dtype)
        if compared is not None:
            ok = compared["finite"] and max(compared["worst"].values()) <= 1.0
            correct.append({"impl": impl, "layout": lay, "causal_skip": skip, **compared, "ok": ok})
    return {"rows": rows, "correct": correct}


# ------------------------------------------------------------------------------------------------
# Ring attention or Ulysses: bytes per attention call over sequence lengths and ring sizes
# ------------------------------------------------------------------------------------------------


def comparison(batch: int, heads: int, kv_heads: int, d_head: int, itemsize: int, ranks, lengths) -> list[dict]:
    """Per (C, T): bytes one rank sends in one attention call (forward + backward) by the formulas.

    ring             balanced layout with the causal skip: the largest over the ranks (rank C − 1's
                     forward sends all 2(C − 1) chunks; the others one fewer), and without the skip
    ulysses          (C − 1)/C of q, k, v and y forward, of their gradients backward (None where the
                     heads or the key/value heads do not divide by C)
    ring_per_hop     scores a rank computes per ring step (the whole call's, forward, over C steps)
                     divided by the K/V bytes of one hop: the work that hides one transfer grows
                     with T/C, the bytes with Hkv
    """
    rows = []
    for C in ranks:
        for T in lengths:
            if T % (2 * C):
                continue
            shape = accounting.AttentionShape(batch, heads, kv_heads, T, d_head, C, itemsize)
            ring = [accounting.ring_bytes(shape, r) for r in range(C)]
            skip = max(x["forward"] + x["backward"] for x in ring)
            whole = accounting.ring_bytes(shape, 0, causal_skip=False)
            ulysses = None if heads % C or kv_heads % C else accounting.ulysses_bytes(shape)  # None: heads % C
            scores = accounting.score_elements(shape, 0)["computed"]
            rows.append({"C": C, "T": T, "ring": skip, "ring_no_skip": whole["forward"] + whole["backward"],
                         "ulysses": None if ulysses is None else ulysses["forward"] + ulysses["backward"],
                         "scores_per_hop_byte": scores / C / shape.chunk_kv_bytes / 2 if C > 1 else None})
    return rows


__all__ = ["IMPLS", "CONFIGURATIONS", "KIND", "TOLERANCE", "QUANTITIES", "check_configuration", "global_inputs",
           "reference", "worst", "expected", "attention_call", "compare_with_one_process", "rows_of", "measure",
           "comparison"]
