"""Engine overhead: a GPT training step against its matrix multiplications alone, and against PyTorch.

Launch:  python benchmarks/bench_engine.py [--json]

Model: d_model 256, 4 layers, 4 heads, context 128, batch 8, float32, one BLAS thread
(threadpoolctl), AdamW. Reported as ratios measured in one run (noise on shared machines is large):

  (a) refimpl step time / time of the same step's matrix multiplications alone in NumPy.
      The GEMMs are read off the recorded graph (every LinearFunction and MatMul node, with the
      arrays it saved) and replayed: forward product, input-gradient product and weight-gradient product.
      Target <= 1.5.
  (b) refimpl step time / PyTorch CPU eager step time on the same model and thread count, if torch is
      importable (pip install torch==2.13.0). Target <= 2.0.

Each figure is the median of several repetitions after warm-up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
from threadpoolctl import threadpool_limits

from refimpl.autograd import engine
from refimpl.autograd.ops import MatMul
from refimpl.nn import GPT, GPTConfig
from refimpl.nn import functional as F
from refimpl.optim import AdamW

CONFIG = dict(vocab_size=64, seq_len=128, n_layer=4, n_head=4, d_model=256, dtype="float32")
BATCH = 8


def median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def refimpl_step(model, opt, idx, targets):
    def step():
        loss = F.cross_entropy(model(idx), targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return step


def matmul_replay(model, idx, targets):
    """A function that runs exactly the step's GEMMs (forward, input- and weight-gradient) in NumPy."""
    loss = F.cross_entropy(model(idx), targets)
    nodes = engine._topological_order([loss.grad_fn])
    products = []
    rng = np.random.default_rng(0)
    for node in nodes:
        if isinstance(node, F.LinearFunction):
            x, w = node.saved
            g = rng.standard_normal(x.shape[:-1] + (w.shape[0],)).astype(x.dtype)
            products += [(x, w.T), (g, w), (g.reshape(-1, g.shape[-1]).T, x.reshape(-1, x.shape[-1]))]
        elif isinstance(node, MatMul):
            a, b = node.saved
            g = rng.standard_normal((a @ b).shape).astype(a.dtype)
            products += [(a, b), (g, np.swapaxes(b, -1, -2)), (np.swapaxes(a, -1, -2), g)]
    loss.backward()  # free the graph

    def replay():
        for a, b in products:
            a @ b
    return replay, len(products)


def torch_step_time(repeats: int) -> float | None:
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(1)
    c = CONFIG
    C, H, T = c["d_model"], c["n_head"], c["seq_len"]

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = torch.nn.LayerNorm(C), torch.nn.LayerNorm(C)
            self.qkv, self.proj = torch.nn.Linear(C, 3 * C), torch.nn.Linear(C, C)
            self.fc, self.out = torch.nn.Linear(C, 4 * C), torch.nn.Linear(4 * C, C)
            self.register_buffer("mask", torch.triu(torch.ones(T, T, dtype=torch.bool), 1))

        def forward(self, x):
            B = x.shape[0]
            q, k, v = self.qkv(self.ln1(x)).split(C, dim=-1)
            q, k, v = (t.reshape(B, T, H, C // H).transpose(1, 2) for t in (q, k, v))
            att = (q @ k.transpose(-1, -2)) * (C // H) ** -0.5
            att = torch.softmax(att.masked_fill(self.mask, float("-inf")), dim=-1)
            x = x + self.proj((att @ v).transpose(1, 2).reshape(B, T, C))
            return x + self.out(torch.nn.functional.gelu(self.fc(self.ln2(x)), approximate="tanh"))

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = torch.nn.Embedding(c["vocab_size"], C), torch.nn.Embedding(T, C)
            self.blocks = torch.nn.ModuleList(Block() for _ in range(c["n_layer"]))
            self.ln_f, self.head = torch.nn.LayerNorm(C), torch.nn.Linear(C, c["vocab_size"], bias=False)

        def forward(self, idx):
            x = self.wte(idx) + self.wpe(torch.arange(T))
            for b in self.blocks:
                x = b(x)
            return self.head(self.ln_f(x))

    torch.manual_seed(0)
    model = Model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    idx = torch.randint(0, c["vocab_size"], (BATCH, T))

    def step():
        loss = torch.nn.functional.cross_entropy(model(idx).reshape(-1, c["vocab_size"]), idx.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
    return median_time(step, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with threadpool_limits(limits=1):
        model = GPT(GPTConfig(**CONFIG), seed=0)
        opt = AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
        idx = np.random.default_rng(0).integers(0, CONFIG["vocab_size"], (BATCH, CONFIG["seq_len"]))
        step_time = median_time(refimpl_step(model, opt, idx, idx), args.repeats)
        replay, n_gemms = matmul_replay(model, idx, idx)
        gemm_time = median_time(replay, args.repeats)
        torch_time = torch_step_time(args.repeats)
    result = {
        "config": dict(CONFIG, batch=BATCH, blas_threads=1),
        "step_s": step_time,
        "matmul_only_s": gemm_time,
        "gemms_per_step": n_gemms,
        "overhead_ratio": step_time / gemm_time,
        "torch_step_s": torch_time,
        "vs_torch_ratio": None if torch_time is None else step_time / torch_time,
    }
    print(f"refimpl step {step_time * 1e3:.1f} ms; its {n_gemms} GEMMs alone {gemm_time * 1e3:.1f} ms "
          f"-> overhead ratio {result['overhead_ratio']:.2f} (target <= 1.5)")
    if torch_time is None:
        print("PyTorch not installed: pip install torch==2.13.0 for the comparison")
    else:
        print(f"PyTorch eager step {torch_time * 1e3:.1f} ms -> refimpl / PyTorch {result['vs_torch_ratio']:.2f} "
              f"(target <= 2.0)")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
