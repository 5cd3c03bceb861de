"""Module: a tree of layers that owns Parameters, with forward and backward hooks.

    named_parameters()   every Parameter once (a tied weight is listed under its first name)
    state_dict()         {name: NumPy array copy};  load_state_dict(sd) copies values in place, so
                         parameters that are views into a flat buffer stay views
    train() / eval()     switch dropout on and off
    zero_grad()          zero gradients in place (flat gradient buffers stay intact)

Hooks, in the order they fire for one call (tests/test_engine_decisions.py checks this order):

    forward pre-hook   hook(module, args) -> new args or None          before forward
    forward hook       hook(module, args, output) -> new output or None  after forward
    backward pre-hook  hook(module, grad_output)                       when d(loss)/d(output) is ready
    backward hook      hook(module, grad_input, grad_output)           when d(loss)/d(floating inputs)
                                                                        is ready

Backward hooks work by routing the module's floating inputs and its outputs through identity
Functions whose backward calls the hooks (as PyTorch does). If no input requires grad (a first
layer fed with data), the backward hook fires right after the backward pre-hook, with grad_input
all None; a parameter's own post-accumulate-grad hook is the way to learn that its gradient is done.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from refimpl import backend
from refimpl.autograd import recording
from refimpl.autograd.function import Function
from refimpl.autograd.tensor import HookHandle, Parameter, Tensor


class Module:
    def __init__(self) -> None:
        object.__setattr__(self, "_parameters", {})
        object.__setattr__(self, "_modules", {})
        object.__setattr__(self, "training", True)
        object.__setattr__(self, "_forward_pre_hooks", [])
        object.__setattr__(self, "_forward_hooks", [])
        object.__setattr__(self, "_backward_pre_hooks", [])
        object.__setattr__(self, "_backward_hooks", [])

    def __setattr__(self, name, value) -> None:
        if isinstance(value, Parameter):
            self._parameters[name] = value
        elif isinstance(value, Module):
            self._modules[name] = value
        object.__setattr__(self, name, value)

    # --- tree walking -------------------------------------------------------------------------
    def named_modules(self, prefix: str = "") -> Iterator[tuple[str, Module]]:
        yield prefix, self
        for name, child in self._modules.items():
            yield from child.named_modules(f"{prefix}.{name}" if prefix else name)

    def modules(self) -> Iterator[Module]:
        for _, m in self.named_modules():
            yield m

    def named_parameters(self) -> Iterator[tuple[str, Parameter]]:
        seen = set()
        for module_name, module in self.named_modules():
            for name, p in module._parameters.items():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield (f"{module_name}.{name}" if module_name else name), p

    def parameters(self) -> list[Parameter]:
        return [p for _, p in self.named_parameters()]

    def num_parameters(self) -> int:
        return sum(p.size for p in self.parameters())

    # --- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {name: backend.to_host(p.data).copy() for name, p in self.named_parameters()}

    def load_state_dict(self, state: dict, strict: bool = True) -> None:
        own = dict(self.named_parameters())
        missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
        if strict and (missing or unexpected):
            raise ValueError(f"load_state_dict: missing keys {missing}, unexpected keys {unexpected}")
        for name, p in own.items():
            if name not in state:
                continue
            value = np.asarray(state[name])
            if value.shape != p.shape:
                raise ValueError(f"load_state_dict: {name} has shape {value.shape} in the state dict "
                                 f"but {p.shape} in the model")
            p.data[...] = backend.asarray(value, dtype=p.dtype)

    def train(self, mode: bool = True) -> Module:
        for m in self.modules():
            object.__setattr__(m, "training", mode)
        return self

    def eval(self) -> Module:
        return self.train(False)

    def zero_grad(self) -> None:
        for p in self.parameters():
            if p.grad is not None:
                p.grad[...] = 0

    # --- hooks --------------------------------------------------------------------------------
    def register_forward_pre_hook(self, hook):
        return _add(self._forward_pre_hooks, hook)

    def register_forward_hook(self, hook):
        return _add(self._forward_hooks, hook)

    def register_full_backward_pre_hook(self, hook):
        return _add(self._backward_pre_hooks, hook)

    def register_full_backward_hook(self, hook):
        return _add(self._backward_hooks, hook)

    def forward(self, *args, **kwargs):  # pragma: no cover - abstract
        raise NotImplementedError

    def __call__(self, *args, **kwargs):
        recording.module_entered(self)  # recording mode sees module calls (autograd/recording.py)
        for hook in self._forward_pre_hooks:
            replaced = hook(self, args)
            if replaced is not None:
                args = replaced if isinstance(replaced, tuple) else (replaced,)
        backward_hooks = self._backward_pre_hooks or self._backward_hooks
        state = None
        if backward_hooks:
            state = _BackwardHookState(self)
            args = state.wrap_inputs(args)
        output = self.forward(*args, **kwargs)
        for hook in self._forward_hooks:
            replaced = hook(self, args, output)
            if replaced is not None:
                output = replaced
        if state is not None:
            output = state.wrap_outputs(output)
        recording.module_left(self)
        return output


class ModuleList(Module):
    """An indexable list of modules, registered as children "0", "1", ..."""

    def __init__(self, modules=()) -> None:
        super().__init__()
        for m in modules:
            self.append(m)

    def append(self, module: Module) -> None:
        setattr(self, str(len(self._modules)), module)

    def __getitem__(self, i):
        items = list(self._modules.values())
        return ModuleList(items[i]) if isinstance(i, slice) else items[i]

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules.values())


def _add(hooks: list, hook):
    hooks.append(hook)
    return HookHandle(hooks, hook)


class _BackwardHookState:
    """Identity Functions around one call of a module, whose backward calls its hooks."""

    def __init__(self, module: Module) -> None:
        self.module = module
        self.grad_output = None
        self.input_positions: list[int] = []

    def wrap_inputs(self, args: tuple) -> tuple:
        self.input_positions = [i for i, a in enumerate(args)
                                if isinstance(a, Tensor) and a.requires_grad and a.dtype.kind == "f"]
        if not self.input_positions:
            return args
        wrapped = _IdentityHook.apply(*[args[i] for i in self.input_positions], callback=self._inputs_done)
        wrapped = wrapped if isinstance(wrapped, tuple) else (wrapped,)
        args = list(args)
        for i, w in zip(self.input_positions, wrapped):
            args[i] = w
        return tuple(args)

    def wrap_outputs(self, output):
        outputs = output if isinstance(output, tuple) else (output,)
        positions = [i for i, o in enumerate(outputs) if isinstance(o, Tensor) and o.requires_grad]
        if not positions:
            return output
        wrapped = _IdentityHook.apply(*[outputs[i] for i in positions], callback=self._outputs_ready)
        wrapped = wrapped if isinstance(wrapped, tuple) else (wrapped,)
        outputs = list(outputs)
        for i, w in zip(positions, wrapped):
            outputs[i] = w
        return tuple(outputs) if isinstance(output, tuple) else outputs[0]

    def _outputs_ready(self, grads: tuple) -> None:
        self.grad_output = grads
        for hook in self.module._backward_pre_hooks:
            hook(self.module, grads)
        if not self.input_positions:
            self._inputs_done((None,))

    def _inputs_done(self, grads: tuple) -> None:
        for hook in self.module._backward_hooks:
            hook(self.module, grads, self.grad_output)


class _IdentityHook(Function):
    """Passes tensors through unchanged; its backward reports their gradients to a callback."""

    def forward(self, *arrays, callback):
        self.callback = callback
        return arrays if len(arrays) > 1 else arrays[0]

    def backward(self, *grads, needs):
        self.callback(grads)
        return grads
