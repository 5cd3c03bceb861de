"""The same numbers before and after a refactoring: `train --json` and `verify --json` on a fixed list
of configurations that covers every feature (ZeRO 0-3, mixed precision, every pipeline schedule,
tensor and sequence parallelism with partitioned activations, experts with expert parallelism and
DualPipe's overlap, the checkpointing plans, sharded save and resume, one process).

    python benchmarks/same_behaviour.py --out before.json       # on the old code
    python benchmarks/same_behaviour.py --compare before.json   # on the new code: exit 1 on any change

What must stay the same, per configuration: the final and held-out losses as `float.hex` (bitwise),
the bytes each buffer collective sent, and verify's verdict with its largest difference (also as
`float.hex`: the same arithmetic gives the same rounding) and where it was.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

SMALL = ["--steps", "3", "--batch-size", "8", "--n-layer", "2", "--d-model", "32"]
VERIFY = ["--steps", "2", "--batch-size", "8", "--n-layer", "2", "--d-model", "32"]

# name, ranks, flags (shared by train and verify), whether verify runs too
CONFIGURATIONS = [
    ("one process gpt", 1, [], True),
    ("one process mlp", 1, ["--model", "mlp"], False),
    ("one process checkpoint sqrt, dropout", 1, ["--checkpoint", "sqrt", "--dropout", "0.1", "--n-layer", "4"], True),
    ("dp 2 bucketed", 2, [], True),
    ("dp 2 naive, ring collectives", 2, ["--dp-mode", "naive", "--collectives", "ring"], True),
    ("zero 1, dp 2", 2, ["--zero", "1"], True),
    ("zero 2, dp 2, grad-accum 2", 2, ["--zero", "2", "--grad-accum", "2"], True),
    ("zero 3, dp 2, prefetch", 2, ["--zero", "3", "--prefetch", "20000"], True),
    ("zero 3, dp 4, param-threshold", 4, ["--zero", "3", "--param-threshold", "100"], True),
    ("mixed, zero 2, dp 2", 2, ["--dtype", "mixed", "--zero", "2"], True),
    ("mixed, zero 0, one process", 1, ["--dtype", "mixed"], False),
    ("gpipe pp 2", 2, ["--pp", "2", "--schedule", "gpipe"], True),
    ("1f1b pp 2 x dp 2, zero 1", 4, ["--pp", "2", "--schedule", "1f1b", "--zero", "1"], True),
    ("interleaved pp 2", 2, ["--pp", "2", "--schedule", "interleaved", "--n-layer", "4"], True),
    ("zb1p pp 2, zero 3", 2, ["--pp", "2", "--schedule", "zb1p", "--zero", "3"], True),
    ("zbh2 pp 2", 2, ["--pp", "2", "--schedule", "zbh2"], True),
    ("zbv pp 2", 2, ["--pp", "2", "--schedule", "zbv", "--n-layer", "4"], True),
    ("dualpipe pp 2, zero 2", 2, ["--pp", "2", "--schedule", "dualpipe", "--n-layer", "4", "--zero", "2"], True),
    ("dualpipev pp 2", 2, ["--pp", "2", "--schedule", "dualpipev", "--n-layer", "4"], True),
    ("tp 2, sequence parallel", 2, ["--tp", "2", "--sequence-parallel"], True),
    ("tp 2, checkpoint every:1, partitioned", 2,
     ["--tp", "2", "--checkpoint", "every:1", "--partition-activations"], True),
    ("tp 2 x pp 2, zero 1", 4, ["--tp", "2", "--pp", "2", "--zero", "1"], True),
    ("experts 4, ep 2", 2, ["--experts", "4", "--ep", "2"], True),
    ("experts 4, ep 2, capacity, zero 3", 2,
     ["--experts", "4", "--ep", "2", "--capacity-factor", "1.0", "--zero", "3"], True),
    ("dualpipe with experts, ep 2, overlap", 4,
     ["--pp", "2", "--schedule", "dualpipe", "--n-layer", "4", "--experts", "4", "--ep", "2"], True),
    ("dualpipe with experts, ep 2, no overlap", 4,
     ["--pp", "2", "--schedule", "dualpipe", "--n-layer", "4", "--experts", "4", "--ep", "2", "--no-overlap"], False),
    ("checkpoint revolve:2", 1, ["--checkpoint", "revolve:2", "--n-layer", "4"], True),
    ("checkpoint selective, dp 2", 2, ["--checkpoint", "selective"], True),
    ("checkpoint budget, zero 1", 2, ["--checkpoint", "budget:400KB", "--n-layer", "4", "--zero", "1"], True),
]


def run(ranks, args):
    command = [sys.executable, "-m", "refimpl", *args, "--json"]
    if ranks > 1:
        command = ["mpiexec", "-n", str(ranks), *command]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return {"error": f"exit {done.returncode}: {done.stderr.strip()[-400:]}"}
    return json.loads(lines[-1])


def buffer_bytes(report):
    """Bytes of the buffer collectives per rank (pickled-object collectives carry flags and names)."""
    return [{name: count for name, count in sorted(rank.items()) if not name.endswith("_object")}
            for rank in report.get("bytes_sent", [])]


def hexed(value):
    return float(value).hex() if value is not None else None


def measure_train(ranks, flags):
    report = run(ranks, ["train", *SMALL, *flags])
    if "error" in report:
        return report
    return {"final_loss": hexed(report["final_loss"]), "eval_loss": hexed(report.get("eval_loss")),
            "bytes_sent": buffer_bytes(report)}


def measure_verify(ranks, flags):
    report = run(ranks, ["verify", *VERIFY, *flags])
    if "error" in report:
        return report
    return {"ok": report["ok"], "max_abs_diff": hexed(report["max_abs_diff"]),
            "worst_name": report.get("worst_name"), "bytes_sent": buffer_bytes(report)}


def measure_resume():
    """Sharded save at 2 ranks with ZeRO-2, resumed at 4 ranks with ZeRO-3: the final loss."""
    with tempfile.TemporaryDirectory() as folder:
        saved = os.path.join(folder, "run")
        first = run(2, ["train", *SMALL, "--zero", "2", "--save-dir", saved])
        second = run(4, ["train", *SMALL[2:], "--steps", "5", "--zero", "3", "--resume", saved])
    if "error" in first or "error" in second:
        return {"error": first.get("error") or second.get("error")}
    return {"final_loss": hexed(second["final_loss"]), "start_step": second["start_step"]}


def measure_all():
    results = {}
    for name, ranks, flags, verify in CONFIGURATIONS:
        results[name] = {"train": measure_train(ranks, flags)}
        if verify:
            results[name]["verify"] = measure_verify(ranks, flags)
        print(f"{name}: {json.dumps(results[name])[:160]}", file=sys.stderr)
    results["sharded save at 2 ranks, resume at 4"] = {"train": measure_resume()}
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="write the measurements to this JSON file")
    parser.add_argument("--compare", help="compare with the measurements in this JSON file")
    args = parser.parse_args()
    results = measure_all()
    if args.out:
        with open(args.out, "w") as file:
            json.dump(results, file, indent=1, sort_keys=True)
    errors = [name for name, result in results.items() if any("error" in part for part in result.values())]
    for name in errors:
        print(f"ERROR {name}: {results[name]}")
    if args.compare:
        with open(args.compare) as file:
            before = json.load(file)
        changed = [name for name in before if before[name] != results.get(name)]
        for name in changed:
            print(f"CHANGED {name}:\n  before {before[name]}\n  after  {results.get(name)}")
        print(f"{len(before) - len(changed)} of {len(before)} configurations identical")
        return 1 if changed or errors else 0
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
