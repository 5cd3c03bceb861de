"""`python -m refimpl memory`: ZeRO memory per rank, from the paper's formula and from the ledger.

    python -m refimpl memory --params 7.5B --world 64                     # the paper's line
    python -m refimpl memory --params 7.5B,128B,1T --world 1,4,16,64,256,1024 --precision mixed
    mpiexec -n 4 python -m refimpl memory --model gpt --n-layer 2 --d-model 64 --precision float32

With --params it evaluates the formulas of ZeRO (Rajbhandari et al., arXiv 1910.02054, Table 1;
see refimpl/memory.py) in decimal GB with one decimal, as the paper prints them, and the
communication per rank per step. With a model instead, it builds the model and every stage's
trainer on the world it was launched on (N = the number of processes), runs one training step with
each, and prints the ledger -- bytes actually held on rank 0 -- beside the formula evaluated at the
model's Ψ and at the padded Ψ' that the flat buffers really hold, plus the transient peaks the
formula leaves out (gathered parameters, gradient buckets, activations), and the elements rank 0
sent in that step next to the communication formula. --json prints the numbers.
"""

from __future__ import annotations

import argparse

from refimpl import backend
from refimpl.autograd import saved_tensors
from refimpl.memory import (
    COMM_FORMULAS,
    STAGE_FORMULAS,
    STAGE_NAMES,
    bytes_per_parameter,
    communication_elements,
    format_gb,
    model_state_bytes,
    paper_table,
    parse_bytes,
    parse_count,
)
from refimpl.tools.console import emit_json, log
from refimpl.tools.run import DEFAULTS, TrainConfig, build_model, build_task, get_world, make_trainer


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--params", metavar="PSI", help="parameter count(s): 7.5B, 7.5e9, 350M; comma-separated for several")
    p.add_argument("--world", metavar="N", help="data-parallel ranks, comma-separated for several (default 64 with "
                   "--params; with a model, the number of processes launched)")
    p.add_argument("--precision", "--dtype", dest="precision", choices=("mixed", "float32", "float64"), default=None,
                   help="mixed (P=2, G=2, K=12, the paper's), float32 (4, 4, 8) or float64 (default mixed)")
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    p.add_argument("--model", choices=("gpt", "mlp"), help="measure this model's ledger at every stage")
    p.add_argument("--n-layer", type=int)
    p.add_argument("--d-model", type=int)
    p.add_argument("--n-head", type=int)
    p.add_argument("--seq-len", type=int)
    p.add_argument("--batch-size", type=int, help="global batch of the measured step (default: 2 per rank)")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--bucket-bytes", type=int, default=1 << 20)
    p.add_argument("--prefetch", type=parse_bytes, default=0, metavar="BYTES")
    p.add_argument("--param-threshold", type=int, default=0)
    backend.add_argument(p)  # with a model: the arrays of the measured step
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def _worlds(text: str | None, default: list[int]) -> list[int]:
    if text is None:
        return default
    try:
        worlds = [int(w) for w in text.split(",")]
    except ValueError:
        raise ValueError(f"--world takes positive integers separated by commas, got {text!r}") from None
    if min(worlds) < 1:
        raise ValueError(f"--world takes positive integers, got {text!r}")
    return worlds


def run(args) -> int:
    if args.params is not None and args.model is not None:
        raise ValueError("give either --params (the formula) or a model (--model ...: the formula and the ledger)")
    precision = args.precision or "mixed"
    if args.params is not None or args.model is None and args.n_layer is None and args.d_model is None:
        return _estimate(args, precision)
    return _measure(args, precision)


# ------------------------------------------------------------------------------------------------
# The paper's table
# ------------------------------------------------------------------------------------------------


def _estimate(args, precision: str) -> int:
    psis = [parse_count(p) for p in (args.params or "7.5B").split(",")]
    worlds = _worlds(args.world, [64])
    p, g, k = bytes_per_parameter(precision, args.optimizer)
    itemsize = p
    tables = []
    for psi in psis:
        rows = paper_table(psi, worlds, precision) if args.optimizer == "adamw" else [
            {"stage": s, "name": STAGE_NAMES[s], "formula": STAGE_FORMULAS[s],
             "bytes": {n: model_state_bytes(s, psi, n, p, g, k) for n in worlds}} for s in STAGE_NAMES]
        for row in rows:
            row["gb"] = {n: float(format_gb(b)) for n, b in row["bytes"].items()}
            row["comm_formula"] = COMM_FORMULAS[row["stage"]]
            row["comm_elements"] = {n: communication_elements(row["stage"], psi, n) for n in worlds}
        tables.append({"params": psi, "rows": rows})
    out = [f"ZeRO model-state memory per rank, decimal GB (Rajbhandari et al., arXiv 1910.02054, Table 1); "
           f"{precision} {args.optimizer}: P = {p}, G = {g}, K = {k} bytes per parameter"]
    for table in tables:
        out += ["", f"Ψ = {_count(table['params'])} parameters", ""]
        head = f"{'stage':<8} {'formula':<16}" + "".join(f"{'N=' + str(n):>9}" for n in worlds)
        out += [head, "-" * len(head)]
        for row in table["rows"]:
            cells = "".join(f"{format_gb(row['bytes'][n]):>9}" for n in worlds)
            out.append(f"{row['name']:<8} {row['formula']:<16}" + cells)
        out += ["", f"communication per rank per step (ring, g = 1), {_count(table['params'])} parameters of "
                    f"{itemsize} bytes:"]
        for row in table["rows"]:
            out.append(f"  {row['name']:<8} {row['comm_formula']:<16}" + "".join(
                f"{format_gb(row['comm_elements'][n] * itemsize):>9}" for n in worlds) + "  GB")
    print("\n".join(out))
    if args.json:
        emit_json({"precision": precision, "optimizer": args.optimizer, "P": p, "G": g, "K": k, "worlds": worlds,
                   "tables": tables})
    return 0


def _count(psi: int) -> str:
    for suffix, size in (("T", 10**12), ("B", 10**9), ("M", 10**6)):
        if psi >= size:
            return f"{psi / size:g}{suffix}"
    return str(psi)


# ------------------------------------------------------------------------------------------------
# The ledger of a real model
# ------------------------------------------------------------------------------------------------


def _measure(args, precision: str) -> int:
    model_name = args.model or "gpt"
    defaults = DEFAULTS[model_name]
    cfg = TrainConfig(model=model_name, dtype=precision, optimizer=args.optimizer, steps=1,
                      n_layer=args.n_layer or defaults["n_layer"], d_model=args.d_model or defaults["d_model"],
                      n_head=args.n_head or defaults["n_head"], seq_len=args.seq_len or defaults["seq_len"],
                      grad_accum=args.grad_accum, bucket_bytes=args.bucket_bytes, prefetch=args.prefetch,
                      param_threshold=args.param_threshold)
    world = get_world(cfg)
    n = world.size
    if args.world is not None and _worlds(args.world, [n]) != [n]:
        raise ValueError(f"--world {args.world} with a model: the ledger is measured on the processes launched "
                         f"({n}); run mpiexec -n {args.world} python -m refimpl memory ...")
    cfg.batch_size = args.batch_size or 2 * n * cfg.grad_accum
    cfg.check()
    p, g, k = bytes_per_parameter(precision, args.optimizer)
    task = build_task(cfg)
    rows = []
    for stage in STAGE_NAMES:
        cfg.zero = stage
        model = build_model(cfg, task)
        psi = model.num_parameters()
        trainer = make_trainer(cfg, model, world, distributed=True)
        saved_tensors.reset_peak()
        trainer.ledger.reset_peak()
        x, y = task.batch(0, cfg.batch_size)
        before = world.counters.snapshot()
        trainer.step(x, y)
        sent = {kind: c for kind, c in world.counters.since(before).items()
                if kind in ("allreduce", "reduce_scatter", "allgather")}
        sharding = trainer.sharding  # DDP (data_parallel.py) or a ZeRO stage (zero/)
        groups = getattr(sharding, "groups", [])  # ZeRO's flat groups
        padded = getattr(sharding, "padded_numel", psi)
        persistent = sum(gr.length for gr in groups if gr.index not in sharding.unit_of) if stage == 3 else 0
        sharded = padded - persistent
        itemsize = model.parameters()[0].dtype.itemsize
        if groups:
            gradient_allreduces = len(groups) if stage == 0 else 0
        else:  # DDP: one all-reduce per bucket
            gradient_allreduces = sum(len(b.groups) for b in sharding.buckets.values())
        scalars = sent.get("allreduce", {}).get("calls", 0) - gradient_allreduces  # loss, norm, overflow flag
        traffic = {kind: c["bytes"] for kind, c in sent.items()}
        if "allreduce" in traffic:  # rank 0 sends 8 bytes per one-number all-reduce when N > 1
            traffic["allreduce"] -= scalars * 8 * (n > 1)
        measured = world.allgather_object(trainer.ledger.model_state())
        peaks = world.allgather_object({**trainer.ledger.peak(), "total": trainer.ledger.peak_total})
        rows.append({
            "stage": stage, "name": STAGE_NAMES[stage], "formula": STAGE_FORMULAS[stage],
            "trainer": type(sharding).__name__,
            "params": psi, "padded_params": padded, "persistent_params": persistent,
            "flat_buffers": len(groups),
            "estimate": model_state_bytes(stage, psi, n, p, g, k),
            "estimate_padded": model_state_bytes(stage, sharded, n, p, g, k, persistent),
            "measured": [sum(m.values()) for m in measured], "measured_by_category": measured[0],
            "peak": peaks[0], "ranks_agree": all(m == measured[0] for m in measured),
            "comm_formula": COMM_FORMULAS[stage], "scalar_allreduces": scalars,
            "comm_elements_formula": communication_elements(stage, sharded, n, cfg.grad_accum, persistent),
            "comm_elements_measured": {kind: b // itemsize for kind, b in traffic.items()},
        })
    if world.rank != 0:
        return 0
    out = [f"ZeRO memory per rank: {model_name} with Ψ = {rows[0]['params']} parameters, N = {n}, {precision} "
           f"{args.optimizer} (P = {p}, G = {g}, K = {k}); bytes on rank 0 after one step", "",
           f"{'stage':<7} {'formula':<15} {'formula(Ψ)':>12} {'formula(Ψ′)':>12} {'ledger':>12} {'Ψ′ − Ψ':>7}  "
           f"{'gathered':>9} {'buckets':>9} {'activations':>11} {'peak total':>11}"]
    for row in rows:
        peak = row["peak"]
        out.append(f"{row['name']:<7} {row['formula']:<15} {row['estimate']:>12,.0f} {row['estimate_padded']:>12,} "
                   f"{row['measured'][0]:>12,} {row['padded_params'] - row['params']:>7}  "
                   f"{peak['gathered_parameters']:>9,} {peak['gradient_buckets']:>9,} {peak['activations']:>11,} "
                   f"{peak['total']:>11,}")
    ok = all(row["estimate_padded"] == m for row in rows for m in row["measured"])
    out += ["", "ledger = formula at the padded Ψ′ on every rank: " + ("yes" if ok else "NO"),
            "(the formula counts model states only; gathered parameters, gradient buckets and activations are the "
            "ledger's transient peaks; Ψ′ − Ψ is the padding of the flat buffers to multiples of N, at most N − 1 "
            "per buffer)", "",
            f"communication of rank 0 in that step, elements (g = {cfg.grad_accum}; besides one-number all-reduces "
            "of the loss, clipping norm, overflow flag)", "",
            f"{'stage':<7} {'formula':<15} {'formula(Ψ′)':>12} {'all-reduce':>11} {'reduce-scatter':>15} "
            f"{'all-gather':>11} {'total':>9}"]
    for row in rows:
        m = row["comm_elements_measured"]
        total = sum(m.values())
        out.append(f"{row['name']:<7} {row['comm_formula']:<15} {row['comm_elements_formula']:>12,.0f} "
                   f"{m.get('allreduce', 0):>11,} {m.get('reduce_scatter', 0):>15,} {m.get('allgather', 0):>11,} "
                   f"{total:>9,}")
        row["comm_equal"] = total == row["comm_elements_formula"]
    out += ["", "measured = formula: " + ("yes" if all(row["comm_equal"] for row in rows) else
                                          "no (lengths not divisible by N send counts-sized blocks; see comm.py)")]
    print("\n".join(out))
    if not ok:
        log("memory: the ledger differs from the formula; see the table")
    if args.json:
        emit_json({"model": model_name, "world_size": n, "precision": precision, "optimizer": args.optimizer,
                   "P": p, "G": g, "K": k, "rows": rows, "ledger_equals_formula": ok,
                   "communication_equals_formula": all(row["comm_equal"] for row in rows)})
    return 0 if ok else 1
