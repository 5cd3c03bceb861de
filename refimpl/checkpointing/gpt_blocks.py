"""The GPT's blocks under a checkpointing plan: the integration with the training loop.

The GPT (refimpl/nn/models.py) is cut into embed(), blocks and head() so that checkpointing can
wrap the blocks from above (nn does not import checkpointing; data flows one way):

    logits = gpt_forward(model, idx, "sqrt")     # embed -> checkpoint_sequential(blocks) -> head
    apply_to_gpt(model, "revolve:4")             # from now on model(idx) does the same
    apply_to_gpt(model, "selective+every:2")     # attention cores recomputed, and every:2 on blocks
    apply_to_gpt(model, "none")                  # back to the plain forward

apply_to_gpt installs a blocks runner (GPT.blocks_runner, a callable (blocks, x) -> x that the
GPT's forward calls instead of its plain loop), so everything that calls model(idx) or
model.loss(idx, targets) — the training loop, data parallelism, ZeRO — runs the checkpointed
forward without knowing it. Hooks, parameters and state_dict are untouched. A selective plan also
installs an attention-core runner in every block (CausalSelfAttention.core_runner): the core runs
under checkpoint(), which keeps only its inputs q, k, v (selective_recomputation below).

What the training loop reports about it is measured from outside: forward calls per block
(count_forward_calls in measure.py, a forward pre-hook counter, recomputations included) and the
peak of saved bytes (the engine's ledger; the caller resets its peak at the start of a step). A
budget plan measures one block once per input shape (one extra forward of block 0, the first
time) and reuses the chosen plan.
"""

from __future__ import annotations

from refimpl.autograd.grad_mode import is_enabled as is_grad_enabled
from refimpl.autograd.tensor import Tensor

from .auto import AutoCheckpoint
from .checkpoint import checkpoint
from .plans import Auto, Budget, NoCheckpoint, Selective, chain_plan, parse_plan
from .sequential import checkpoint_sequential, measure_layer_cost, resolve_plan


def gpt_forward(model, idx, plan="none", *, preserve_rng_state: bool = True) -> Tensor:
    """The GPT's logits (B, T, V), its blocks run under `plan`."""
    x = model.embed(idx)  # (B, T, C)
    if isinstance(parse_plan(plan), Auto):  # one recording per call: keep apply_to_gpt's runner for many steps
        return model.head(AutoBlocks(parse_plan(plan))(list(model.blocks), x))
    x = checkpoint_sequential(list(model.blocks), x, plan, preserve_rng_state=preserve_rng_state)
    return model.head(x)  # (B, T, V)


class CheckpointedBlocks:
    """The blocks runner installed by apply_to_gpt: remembers the plan and resolved budgets."""

    def __init__(self, plan, store=None) -> None:
        self.plan = parse_plan(plan)
        self.store = store  # how kept block inputs are stored (executor.run_schedule); None: whole
        self.resolved: dict = {}  # (shape, dtype) of the blocks' input -> concrete plan

    def __call__(self, blocks, x) -> Tensor:
        if not is_grad_enabled():  # evaluation: nothing is saved, so there is nothing to checkpoint
            for block in blocks:
                x = block(x)
            return x
        plan = self.plan
        if isinstance(plan, Budget):
            key = (x.shape, str(x.dtype))
            if key not in self.resolved:
                self.resolved[key] = resolve_plan(plan, blocks, x, measure_layer_cost(blocks[0], x))
            plan = self.resolved[key]
        return checkpoint_sequential(blocks, x, plan, store=self.store)  # (B, T, C)


class AutoBlocks:
    """The blocks runner of an auto plan: the blocks' operations as one graph (auto.py), one
    recording and plan per input shape. Also the runner of a pipeline stage's layers."""

    def __init__(self, plan: Auto) -> None:
        self.plan = plan
        self.runs: dict = {}  # (shape, dtype) of the input -> AutoCheckpoint

    def __call__(self, blocks, x) -> Tensor:
        if not is_grad_enabled():
            for block in blocks:
                x = block(x)
            return x
        key = (x.shape, str(x.dtype))
        if key not in self.runs:
            self.runs[key] = AutoCheckpoint(_chain(tuple(blocks)), self.plan.rule)
        return self.runs[key](x)  # (B, T, C)


def _chain(blocks: tuple):
    """The blocks as one function of x (a closure: state.py finds their dropout generators in it)."""
    def run(x):
        for block in blocks:
            x = block(x)
        return x
    return run


def apply_to_gpt(model, plan, store=None):
    """Make model(idx) run its blocks under `plan` ("none" restores the plain forward). Returns model.
    store: how kept block inputs are stored (partitioned activations); None keeps them whole."""
    plan = parse_plan(plan)
    selective_recomputation(model.blocks, isinstance(plan, Selective))
    if isinstance(plan, Auto):
        if store is not None:
            raise ValueError(f"--checkpoint {plan} keeps tensors of the graph, not block inputs: it cannot be "
                             "combined with --partition-activations; use a chain plan (sqrt, every:K) for that")
        model.blocks_runner = AutoBlocks(plan)
        return model
    blocks = chain_plan(plan)
    model.blocks_runner = None if isinstance(blocks, NoCheckpoint) else CheckpointedBlocks(blocks, store)
    return model


def selective_recomputation(blocks, on: bool = True) -> None:
    """Run the attention core of each block under checkpoint() (on) or plainly (off).

    Korthikanti et al. 2022 (arXiv 2205.05198, §5): the core's saved tensors -- the softmax output,
    the dropout mask and the dropped probabilities, 3·B·H·T² numbers per block here -- are the
    ones that grow with T², while recomputing them costs only the core's own FLOPs (a few percent
    of a block's). The core keeps its inputs q, k, v instead."""
    for block in blocks:
        block.attn.core_runner = checkpoint if on else None


def current_plan(model):
    """The plan installed by apply_to_gpt (a plan object), or none."""
    runner = model.blocks_runner
    if isinstance(runner, AutoBlocks):
        return runner.plan
    blocks = runner.plan if isinstance(runner, CheckpointedBlocks) else NoCheckpoint()
    selective = any(block.attn.core_runner is not None for block in model.blocks)
    return Selective(blocks) if selective else blocks
