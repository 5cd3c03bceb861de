"""Cut a model into pipeline stages: contiguous runs of layers, balanced by layer count.

A pipeline schedule (schedules/) numbers S stages 0..S-1 in data-flow order and says which rank
runs which (`Placement`); this module decides what a stage *is*. The model is a chain

    enter  ->  layer_0 -> layer_1 -> ... -> layer_(L-1)  ->  leave  ->  loss

    GPT (refimpl.nn.models.GPT)    enter = embed (wte, wpe, dropout)   layers = the L blocks
                                   leave = head (ln_f, lm_head)        x: (b, T) token ids
                                   (Llama: no wpe; each LlamaBlock rotates its queries and keys
                                   by global position, a stage always holds whole sequences)
    MLP (MLPClassifier)            enter = features -> Tensor           layers = the L Linear
                                   leave = nothing (the last Linear     layers, each followed by
                                   gives the logits)                    the activation but the last

and stage s gets the layers [start_s, start_s + n_s) with

    n_s = L // S + (1 if s < L mod S else 0)          (sizes differ by at most one; the first
    start_s = n_0 + ... + n_(s-1)                      stages take the extra layers, since the
                                                       last one also carries the head and loss)

plus `enter` on stage 0 and `leave` on stage S-1 (the loss is computed there by the caller). S is
the schedule's `num_stages`: pp for GPipe, 1F1B, ZB-H1, ZB-H2 and DualPipe (whose every stage has
a copy on two ranks: each rank builds both), v·pp for interleaved 1F1B, 2·pp for ZB-V and
DualPipeV. Every stage needs at least one layer (L >= S); otherwise `split_model` raises one
ValueError that says how many layers the schedule needs.

How the stages are built. Every rank constructs the *whole* single-process model from the shared
seed, so the initial weights equal the reference's without any communication, and then keeps the
modules of its own stages; a stage's parameters keep their single-process names
(`blocks.3.attn.qkv.weight`), which is what `verify` compares and what a checkpoint stores.
Production systems (Megatron-LM, torch.distributed.pipelining) build only their own stage, or
build on a "meta" device and materialise their part, to save host memory; here the whole model is
small and the simpler construction keeps the names and the initialisation obviously identical.

Activation shapes. A receive needs its buffer before the message arrives, so each stage states
the shape of the activation that enters it (and of the gradient that leaves it) for a micro-batch
input of shape (b, T) or (b, d_in): `Stage.input_shape`.

    GPT boundary: (b, T, C)          MLP boundary before layer i: (b, width_i)

Tied embeddings (GPT-2's wte used again by the head) would put one weight on the first and the
last stage and need a cross-stage gradient sum; refimpl's GPT unties them by default and a tied
model is refused here with a clear message.
"""

from __future__ import annotations

from refimpl import backend
from refimpl.autograd.tensor import Tensor
from refimpl.checkpointing import AutoBlocks, checkpoint_sequential, parse_plan, resolve_plan
from refimpl.nn.layers import MLP
from refimpl.nn.models import GPT, MLPClassifier
from refimpl.nn.module import Module
from refimpl.objective import to_input


class MLPLayer(Module):
    """Layer i of an MLP as a chain element: Linear i, then the activation unless it is the last."""

    def __init__(self, mlp: MLP, index: int) -> None:
        super().__init__()
        self.linear = mlp.layers[index]
        self.activation = mlp.activation if index < len(mlp.layers) - 1 else None

    def forward(self, x: Tensor) -> Tensor:
        y = self.linear(x)  # (b, width_(i+1))
        return y if self.activation is None else self.activation(y)


class Chain:
    """A model seen as enter -> layers -> leave (the module docstring's table)."""

    def __init__(self, model) -> None:
        self.model = model
        self.tied = isinstance(model, GPT) and model.config.tie_weights
        if isinstance(model, GPT):
            self.layers = list(model.blocks)
            # Llama's blocks rotate by position themselves (global positions 0..T-1: every stage sees whole
            # sequences), so its entry has no wpe
            self.enter_modules = [m for m in (model.wte, model.wpe, model.drop) if m is not None]
            self.leave_modules = [model.ln_f] + ([model.lm_head] if not model.config.tie_weights else [])
            self.what = "transformer blocks"
            self.flag = lambda n: f"--n-layer {n}"
        elif isinstance(model, MLPClassifier):
            self.layers = [MLPLayer(model.mlp, i) for i in range(len(model.mlp.layers))]
            self.enter_modules, self.leave_modules = [], []
            self.what = "Linear layers (--n-layer hidden layers + 1)"
            self.flag = lambda n: f"--n-layer {n - 1}"
        else:
            raise ValueError(f"pipeline stages can be cut from a GPT or an MLPClassifier, not {type(model).__name__}")
        self.param_dtype = model.parameters()[0].dtype
        # Activations (the messages between stages): float16 and bfloat16 parameters compute in float32
        # (mixed precision, bf16: autograd/function.py), so what travels is float32
        self.dtype = "float32" if str(self.param_dtype) in ("float16", "bfloat16") else self.param_dtype

    def enter(self, x) -> Tensor:
        """The first stage's entry: token ids -> embeddings (b, T, C), or features -> Tensor (b, d_in)."""
        if isinstance(self.model, GPT):
            return self.model.embed(x)  # (b, T, C)
        return x if isinstance(x, Tensor) else Tensor(backend.asarray(x, dtype=self.param_dtype))

    def leave(self, x: Tensor) -> Tensor:
        """The last stage's exit: logits (b, T, V) or (b, classes)."""
        return self.model.head(x) if isinstance(self.model, GPT) else x

    def input_shape(self, layer: int, x_shape: tuple) -> tuple:
        """Shape of the activation entering `layer` for a micro-batch input of shape x_shape."""
        if isinstance(self.model, GPT):  # (b, T, C); with sequence parallelism (b, T/t, C)
            index, count = self.model.sequence_shard
            return (*x_shape[:-1], x_shape[-1] // count, self.model.config.d_model)
        return (x_shape[0], self.layers[layer].linear.weight.shape[1])  # (b, width)


def stage_sizes(num_layers: int, num_stages: int) -> list[int]:
    """Layers per stage: L // S each, the first L mod S stages one more."""
    return [num_layers // num_stages + (1 if s < num_layers % num_stages else 0) for s in range(num_stages)]


def check_split(num_layers: int, num_stages: int, what: str = "layers", why: str = "", flag=None) -> None:
    """One ValueError, the same on every rank, when L layers cannot make S non-empty stages."""
    if num_stages < 1:
        raise ValueError(f"a pipeline needs at least one stage, got {num_stages}")
    if num_layers < num_stages:
        fix = f" ({flag(num_stages)})" if flag else ""
        raise ValueError(f"the model has {num_layers} {what}, which cannot be split into {num_stages} pipeline "
                         f"stages{why}: every stage needs at least one; use at least {num_stages}{fix}, or fewer "
                         "pipeline ranks")


class Stage:
    """Stage `index` of `num_stages`: layers [start, stop) of the chain, plus enter / leave at the ends.

    forward(x) maps the stage's input to its output: token ids or features (stage 0), else a
    Tensor of `input_shape(...)`; the last stage returns logits. `named_parameters()` lists the
    stage's parameters under their single-process names, in the model's order.
    """

    def __init__(self, chain: Chain, index: int, num_stages: int, start: int, stop: int,
                 checkpoint_plan=None) -> None:
        self.chain, self.index, self.num_stages = chain, index, num_stages
        self.start, self.stop = start, stop
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.layers = chain.layers[start:stop]
        self.checkpoint_plan = checkpoint_plan
        self.checkpoint_store = None  # how kept layer inputs are stored (partitioned activations); None: whole
        self._resolved: dict = {}  # input (shape, dtype) -> concrete checkpointing plan (budget plans)
        modules = (chain.enter_modules if self.is_first else []) + self.layers + (
            chain.leave_modules if self.is_last else [])
        own = {id(p) for m in modules for p in m.parameters()}
        self._params = [(name, p) for name, p in chain.model.named_parameters() if id(p) in own]

    def named_parameters(self) -> list:
        return list(self._params)

    def parameters(self) -> list:
        return [p for _, p in self._params]

    def input_shape(self, x_shape: tuple) -> tuple:
        """Shape of this stage's input activation (= the gradient it sends back), for stage >= 1."""
        return self.chain.input_shape(self.start, tuple(x_shape))

    def output_shape(self, x_shape: tuple) -> tuple:
        """Shape of this stage's output activation (= the gradient it receives), for all but the last."""
        return self.chain.input_shape(self.stop, tuple(x_shape))

    @property
    def dtype(self):
        return self.chain.dtype

    def forward(self, x) -> Tensor:
        if self.is_first:
            x = self.chain.enter(x)
        x = self._run_layers(x)
        return self.chain.leave(x) if self.is_last else x

    __call__ = forward

    def _run_layers(self, x: Tensor) -> Tensor:
        plan = self.checkpoint_plan
        if plan is None or str(plan) in ("none", "selective"):  # selective: inside the blocks (the trainer)
            for layer in self.layers:
                x = layer(x)
            return x
        # Activation checkpointing inside the stage: the stage's layers are the chain that the
        # plan (sqrt, every:K, revolve:C, budget:B) recomputes during this stage's backward.

        if str(plan).startswith("auto:"):  # the graph of the stage's operations (checkpointing/auto.py)
            if "auto" not in self._resolved:
                self._resolved["auto"] = AutoBlocks(parse_plan(plan))
            return self._resolved["auto"](self.layers, x)
        key = (x.shape, str(x.dtype))
        if key not in self._resolved:  # a budget plan measures one layer once per input shape
            self._resolved[key] = resolve_plan(plan, self.layers, x)
        return checkpoint_sequential(self.layers, x, self._resolved[key], store=self.checkpoint_store)

    def __repr__(self) -> str:
        ends = ("enter + " if self.is_first else "") + f"layers {self.start}..{self.stop - 1}" + (
            " + leave" if self.is_last else "")
        return f"Stage({self.index}/{self.num_stages}: {ends})"


class WholeModel:
    """The one stage of a one-stage pipeline: the model itself, called as in single-process training.

    A pipeline of one stage is plain gradient accumulation (F0 B0 F1 B1 ... under 1F1B), so the
    trainer runs every configuration through the executor; with one stage the model is not cut
    into a chain: any model works, its own forward (and hooks, and the activation checkpointing
    that apply_to_gpt installs) runs exactly as in single-process training, bit for bit.
    """

    index, num_stages, is_first, is_last = 0, 1, True, True

    def __init__(self, model) -> None:
        self.model = model

    def named_parameters(self) -> list:
        return list(self.model.named_parameters())

    def parameters(self) -> list:
        return list(self.model.parameters())

    @property
    def dtype(self):
        return self.model.parameters()[0].dtype

    def forward(self, x):
        return self.model(to_input(self.model, x))

    __call__ = forward

    def __repr__(self) -> str:
        return f"WholeModel({type(self.model).__name__})"


def split_model(model, num_stages: int, stages=None, checkpoint_plan=None, why: str = "") -> dict:
    """{stage index: Stage} for the stages in `stages` (default: all) of a `num_stages`-stage split.

    One stage is the model itself (WholeModel); the caller applies a checkpoint plan to it
    (checkpointing.apply_to_gpt), as single-process training does."""
    if num_stages == 1 and (stages is None or list(stages) == [0]):
        return {0: WholeModel(model)}
    chain = Chain(model)
    if chain.tied and num_stages > 1:
        raise ValueError("a GPT with tied embeddings (tie_weights) puts one weight on the first and the last "
                         "pipeline stage; the pipeline needs untied weights (the default)")
    check_split(len(chain.layers), num_stages, chain.what, why, chain.flag)
    sizes = stage_sizes(len(chain.layers), num_stages)
    starts = [sum(sizes[:s]) for s in range(num_stages)]
    wanted = range(num_stages) if stages is None else stages
    return {s: Stage(chain, s, num_stages, starts[s], starts[s] + sizes[s], checkpoint_plan) for s in wanted}


def num_layers(model) -> int:
    """L of the chain (GPT blocks, or MLP Linear layers)."""
    return len(Chain(model).layers)


__all__ = ["Stage", "WholeModel", "Chain", "MLPLayer", "split_model", "stage_sizes", "check_split", "num_layers"]
