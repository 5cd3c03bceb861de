"""`python -m refimpl context-parallel`: context parallelism's formulas beside what one attention call measures.

    mpiexec -n 4 python -m refimpl context-parallel                              # C = 4, every configuration
    mpiexec -n 2 python -m refimpl context-parallel --seq-len 32 --kv-heads 2 --impl ring
    mpiexec -n 4 python -m refimpl context-parallel --compare-lengths            # + ring vs Ulysses over T and C
    mpiexec -n 4 python -m refimpl context-parallel --heads 8 --kv-heads 8 --compare-only   # that table alone

The whole world is one context-parallel group of C ranks (C = the number of processes; one process
is C = 1: nothing to send). For one attention call (forward and backward) on random inputs, for ring
attention (balanced and contiguous layouts, with and without the causal skip) and Ulysses (with and
without skipping the empty chunk pairs), every rank measures (tools/context_parallel_report.py)

    bytes sent       comm's counters: ring attention's "send" kind, Ulysses' "alltoall", forward
                     and backward; any other kind ("other kinds") should send nothing
    saved bytes      the saved-tensor ledger's growth over the forward
    score elements   computed in the forward, recomputed in the backward, kept by the causal mask

and the table prints each as "formula / measured" (refimpl/parallel/context_parallel/accounting.py),
marking a mismatch with ✗. The output and the gradients of q, k and v, gathered in the global
order, are compared with one process's dense causal attention (rtol 1e-10 in float64). Exit status
1 on any mismatch; 2 on bad input (2C must divide --seq-len; Ulysses needs --heads and --kv-heads
divisible by C; sizes whose one-process reference exceeds --max-work). --json prints one JSON object.
"""

from __future__ import annotations

import argparse

import numpy as np

from refimpl.parallel.comm import get_world
from refimpl.tools.console import emit_json, log
from refimpl.tools.context_parallel_report import (
    IMPLS,
    TOLERANCE,
    check_configuration,
    comparison,
    measure,
)
from refimpl.tools.flags import add_max_work_argument, check_work, positive_int

COMPARE_RANKS = (2, 4, 8, 16)
COMPARE_LENGTHS = (4096, 32768, 131072)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch", type=positive_int, default=2, help="sequences b (default 2)")
    p.add_argument("--heads", type=positive_int, default=8, help="query heads H (default 8)")
    p.add_argument("--kv-heads", type=positive_int, default=4,
                   help="key/value heads Hkv, dividing H (grouped-query attention; H: multi-head) (default 4)")
    p.add_argument("--seq-len", type=positive_int, default=48, help="tokens T, divisible by 2C (default 48)")
    p.add_argument("--d-head", type=positive_int, default=4, help="D per head (default 4)")
    p.add_argument("--dtype", choices=tuple(TOLERANCE), default="float64",
                   help="the arrays' type; compared with one float64 process within rtol 1e-10 (float64) "
                        "or 1e-4 (float32) (default float64)")
    p.add_argument("--impl", choices=IMPLS, action="append", help="measure only this implementation (repeatable)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compare-lengths", action="store_true",
                   help="also print ring attention's and Ulysses' bytes per call over sequence lengths and ring sizes")
    p.add_argument("--compare-only", action="store_true",
                   help="print only that comparison (everything is still measured and checked)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    add_max_work_argument(p, MAX_ELEMENTS, "array elements (one process's dense attention, the reference)")


MAX_ELEMENTS = 20_000_000  # 160 MB of float64


def elements_estimate(batch: int, heads: int, kv_heads: int, seq_len: int, d_head: int) -> int:
    """The array elements of the one-process reference, the largest: scores, probabilities and their
    gradients (b·H·T² each), and the inputs, outputs and their gradients."""
    return 4 * batch * heads * seq_len * seq_len + 8 * batch * (heads + kv_heads) * seq_len * d_head


def check(args) -> None:
    check_configuration(get_world().size, args.batch, args.heads, args.kv_heads, args.seq_len, args.d_head,
                        args.impl or IMPLS)
    check_work(elements_estimate(args.batch, args.heads, args.kv_heads, args.seq_len, args.d_head), args.max_work,
               "array elements", f"one process's attention of --batch {args.batch} --heads {args.heads} --seq-len "
               f"{args.seq_len} --d-head {args.d_head} (the reference)")


def run(args) -> int:
    world = get_world()
    C = world.size
    impls = tuple(args.impl or IMPLS)
    itemsize = np.dtype(args.dtype).itemsize
    result = {"ranks": C, "batch": args.batch, "heads": args.heads, "kv_heads": args.kv_heads,
              "seq_len": args.seq_len, "d_head": args.d_head, "dtype": args.dtype,
              **measure(world, args.batch, args.heads, args.kv_heads, args.seq_len, args.d_head, args.dtype, impls,
                        args.seed)}
    if args.compare_lengths or args.compare_only:
        ranks = sorted({C, *COMPARE_RANKS} - {1})
        lengths = sorted({args.seq_len, *COMPARE_LENGTHS})
        result["compare"] = comparison(args.batch, args.heads, args.kv_heads, args.d_head, itemsize, ranks, lengths)
    correct = world.bcast_object(result["correct"])  # rank 0 compared; every rank calls the collective
    ok = all(row["formula"] == row["measured"] for row in result["rows"]) and all(row["ok"] for row in correct)
    result["ok"] = ok
    if world.rank == 0:
        _print(result, args.compare_only)
        if args.json:
            emit_json(result)
    return 0 if ok else 1


def _configuration(row: dict) -> str:
    skip = "causal skip" if row["causal_skip"] else "no skip"
    if row["impl"] == "ulysses":
        return f"Ulysses, {skip}"
    return f"ring, {row['layout']}, {skip}"


def _cell(rows: list[dict], quantity: str) -> str:
    row = next(row for row in rows if row["quantity"] == quantity)
    cell = f"{row['formula']:,} / {row['measured']:,}"
    return cell if row["formula"] == row["measured"] else f"{cell} ✗"


def _print(result: dict, compare_only: bool) -> None:
    C = result["ranks"]
    c = result["seq_len"] // (2 * C)
    if compare_only:
        _print_comparison(result)
        return
    log(f"C = {C} ranks; one attention call: b = {result['batch']}, H = {result['heads']}, Hkv = "
        f"{result['kv_heads']}, T = {result['seq_len']} (2C chunks of c = {c}), D = {result['d_head']}, "
        f"{result['dtype']}" + ("; one process, so nothing is sent: launch C ranks with mpiexec -n C"
                                if C == 1 else ""))
    print("\n| configuration | rank | sent forward (bytes) | sent backward | other kinds | saved (bytes) "
          "| scores computed | recomputed | kept by the mask |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    groups: dict = {}
    for row in result["rows"]:
        groups.setdefault((_configuration(row), row["rank"]), []).append(row)
    for (name, rank), rows in groups.items():
        cells = " | ".join(_cell(rows, q) for q in ("forward_bytes", "backward_bytes", "other_bytes", "saved_bytes",
                                                      "computed", "recomputed", "unmasked"))
        print(f"| {name} | {rank} | {cells} |")
    print("\nEach cell: accounting.py's formula / the measurement (comm's counters: ring attention's \"send\" kind, "
          "Ulysses' \"alltoall\"; the saved-tensor ledger; blockwise.Work); ✗ marks a mismatch.")
    rtol = TOLERANCE[result["dtype"]][0]
    print(f"\n| configuration | y, dq, dk, dv equal one process's causal attention (rtol {rtol:g}) |")
    print("|---|---|")
    for row in result["correct"]:
        verdict = "yes" if row["ok"] else \
            f"NO ✗ (worst {max(row['worst'].values()):.3g} × the tolerance; finite: {row['finite']})"
        print(f"| {_configuration(row)} | {verdict} |")
    if "compare" in result:
        _print_comparison(result)


def _print_comparison(result: dict) -> None:
    print(f"\nBytes one rank sends in one attention call, forward + backward (b = {result['batch']}, H = "
          f"{result['heads']}, Hkv = {result['kv_heads']}, D = {result['d_head']}, {result['dtype']}), from "
          f"accounting.py; ring: balanced with the causal skip, the largest over the ranks")
    print("\n| C | T | ring | ring, no skip | Ulysses | fewer bytes | ring: scores per step / bytes per hop |")
    print("|---:|---:|---:|---:|---:|---|---:|")
    measured = _measured_totals(result)
    for row in result["compare"]:
        here = row["C"] == result["ranks"] and row["T"] == result["seq_len"]
        ring, whole = f"{row['ring']:,}", f"{row['ring_no_skip']:,}"
        ulysses = "— (H or Hkv not divisible by C)" if row["ulysses"] is None else f"{row['ulysses']:,}"
        if here:  # the sizes this run measured: the largest over its ranks, measured
            ring += f" (measured {measured[('ring', True)]:,})" if ("ring", True) in measured else ""
            whole += f" (measured {measured[('ring', False)]:,})" if ("ring", False) in measured else ""
            ulysses += f" (measured {measured[('ulysses', True)]:,})" if ("ulysses", True) in measured else ""
        if row["ulysses"] is None:
            fewer = "ring (only)"
        else:
            fewer = "ring" if row["ring"] < row["ulysses"] else "Ulysses" if row["ulysses"] < row["ring"] else "equal"
        print(f"| {row['C']} | {row['T']:,} | {ring} | {whole} | {ulysses} | {fewer} | "
              f"{row['scores_per_hop_byte']:.3g} |")


def _measured_totals(result: dict) -> dict:
    """{(impl, causal_skip): the largest over the ranks of the bytes measured forward + backward} (balanced)."""
    totals: dict = {}
    for row in result["rows"]:
        if row["layout"] != "balanced" or row["quantity"] not in ("forward_bytes", "backward_bytes", "other_bytes"):
            continue
        key = (row["impl"], row["causal_skip"], row["rank"])
        totals[key] = totals.get(key, 0) + row["measured"]
    largest: dict = {}
    for (impl, skip, _), value in totals.items():
        largest[(impl, skip)] = max(largest.get((impl, skip), 0), value)
    return largest
