"""What a recomputation must see again: the parameters a function uses and its random state.

A recomputed forward must be the same computation as the original one: the same weights (they
have not changed between forward and backward; the optimizer steps after backward) and the same
random numbers. refimpl's only random layer is Dropout, and each Dropout module owns a NumPy
Generator (`module.generator`). So checkpointing needs to find two things from a callable:

    parameters_of(fn)   the Parameters fn differentiates through: the recomputing Function
                        declares them as inputs, so the engine hands their gradients out (and
                        can split them off into the weight-gradient pass W);
    generators_of(fn)   the generators fn draws from: their state is captured before the first
                        forward and put back around every recomputation (RngReplay).

Both are found by walking the Modules reachable from fn, without running it: fn itself if it is a
Module, the Module of a bound method (`block.forward`), the function and arguments of a
functools.partial, the objects captured by a closure (`lambda x: block(x)`), lists and tuples of
those. Any Module with a `generator` attribute counts, not only Dropout. A function that reaches
its weights another way (a global, an attribute of a non-Module object) is not understood: pass
such weights as arguments, or wrap the function in a Module. checkpoint() checks this during
backward and raises instead of dropping a gradient.

Production systems do the same with less ceremony: PyTorch's checkpoint saves and restores the
global CPU and CUDA generator states (`preserve_rng_state=True`), because its dropout draws from a
global generator; refimpl's generators belong to modules, so the walk is what finds them.
"""

from __future__ import annotations

import functools

from refimpl.autograd.tensor import Parameter, Tensor
from refimpl.nn.module import Module


def modules_of(*objects) -> list[Module]:
    """The Modules reachable from `objects` (callables, Modules, containers), each once, in order."""
    found: dict[int, Module] = {}
    seen: set[int] = set()

    def visit(obj, depth: int) -> None:
        if id(obj) in seen or depth > 4:
            return
        seen.add(id(obj))
        if isinstance(obj, Module):
            for m in obj.modules():
                found.setdefault(id(m), m)
        elif isinstance(obj, functools.partial):
            for part in (obj.func, *obj.args, *obj.keywords.values()):
                visit(part, depth + 1)
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                visit(item, depth + 1)
        elif hasattr(obj, "__self__") and not isinstance(obj, type):  # bound method
            visit(obj.__self__, depth + 1)
            visit(getattr(obj, "__func__", None), depth + 1)
        elif callable(obj) and getattr(obj, "__closure__", None):
            for cell in obj.__closure__:
                try:
                    visit(cell.cell_contents, depth + 1)
                except ValueError:  # an empty cell
                    pass

    for obj in objects:
        visit(obj, 0)
    return list(found.values())


def _closure_parameters(*objects) -> list[Parameter]:
    """Parameters captured directly by closures or partials (not through a Module)."""
    params = []
    for obj in objects:
        cells = []
        if isinstance(obj, functools.partial):
            cells = [*obj.args, *obj.keywords.values()]
        elif callable(obj) and getattr(obj, "__closure__", None):
            for cell in obj.__closure__:
                try:
                    cells.append(cell.cell_contents)
                except ValueError:
                    pass
        params.extend(c for c in cells if isinstance(c, Parameter))
    return params


def parameters_of(*objects) -> list[Parameter]:
    """The Parameters that require grad, reachable from `objects` (see the module docstring)."""
    params: dict[int, Parameter] = {}
    for m in modules_of(*objects):
        for p in m._parameters.values():
            if p is not None and p.requires_grad:
                params.setdefault(id(p), p)
    for p in _closure_parameters(*objects):
        if p.requires_grad:
            params.setdefault(id(p), p)
    return list(params.values())


def generators_of(*objects) -> list:
    """The random generators (`module.generator`) of the Modules reachable from `objects`."""
    gens: dict[int, object] = {}
    for m in modules_of(*objects):
        g = getattr(m, "generator", None)
        if g is not None and hasattr(g, "bit_generator"):
            gens.setdefault(id(g), g)
    return list(gens.values())


def capture_rng(generators: list) -> list:
    """The current state of each generator (a small dict; a PCG64 state is two 128-bit integers)."""
    return [g.bit_generator.state for g in generators]


class RngReplay:
    """Context manager: run with `generators` set to `states`, then put back what they held.

    Putting the current state back afterwards matters: the recomputation happens during backward,
    after the whole forward has drawn its numbers, and the next forward must continue from there
    as if no recomputation had happened.
    """

    def __init__(self, generators: list, states: list | None) -> None:
        self.generators, self.states = generators, states

    def __enter__(self):
        if self.states is not None:
            self._current = capture_rng(self.generators)
            for g, s in zip(self.generators, self.states):
                g.bit_generator.state = s
        return self

    def __exit__(self, *exc):
        if self.states is not None:
            for g, s in zip(self.generators, self._current):
                g.bit_generator.state = s
        return False


def leaves_requiring_grad(outputs) -> list[Tensor]:
    """The leaf tensors that require grad in the graph recorded behind `outputs`."""
    leaves, seen_nodes, seen_leaves = [], set(), set()
    stack = [t for t in outputs if isinstance(t, Tensor)]
    while stack:
        t = stack.pop()
        if not t.requires_grad:
            continue
        if t.grad_fn is None:
            if id(t) not in seen_leaves:
                seen_leaves.add(id(t))
                leaves.append(t)
            continue
        if id(t.grad_fn) in seen_nodes:
            continue
        seen_nodes.add(id(t.grad_fn))
        stack.extend(a for a in t.grad_fn.inputs if isinstance(a, Tensor))
    return leaves


def check_all_declared(outputs, declared, where: str) -> None:
    """Raise if the recomputed graph differentiates through a tensor that was not declared.

    Such a tensor (a weight reached through a global, say) would get no gradient at all: the
    recomputing Function only hands out gradients of its declared inputs.
    """
    known = {id(t) for t in declared}
    missing = [t for t in leaves_requiring_grad(outputs) if id(t) not in known]
    if missing:
        shapes = ", ".join(f"{type(t).__name__}{tuple(t.shape)}" for t in missing[:4])
        raise RuntimeError(
            f"{where}: the recomputed function differentiates through {len(missing)} tensor(s) that "
            f"were neither arguments nor parameters of a Module reachable from it ({shapes}); pass "
            "them as arguments or call a Module, or they would get no gradient")
