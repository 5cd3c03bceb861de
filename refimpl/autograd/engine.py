"""The reverse-mode engine: one backward, or a backward split in two halves.

Backward visits the recorded graph in a topological order (every node before the nodes that
produced its inputs), calls each Function's backward with the gradients of its outputs, and sums
the gradients that reach a tensor from several uses. A leaf's gradient for the whole pass is
summed first, passed to its hooks, then accumulated into `leaf.grad` (always `+=`, so micro-batch
gradients add up), and its post-accumulate hooks fire.

Backward in two halves (zero-bubble pipelines, Qi et al., arXiv 2401.10241, section 2):

    B = I + W
    I (input-gradient pass): gradients with respect to activations, propagated through every
      node; gradients that flow into Parameters are NOT computed. Each node that has Parameter
      inputs queues its weight work instead: (node, its output gradients, which inputs need one).
    W (weight-gradient pass): runs the queued work in the order I queued it, computing the
      Parameter gradients and accumulating them exactly as B would.

Because every Function computes each input's gradient by the same arithmetic whichever others are
requested, and W accumulates in B's order, I then W equals B bit for bit. A node's saved tensors
are released after its last use: after B, after I if it queued no weight work, else after W.
"""

from __future__ import annotations

from collections.abc import Sequence

from refimpl import backend

from . import grad_mode
from .tensor import Parameter, Tensor


class WeightGradWork:
    """The deferred weight-gradient half of a split backward. Call run() exactly once."""

    def __init__(self, pending: list, leaves: _LeafAccumulator, retain_graph: bool) -> None:
        self._pending, self._leaves, self._retain = pending, leaves, retain_graph  # [(node, grads, needs)]
        self.done = False

    def __len__(self) -> int:
        return len(self._pending)

    def run(self) -> None:
        if self.done:
            raise RuntimeError("this weight-gradient work has already run")
        with grad_mode.no_grad():
            for fn, grads, needs in self._pending:
                input_grads = fn.backward(*grads, needs=needs)
                for index, needed in enumerate(needs):
                    if needed:
                        self._leaves.add(fn.inputs[index], input_grads[index])
                if not self._retain:
                    fn.release()
        self._pending = []
        self.done = True


class _LeafAccumulator:
    """Sums each leaf's contributions of one pass; on the last one runs hooks and accumulates."""

    def __init__(self, counts: dict, capture: dict | None) -> None:
        self.remaining = counts  # id(leaf) -> contributions still to come
        self.partial: dict = {}
        self.capture = capture  # functional grad(): id(leaf) -> result slot, .grad untouched

    def add(self, leaf: Tensor, grad) -> None:
        key = id(leaf)
        if self.remaining.get(key, 0) <= 0:  # counted before the pass: one contribution per use
            raise RuntimeError(f"internal error in backward: a gradient contribution reached a leaf of shape "
                               f"{tuple(leaf.shape)} that expected no more (its pending count would go negative)")
        if grad is not None:
            previous = self.partial.get(key)
            self.partial[key] = grad if previous is None else previous + grad
        self.remaining[key] -= 1
        if self.remaining[key] == 0:
            total = self.partial.pop(key, None)
            if total is not None:
                self._finish(leaf, total)

    def _finish(self, leaf: Tensor, total) -> None:
        if total.dtype != leaf.dtype:  # a float16 leaf's gradient was computed in float32
            total = total.astype(leaf.dtype)
        if self.capture is not None:  # functional grad(): nothing is accumulated, no hook runs
            self.capture[id(leaf)] = total
            return
        for hook in leaf._hooks:
            replaced = hook(total)
            if replaced is not None:
                total = replaced
        if leaf.grad is None:
            leaf.grad = total.copy()  # own it: backward results may alias other arrays
        else:
            leaf.grad += total
        for hook in leaf._post_accumulate_hooks:
            hook(leaf)


def _topological_order(roots: list) -> list:
    """Every node before the nodes that produced its inputs (reverse DFS post-order)."""
    order, visited = [], set()
    for root in roots:
        stack = [(root, False)]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                order.append(node)
                continue
            if id(node) in visited:
                continue
            visited.add(id(node))
            stack.append((node, True))
            for t in node.inputs:
                if isinstance(t, Tensor) and t.grad_fn is not None and id(t.grad_fn) not in visited:
                    stack.append((t.grad_fn, False))
    order.reverse()
    return order


def _edges_needed(order: list, targets: set | None) -> dict:
    """For each node, which inputs need a gradient. With `targets` (functional grad), only edges
    that lead to one of the target tensors are followed."""
    needs = {}
    leads: dict[int, bool] = {}
    for node in reversed(order):  # inputs' producers first
        mask = []
        for t in node.inputs:
            if not (isinstance(t, Tensor) and t.requires_grad):
                mask.append(False)
            elif targets is None:
                mask.append(True)
            else:
                mask.append(id(t) in targets or (t.grad_fn is not None and leads.get(id(t.grad_fn), False)))
        needs[id(node)] = tuple(mask)
        leads[id(node)] = any(mask)
    return needs


def _add_output_grad(node_grads: dict, t: Tensor, g) -> None:
    """Add g to the gradient of output t.output_index of t's node (summing a tensor's several uses)."""
    slots = node_grads.setdefault(id(t.grad_fn), [None] * len(t.grad_fn.output_meta))
    i = t.output_index
    slots[i] = g if slots[i] is None else slots[i] + g


def _run(tensors, grad_tensors, *, retain_graph, defer_weight_grads, targets=None):
    xp = backend.xp()
    tensors = list(tensors)
    if grad_tensors is None:
        grad_tensors = [None] * len(tensors)
    if len(grad_tensors) != len(tensors):
        raise ValueError(f"backward got {len(tensors)} tensors but {len(grad_tensors)} gradients")
    node_grads: dict[int, list] = {}
    roots = []
    leaf_roots = []  # backward from a leaf: its gradient is simply g
    capture = {} if targets is not None else None
    target_ids = None if targets is None else {id(t) for t in targets}
    for t, g in zip(tensors, grad_tensors):
        if not t.requires_grad:
            raise RuntimeError("backward through a tensor that does not require grad (was it computed under no_grad?)")
        if g is None:
            if t.size != 1:
                raise RuntimeError(f"backward of a tensor of shape {t.shape} needs an explicit gradient")
            g = xp.ones_like(t.data)
        g = g.data if isinstance(g, Tensor) else xp.asarray(g, dtype=t.dtype)
        if g.shape != t.shape:
            raise ValueError(f"gradient of shape {g.shape} given for a tensor of shape {t.shape}")
        if t.grad_fn is None:
            leaf_roots.append((t, g))
            continue
        _add_output_grad(node_grads, t, g)
        roots.append(t.grad_fn)

    order = _topological_order(roots)
    needs_of = _edges_needed(order, target_ids)
    counts: dict[int, int] = {}  # id(leaf) -> how many gradient contributions it will receive
    for t, _ in leaf_roots:
        counts[id(t)] = counts.get(id(t), 0) + 1
    for node in order:
        for t, needed in zip(node.inputs, needs_of[id(node)]):
            if needed and t.grad_fn is None:
                counts[id(t)] = counts.get(id(t), 0) + 1
    leaves = _LeafAccumulator(counts, capture)
    for t, g in leaf_roots:
        leaves.add(t, g)
    deferred = []
    nonleaf_results = {}

    with grad_mode.no_grad():
        for node in order:
            needs = needs_of[id(node)]
            grads = node_grads.pop(id(node), None)
            if grads is None:  # reached, but no gradient flows into it (e.g. an input a checkpoint ignores)
                for t, needed in zip(node.inputs, needs):
                    if needed and t.grad_fn is None:
                        leaves.add(t, None)  # a contribution of nothing: the leaf's count must still reach 0
                if not retain_graph:
                    node.release()
                continue
            if any(needs) and node.released:
                raise RuntimeError(f"{node.name}: saved tensors were already freed; "
                                   "pass retain_graph=True to backward twice through a graph")
            grads = [xp.zeros(shape, dtype) if g is None else g for g, (shape, dtype) in zip(grads, node.output_meta)]
            for index, hooks in node.output_hooks.items():
                for hook in hooks:
                    replaced = hook(grads[index])
                    if replaced is not None:
                        grads[index] = replaced
            if target_ids is not None:
                for index in range(len(grads)):
                    nonleaf_results[(id(node), index)] = grads[index]
            if defer_weight_grads:  # I now (activations), W later (Parameters)
                needs_now = tuple(n and not isinstance(t, Parameter) for n, t in zip(needs, node.inputs))
                needs_later = tuple(n and isinstance(t, Parameter) for n, t in zip(needs, node.inputs))
            else:
                needs_now, needs_later = needs, (False,) * len(needs)
            if any(needs_now):
                input_grads = node.backward(*grads, needs=needs_now)
                for t, needed, g in zip(node.inputs, needs_now, input_grads):
                    if not needed:
                        continue
                    if t.grad_fn is None:
                        leaves.add(t, g)
                    elif g is not None:
                        _add_output_grad(node_grads, t, g)
            if any(needs_later):
                deferred.append((node, grads, needs_later))
            elif not retain_graph:
                node.release()

    if capture is not None:
        return [capture.get(id(t)) if t.grad_fn is None else nonleaf_results.get((id(t.grad_fn), t.output_index))
                for t in targets]
    if defer_weight_grads:
        return WeightGradWork(deferred, leaves, retain_graph)
    return None


def backward(tensors: Sequence[Tensor], grad_tensors=None, *, retain_graph: bool = False,
             defer_weight_grads: bool = False):
    """Accumulate the gradients of `tensors` (seeded with `grad_tensors`) into every leaf's .grad.

    With defer_weight_grads=True this is the input-gradient pass I: it returns a WeightGradWork
    whose run() is the weight-gradient pass W. Otherwise it is the full backward B.
    """
    return _run(tensors, grad_tensors, retain_graph=retain_graph, defer_weight_grads=defer_weight_grads)


def grad(outputs, inputs, grad_outputs=None, *, retain_graph: bool = False) -> list:
    """d(outputs)/d(inputs) as a list of arrays (None where an input is unreachable).

    Nothing is accumulated into any .grad, and leaf hooks do not run (they belong to accumulation:
    a leaf hook sees the whole gradient of a backward pass once, as it is accumulated). Hooks on
    non-leaf tensors on the way do run.
    """
    outputs = [outputs] if isinstance(outputs, Tensor) else list(outputs)
    inputs = [inputs] if isinstance(inputs, Tensor) else list(inputs)
    if grad_outputs is not None and not isinstance(grad_outputs, (list, tuple)):
        grad_outputs = [grad_outputs]
    return _run(outputs, grad_outputs, retain_graph=retain_graph, defer_weight_grads=False, targets=inputs)
