"""The activation-checkpointing picture of docs/checkpointing.md, from measurements.

Launch:  pip install -e '.[viz]' && python benchmarks/checkpoint_picture.py [--out docs/images/checkpointing.png]

Left: peak saved activations against depth n for a chain of equal layers whose backward needs
only their input (TanhLayer, so the unit is one layer input A): none (n), sqrt (about 2√n) and
revolve with C = ⌈log₂ n⌉ slots. Right: extra forwards against peak memory at n = 64 for every
plan (every:K for K = 1..64, revolve:C for C = 1..16), the trade-off curve. Every point is measured
by refimpl.checkpointing.measure_chain: forward calls by a counter inside each layer, bytes by
the engine's saved-tensor ledger — never by the plans' own arithmetic.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from refimpl.checkpointing.measure import measure_chain, tanh_chain

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "images" / "checkpointing.png"))
    args = parser.parse_args()
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("this picture needs matplotlib: pip install -e '.[viz]'") from None

    depths = [4, 8, 16, 32, 64, 100, 128, 256]
    curves = {"none": [], "sqrt": [], "revolve:⌈log₂ n⌉": []}
    for n in depths:
        layers = tanh_chain(n)
        curves["none"].append(measure_chain(layers, "none").peak_states)
        curves["sqrt"].append(measure_chain(layers, "sqrt").peak_states)
        curves["revolve:⌈log₂ n⌉"].append(measure_chain(layers, f"revolve:{math.ceil(math.log2(n))}").peak_states)

    n = 64
    layers = tanh_chain(n)
    every = [measure_chain(layers, f"every:{k}") for k in range(1, n + 1)]
    revolve = [measure_chain(layers, f"revolve:{c}") for c in range(1, 17)]
    sqrt = measure_chain(layers, "sqrt")

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for (label, values), marker in zip(curves.items(), "osd"):
        left.plot(depths, values, marker=marker, label=label)
    left.set_xlabel("layers n")
    left.set_ylabel("peak saved activations (layer inputs A)")
    left.set_title("Memory against depth (measured)")
    left.set_xscale("log", base=2)
    left.set_yscale("log", base=2)
    left.legend()
    every.sort(key=lambda m: (m.peak_states, m.extra_forwards))
    right.plot([m.peak_states for m in every], [m.extra_forwards / n for m in every], "o", markersize=3,
               label="every:K, K = 1…64")
    right.plot([m.peak_states for m in revolve], [m.extra_forwards / n for m in revolve], "s-", markersize=4,
               label="revolve:C, C = 1…16")
    right.plot([sqrt.peak_states], [sqrt.extra_forwards / n], "k*", markersize=12, label="sqrt")
    right.set_xlabel("peak saved activations (layer inputs A)")
    right.set_ylabel("extra forwards per layer")
    right.set_title(f"Recomputation against memory, n = {n} (measured)")
    right.set_xscale("log", base=2)
    right.legend()
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
