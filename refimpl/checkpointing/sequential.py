"""checkpoint_sequential(layers, x, plan): a chain of layers under a checkpointing plan.

    y = checkpoint_sequential([block_1, ..., block_n], x, "sqrt")

is y = block_n(... block_1(x)), with the same value and, after backward, bitwise the same
gradients as the plain loop, but holding fewer activations: the plan (plans.py) decides which
layer inputs are kept and which layers run again during backward. "none" *is* the plain loop;
every other plan becomes a schedule of actions (actions.py) that the executor (executor.py) runs
inside the autograd engine. Each layer is a Module or a callable of one Tensor; its parameters and
random generators are found from it (state.py).

budget:BYTES needs the layer's memory model (LayerCost: input bytes A, bytes a recorded forward
saves R, and whether that includes its input array). Pass it as `layer_cost`, or let
`measure_layer_cost` find it: it records the first layer once on a copy of x, reads the engine's
saved-tensor ledger and releases that graph (its random state is put back). That probe is one
extra forward of the first layer, which a forward counter will see; the GPT integration (gpt_blocks.py)
measures once and reuses the result.
"""

from __future__ import annotations

from refimpl.autograd.grad_mode import enable_grad, is_enabled
from refimpl.autograd.saved import saved_tensors
from refimpl.autograd.tensor import Tensor

from .executor import _release_graph, run_schedule
from .plans import Budget, LayerCost, NoCheckpoint, actions_for, chain_plan, resolve_budget
from .state import RngReplay, capture_rng, generators_of, parameters_of


def checkpoint_sequential(layers, x: Tensor, plan="sqrt", *, preserve_rng_state: bool = True,
                          layer_cost: LayerCost | None = None, store=None) -> Tensor:
    """Run the chain `layers` on x under `plan` (a string such as "sqrt", "revolve:4", or a plan object).
    store: how the kept layer inputs are stored (executor.run_schedule); None keeps them whole."""
    layers = list(layers)
    if not layers:
        raise ValueError("checkpoint_sequential needs at least one layer")
    x = x if isinstance(x, Tensor) else Tensor(x)
    plan = resolve_plan(plan, layers, x, layer_cost)
    if isinstance(plan, NoCheckpoint) or not is_enabled():
        for layer in layers:
            x = layer(x)
        return x
    actions = actions_for(plan, len(layers))
    layer_params = [parameters_of(layer) for layer in layers]
    generators = [generators_of(layer) for layer in layers]
    return run_schedule(layers, x, actions, layer_params, generators, preserve_rng_state, store)


def resolve_plan(plan, layers, x: Tensor, layer_cost: LayerCost | None = None):
    """The concrete plan (none, every:K, sqrt, revolve:C) for this chain; budgets are resolved here.
    Of a selective plan, the chain plan (the attention cores are gpt_blocks.py's business)."""
    plan = chain_plan(plan)
    if isinstance(plan, Budget):
        cost = layer_cost if layer_cost is not None else measure_layer_cost(layers[0], x)
        plan = resolve_budget(plan.bytes, len(layers), cost)
    return plan


def measure_layer_cost(layer, x: Tensor) -> LayerCost:
    """A, R and saves_input of `layer` on an input like x, from one recorded forward (see above)."""
    probe = x.data.copy()  # a fresh array: the ledger does not hold it yet
    generators = generators_of(layer)
    before = saved_tensors.live_bytes
    saved_tensors.add(probe)
    with enable_grad(), RngReplay(generators, capture_rng(generators)):
        out = layer(Tensor(probe, requires_grad=True))
    during = saved_tensors.live_bytes
    saved_tensors.remove(probe)
    saves_input = saved_tensors.live_bytes == during  # the layer holds the probe array too
    own = during - before - probe.nbytes
    _release_graph(out)
    assert saved_tensors.live_bytes == before, "the probe's graph was not fully released"
    return LayerCost(input_bytes=x.data.nbytes, own_bytes=own, saves_input=saves_input)
