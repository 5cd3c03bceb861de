"""A whole optimizer state by parameter name: what a sharded checkpoint stores for a trainer that
holds every parameter whole (local_trainer.LocalTrainer, parallel.data_parallel.DataParallel), and how it is
loaded back. Sharded trainers store blocks of flat buffers instead (parallel/zero/strategy.py).

    masters   the arrays the optimizer updates: the parameters themselves, or float32 master
              weights under mixed precision (the float16 parameters are then copied from them)
    states    one optimizer state dict per parameter (optim/base.py: arrays and a "step" counter)
"""

from __future__ import annotations

from refimpl import backend


def whole_pieces(named: list, masters: list, states: list) -> list:
    """[(name, 0, numel, {"master": flat host array, state key: flat host array})] per parameter."""
    pieces = []
    for (name, p), master, state in zip(named, masters, states):
        arrays = {"master": backend.to_host(master).reshape(-1)}
        arrays.update({k: backend.to_host(v).reshape(-1) for k, v in state.items() if hasattr(v, "nbytes")})
        pieces.append((name, 0, p.size, arrays))
    return pieces


def load_whole(named: list, masters: list, states: list, saved_masters: dict, saved_states: dict, step: int) -> None:
    """Overwrite masters (and the parameters copied from them) and states from whole arrays by name:
    saved_masters {name: array}, saved_states {state key: {name: array}}."""
    for (name, p), master, state in zip(named, masters, states):
        master[...] = backend.asarray(saved_masters[name].reshape(p.shape), dtype=master.dtype)
        if master is not p.data:
            p.data[...] = master
        for key, value in state.items():
            if hasattr(value, "nbytes"):
                value[...] = backend.asarray(saved_states[key][name].reshape(value.shape), dtype=value.dtype)
        state["step"] = step
