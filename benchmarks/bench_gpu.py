"""GPT training-step time on the CPU (NumPy) and on the GPU (CuPy), in one run.

Launch:  PYTHONPATH=. python benchmarks/bench_gpu.py [--repeats 3] [--configs small,medium] [--out FILE]

For each model size: the same GPT (float32, AdamW, one global batch) is built on each backend from
the same seed and timed for `repeats` steps after one warm-up step (the warm-up compiles CuPy's
kernels); the figure is the median step time. A GPU step is timed up to the end of its work
(the stream is synchronised before the clock is read). Printed: one JSON line on stdout (and the
same in --out FILE) with every step time, the ratio cpu/gpu, the two backends' losses after the
timed steps (equal to float32 rounding), and the machine: GPU name, CuPy, NumPy, BLAS threads.

refimpl is written to be read, not to be fast: every op is a separate kernel launched from Python,
so small models are bound by launch overhead on the GPU and the ratio grows with the model.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

from refimpl import backend
from refimpl.nn import GPT, GPTConfig
from refimpl.nn import functional as F
from refimpl.optim import AdamW

CONFIGS = {  # batch B, context T
    "small": dict(n_layer=4, d_model=256, n_head=4, seq_len=128, batch=8),  # benchmarks/bench_engine.py's
    "medium": dict(n_layer=6, d_model=512, n_head=8, seq_len=256, batch=16),
}
VOCAB = 64


def step_times(config: dict, repeats: int) -> tuple[list[float], float]:
    """(step times in seconds, final loss) of `repeats` timed AdamW steps on the active backend."""
    c = dict(config)
    batch = c.pop("batch")
    model = GPT(GPTConfig(vocab_size=VOCAB, dtype="float32", **c), seed=0)
    optimizer = AdamW(model.parameters(), lr=1e-3)
    rng = np.random.default_rng(0)
    idx = backend.asarray(rng.integers(0, VOCAB, (batch, c["seq_len"])))  # (B, T) token ids
    targets = backend.asarray(rng.integers(0, VOCAB, (batch, c["seq_len"])))  # (B, T)

    def step() -> float:
        loss = F.cross_entropy(model(idx), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        backend.synchronize()  # the GPU's work is done before the clock is read
        return loss

    step()  # warm-up: CuPy compiles each kernel on first use
    times, loss = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - start)
    return times, float(loss.item())


def machine() -> dict:
    info = {"numpy": np.__version__, "cpu_cores": os.cpu_count(), "blas_threads": None}
    try:
        from threadpoolctl import threadpool_info  # noqa: PLC0415
    except ImportError:
        pass
    else:
        info["blas_threads"] = [(p["internal_api"], p["num_threads"]) for p in threadpool_info()]
    with backend.using("cupy") as cp:
        props = cp.cuda.runtime.getDeviceProperties(0)
        name = props["name"]
        info.update(gpu=name.decode() if isinstance(name, bytes) else str(name), cupy=cp.__version__)
    return info


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per backend and size (default 3)")
    parser.add_argument("--configs", default="small,medium", help=f"model sizes: {', '.join(CONFIGS)}")
    parser.add_argument("--out", help="also write the JSON line to this file")
    args = parser.parse_args(argv)
    why = backend.cupy_unavailable()
    if why is not None:
        print(f"error: {why}", file=sys.stderr)
        return 2
    results = []
    for name in args.configs.split(","):
        config = CONFIGS[name]
        row = {"config": name, **config}
        for which in ("numpy", "cupy"):
            with backend.using(which):
                times, loss = step_times(config, args.repeats)
            row[f"{which}_step_s"] = statistics.median(times)
            row[f"{which}_steps_s"] = times
            row[f"{which}_loss"] = loss
            print(f"{name}: {which} step {row[f'{which}_step_s'] * 1e3:.1f} ms", file=sys.stderr)
        row["cpu_over_gpu"] = row["numpy_step_s"] / row["cupy_step_s"]
        row["loss_rel_diff"] = abs(row["cupy_loss"] - row["numpy_loss"]) / abs(row["numpy_loss"])
        results.append(row)
    line = json.dumps({"benchmark": "gpt_step_cpu_vs_gpu", "dtype": "float32", "repeats": args.repeats,
                       "machine": machine(), "results": results})
    if args.out:
        with open(args.out, "w") as f:
            f.write(line + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
