"""The executor: run a schedule of actions (actions.py) over a chain of layers, inside autograd.

The schedules are those of plans.py (uniform segments, Chen et al., arXiv 1604.06174) and
revolve.py (Griewank & Walther, ACM TOMS 2000); this file only runs them, one action at a time,
and the counts it produces (t(n, C) + n layer forwards for revolve, n − ⌈√n⌉ extra for sqrt) are
measured by whoever counts the layers' calls.

The whole chain is one autograd Function, `ScheduledChain`, whose inputs are the chain's input x_0
and the parameters of every layer. Its forward runs the schedule's forward part (snapshots,
advances, and the recording of the last layers, whose output is the chain's output); its backward
runs the rest: restore, advance, record, and Backprop, which differentiates one recorded range
with `engine.grad` (targets: the range's input leaf and its layers' parameters) and passes the
input gradient on to the next Backprop as its seed. Parameter gradients of all ranges are summed in
backward order (layer n first, as the engine itself sums the contributions to a shared weight) and
returned to the outer engine, which accumulates them like any other Function's — see
checkpoint.py for why that keeps gradients bitwise equal to an unchecked chain, and what it means
for the split backward (I computes everything, W hands the weight gradients over).

Memory is measured, not assumed: snapshots are registered in the engine's saved-tensor ledger
(refimpl.autograd.saved_tensors) while kept, and recorded layers register their own saved arrays
as usual, so the ledger's peak is the schedule's real peak. A state kept in a snapshot and saved
again by the layer recorded from it is one array, counted once.

Random state. Every layer's first forward happens in the forward pass, in chain order; the
executor captures the state of the layer's generators (state.py) just before it, and every later
forward of that layer (advance or record) runs with that state set, then the current one put back.
So each layer draws the same dropout masks however often it is recomputed.
"""

from __future__ import annotations

from refimpl.autograd import engine
from refimpl.autograd.grad_mode import enable_grad, no_grad
from refimpl.autograd.saved import saved_tensors
from refimpl.autograd.tensor import Tensor
from refimpl.nn import batch_rows

from .actions import Advance, Backprop, Free, Record, Restore, Snapshot, forward_part
from .checkpoint import RecomputingFunction
from .state import RngReplay, capture_rng, check_all_declared


class ChainRun:
    """The state of one execution: snapshots, the state in hand, the recorded range, the gradient."""

    def __init__(self, layers, layer_params: list[list], generators: list[list], actions: list,
                 preserve_rng_state: bool, store=None) -> None:
        self.layers = layers  # layer k (1-based) is layers[k - 1]
        self.layer_params = layer_params  # parameters of layer k: layer_params[k - 1]
        self.generators = generators
        self.preserve_rng = preserve_rng_state
        self.rng_before: dict[int, list] = {}  # layer -> generator states before its first forward
        self.actions = actions
        self.n_forward = forward_part(actions)
        self.snapshots: dict[int, tuple] = {}  # position -> (kept array, registered in the ledger; shape)
        self.store = store  # None: keep snapshots whole; else store.pack / store.unpack (see run_schedule)
        self.hand: tuple | None = None  # (position, Tensor)
        self.recorded: tuple | None = None  # (start, stop, input leaf, output Tensor)
        self.grad: tuple | None = None  # (position, gradient array or None)
        self.param_grads: dict[int, object] = {}  # id(parameter) -> summed gradient
        self.x0_requires_grad = False  # set by the forward: whether the chain's input wants a gradient
        self.done = False

    # --- one layer ----------------------------------------------------------------------------
    def call(self, k: int, x: Tensor) -> Tensor:
        gens = self.generators[k - 1]
        if not gens or not self.preserve_rng:
            return self.layers[k - 1](x)
        if k not in self.rng_before:  # the first forward of layer k: remember its random state
            self.rng_before[k] = capture_rng(gens)
            return self.layers[k - 1](x)
        with RngReplay(gens, self.rng_before[k]):
            return self.layers[k - 1](x)

    # --- the actions --------------------------------------------------------------------------
    def run(self, actions) -> None:
        for a in actions:
            match a:
                case Snapshot():
                    self._snapshot(a)
                case Free():
                    self._free(a)
                case Restore():
                    self._restore(a)
                case Advance():
                    self._advance(a)
                case Record():
                    self._record(a)
                case Backprop():
                    self._backprop(a)
                case _:
                    raise TypeError(f"unknown action {a!r}")

    def _snapshot(self, a: Snapshot) -> None:
        array = self.hand[1].data
        kept = array if self.store is None else self.store.pack(array)
        saved_tensors.add(kept)
        self.snapshots[a.at] = (kept, array.shape)

    def _free(self, a: Free) -> None:
        saved_tensors.remove(self.snapshots.pop(a.at)[0])

    def _restore(self, a: Restore) -> None:
        kept, shape = self.snapshots[a.at]
        self.hand = (a.at, Tensor(kept if self.store is None else self.store.unpack(kept, shape)))

    def _advance(self, a: Advance) -> None:
        x = self.hand[1]
        with no_grad():
            for k in range(a.start + 1, a.stop + 1):
                x = self.call(k, x)
        self.hand = (a.stop, x)

    def _record(self, a: Record) -> None:
        leaf = Tensor(self.hand[1].data, requires_grad=a.start > 0 or self.x0_requires_grad)
        x = leaf
        with enable_grad():
            for k in range(a.start + 1, a.stop + 1):
                x = self.call(k, x)
        self.recorded = (a.start, a.stop, leaf, x)
        self.hand = (a.stop, x)

    def _backprop(self, a: Backprop) -> None:
        start, stop, leaf, out = self.recorded
        params = _unique(p for k in range(start + 1, stop + 1) for p in self.layer_params[k - 1])
        targets = ([leaf] if leaf.requires_grad else []) + params
        check_all_declared([out], targets, "checkpoint_sequential")
        g = self.grad[1]
        if out.requires_grad and g is not None:
            found = engine.grad([out], targets, [g])
        else:
            found = [None] * len(targets)
        for p, gp in zip(params, found[len(targets) - len(params):]):
            if gp is not None:
                previous = self.param_grads.get(id(p))
                self.param_grads[id(p)] = gp if previous is None else previous + gp
        self.grad = (start, found[0] if leaf.requires_grad else None)
        self.recorded, self.hand = None, None

    # --- cleanup ------------------------------------------------------------------------------
    def drop(self) -> None:
        """Free whatever is still held (a backward that never ran, or failed half-way)."""
        for kept, _ in self.snapshots.values():
            saved_tensors.remove(kept)
        self.snapshots = {}
        if self.recorded is not None:
            _release_graph(self.recorded[3])
        self.recorded = self.hand = None


class ScheduledChain(RecomputingFunction):
    """Positional inputs: x_0, then the parameters of all layers (each once)."""

    def forward(self, x0, *param_arrays, run: ChainRun, params: list):
        self.chain, self.params = run, params
        if not self._recording:  # nothing needs a gradient: a plain forward
            x = Tensor(x0)
            with no_grad():
                for k in range(1, len(run.layers) + 1):
                    x = run.call(k, x)
            return x.data
        if run.store is None:  # (with a store, the snapshot of position 0 is what keeps x_0)
            self.save_for_backward(x0)
        self.rows = batch_rows.current()  # which rows of which batch: restored for the recomputations
        run.x0_requires_grad = self.needs_input_grad[0]
        run.hand = (0, Tensor(x0))
        run.run(run.actions[:run.n_forward])
        return run.hand[1].data

    def input_gradients(self, grad_outputs) -> tuple:
        run = self.chain
        if run.done:
            raise RuntimeError("checkpoint_sequential: a checkpointed chain can be backpropagated "
                               "once; run its forward again for another backward")
        run.done = True
        run.grad = (len(run.layers), grad_outputs[0])
        with batch_rows.restored(self.rows):
            run.run(run.actions[run.n_forward:])
        return (run.grad[1],) + tuple(run.param_grads.get(id(p)) for p in self.params)

    def release(self) -> None:
        super().release()
        self.chain.drop()


def run_schedule(layers, x: Tensor, actions: list, layer_params: list[list], generators: list[list],
                 preserve_rng_state: bool = True, store=None) -> Tensor:
    """x_n of the chain, computed (and later reversed) by the schedule `actions`.

    store: how snapshots are kept -- None, whole; or an object with pack(array) -> the array to
    keep and unpack(kept, shape) -> the whole array again (ZeRO-R's partitioned activations keep
    1/t of each on every tensor-parallel rank: refimpl/parallel/tensor_parallel/partition.py)."""
    params = _unique(p for ps in layer_params for p in ps)
    run = ChainRun(layers, layer_params, generators, actions, preserve_rng_state, store)
    return ScheduledChain.apply(x, *params, run=run, params=params)


def _unique(items) -> list:
    seen, out = set(), []
    for item in items:
        if id(item) not in seen:
            seen.add(id(item))
            out.append(item)
    return out


def _release_graph(output: Tensor) -> None:
    """Release the saved arrays of every node behind `output` (a graph that will not be used)."""
    stack, seen = [output], set()
    while stack:
        t = stack.pop()
        if not isinstance(t, Tensor) or t.grad_fn is None or id(t.grad_fn) in seen:
            continue
        seen.add(id(t.grad_fn))
        if t.grad_fn.saved is not None:
            t.grad_fn.release()
        stack.extend(t.grad_fn.inputs)
