"""Sizes checked before allocation (refimpl/tools/runtime/preflight.py): the estimate bounds what a run really holds,
huge flags are refused at once, the ranks that share a host are summed, a demo is not refused."""

import argparse
import gc
import tracemalloc

import pytest
from mpi_util import REPO, check_ok, run_local, run_mpi

from refimpl.autograd import saved_tensors
from refimpl.memory import saved_bytes
from refimpl.tools.flags import add_run_arguments as add_arguments
from refimpl.tools.flags import config_from_args
from refimpl.tools.run import TrainConfig, build_model, build_task, evaluate, make_trainer, train
from refimpl.tools.runtime import preflight
from refimpl.tools.runtime.failure import AgreedError

LIMIT = preflight.LIMIT_VARIABLE


def config(**flags) -> TrainConfig:
    cfg = TrainConfig(**flags)
    cfg.check()
    return cfg


def task_sizes(cfg, task) -> tuple[int, int]:
    """(vocab, seq) as preflight.check reads them from the task."""
    vocab = getattr(task, "vocab_size", None) or task.n_classes
    return vocab, task.seq_len if cfg.model == "gpt" else 0


# Configurations big enough that arrays, not Python objects, make up their memory.
MEASURED = {
    "gpt demo": dict(),
    "gpt 4 layers": dict(n_layer=4),
    "gpt dropout": dict(dropout=0.1),
    "gpt wide": dict(d_model=256, n_head=4, batch_size=8),
    "gpt long": dict(seq_len=64, d_model=32, n_head=8, batch_size=8),
    "gpt float64, 2 micro-batches": dict(dtype="float64", batch_size=16, grad_accum=2),
    "gpt text": dict(data=str(REPO / "README.md"), seq_len=32, batch_size=8),
    "gpt sqrt checkpointing": dict(n_layer=4, checkpoint="sqrt"),
    "gpt ZeRO-2": dict(zero=2),
    "gpt ZeRO-3": dict(zero=3, param_threshold=100),
    "gpt mixed": dict(dtype="mixed"),
    "gpt GPipe, 4 micro-batches": dict(schedule="gpipe", micro_batches=4),
    "mlp wide": dict(model="mlp", n_layer=3, d_model=256, batch_size=512, n_head=1, seq_len=0),
}


@pytest.mark.parametrize("name", list(MEASURED))
def test_the_estimate_bounds_the_measured_peak(name):
    """Activations ≥ the saved-tensor ledger's peak and ≤ 3x it per graph held (4x for the MLP); the whole
    estimate ≥ the process's true peak (tracemalloc: NumPy's allocations and Python's objects, from the
    task's loading to the held-out evaluation) and ≤ 3x it."""
    cfg = config(steps=2, **MEASURED[name])
    gc.collect()
    tracemalloc.start()
    try:
        task = build_task(cfg)
        vocab, seq = task_sizes(cfg, task)
        est = preflight.estimate(cfg, vocab, seq, task_bytes=preflight._task_bytes(task))
        model = build_model(cfg, task)
        trainer = make_trainer(cfg, model, None)
        saved_peak = 0
        for step in range(cfg.steps):
            saved_tensors.reset_peak()
            trainer.step(*task.batch(step, cfg.batch_size))
            saved_peak = max(saved_peak, saved_tensors.peak_bytes)
        evaluate(model, task)
        true_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # with --grad-accum > 1 the trainer still holds the previous micro-batch's graph (preflight.py), which
    # the ledger no longer counts (its saved tensors were released by its backward)
    # with activation checkpointing the estimate is the bound without it. The MLP's graph holds each
    # Linear's output beside the tanh output that backward saves: its true activations are 3.2x the ledger's
    ratio = 0 if cfg.checkpoint != "none" else 4 if cfg.model == "mlp" else 3
    graphs = min(cfg.grad_accum, 2)
    assert saved_peak <= est.step_activations, (est.step_activations, saved_peak)
    assert not ratio or est.step_activations <= ratio * graphs * saved_peak, (est.step_activations, saved_peak)
    estimated = est.total - preflight.PROCESS_BYTES  # tracemalloc sees nothing of the interpreter's own start
    assert true_peak <= estimated <= 3 * true_peak, (estimated, true_peak, est.parts, est.build)


@pytest.mark.parametrize("flags", [dict(), dict(dropout=0.1), dict(dtype="float64", n_layer=3, d_model=32, n_head=2),
                                   dict(dtype="mixed"), dict(seq_len=8, n_head=1, batch_size=4),
                                   dict(model="mlp", n_layer=3, d_model=16, n_head=1, seq_len=0, batch_size=10)])
def test_the_saved_tensor_formula_equals_the_engine_ledger(flags):
    """memory.saved_bytes is what the engine's saved-tensor ledger counts at its peak, to the byte."""
    cfg = config(steps=1, **flags)
    task = build_task(cfg)
    vocab, seq = task_sizes(cfg, task)
    trainer = make_trainer(cfg, build_model(cfg, task), None)
    saved_tensors.reset_peak()
    trainer.step(*task.batch(0, cfg.batch_size))
    shape = preflight._shape(cfg, vocab, seq)  # the flags as the memory model's arguments
    assert saved_tensors.peak_bytes == saved_bytes(cfg.batch_size, shape.s, shape.h, shape.a, shape.vocab, cfg.n_layer,
                                                   shape.e, shape.dropout, shape.loss_scaled, shape.model)


@pytest.mark.parametrize("flags", [dict(), dict(n_layer=5, d_model=48, n_head=3, seq_len=10),
                                   dict(data=str(REPO / "README.md"), seq_len=20),
                                   dict(model="mlp", n_layer=1, d_model=8, n_head=1, seq_len=0),
                                   dict(model="mlp", n_layer=4, d_model=32, n_head=1, seq_len=0)])
def test_parameters_are_counted_from_the_flags_as_the_model_has_them(flags):
    cfg = config(**flags)
    task = build_task(cfg)
    vocab, seq = task_sizes(cfg, task)
    tensors = [t for t in preflight.parameter_tensors(cfg, vocab, seq) if t[1] > 0]
    model = build_model(cfg, task)
    assert preflight.count(tensors) == model.num_parameters()
    assert sum(k for _, k in tensors) == len(model.parameters())
    assert sorted(n for n, k in tensors for _ in range(k)) == sorted(p.size for p in model.parameters())


def test_verify_counts_the_reference_on_rank_0_only():
    cfg = config(dtype="float64", steps=3)
    task = build_task(cfg)
    vocab, seq = task_sizes(cfg, task)
    trained = [preflight.estimate(cfg, vocab, seq, 2, rank) for rank in (0, 1)]
    verified = [preflight.estimate(cfg, vocab, seq, 2, rank, verify=True) for rank in (0, 1)]
    psi = preflight.count(preflight.parameter_tensors(cfg, vocab, seq))
    whole_model = (8 + 8 + 16) * psi  # float64 AdamW, DP
    assert verified[0].parts["parameters+optimizer"] == trained[0].parts["parameters+optimizer"] + whole_model
    assert verified[0].parts["data"] >= trained[0].parts["data"] + cfg.steps * 16 * psi  # recorded steps
    assert verified[1].parts == trained[1].parts


# -- the check ------------------------------------------------------------------------------------


def test_the_demo_is_not_refused_and_the_host_memory_is_read(monkeypatch):
    monkeypatch.delenv(LIMIT, raising=False)
    available, source = preflight.available_memory()
    if available is None:
        pytest.skip(f"this host reports no available memory ({source})")
    assert available > 0
    summary = train(config(steps=2), progress=False)
    assert summary["steps"] == 2
    est = preflight.check(config(), build_task(config()))
    assert est.total < 10**9  # the demo needs well under a gigabyte


def test_a_run_over_the_limit_is_refused_in_one_line(monkeypatch):
    monkeypatch.setenv(LIMIT, "70MB")  # the demo needs the 64 MB of a process and more
    with pytest.raises(AgreedError) as caught:
        train(config(steps=2), progress=False)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("this run needs about ")
    for part in ("parameters+optimizer", "activations", "70.0 MB available", f"{LIMIT}=70MB", "--seq-len"):
        assert part in message, message


def test_the_memory_limit_variable(monkeypatch):
    monkeypatch.setenv(LIMIT, "2GB")
    assert preflight.available_memory() == (2 * 10**9, f"{LIMIT}=2GB")
    monkeypatch.setenv(LIMIT, "512MiB")
    assert preflight.available_memory()[0] == 512 * 2**20
    monkeypatch.setenv(LIMIT, "off")
    assert preflight.available_memory()[0] is None
    preflight.check(config(n_layer=10**6), build_task(config()))  # no check: nothing refused
    monkeypatch.setenv(LIMIT, "lots")
    with pytest.raises(ValueError, match=f"{LIMIT}='lots'.*'off'"):
        preflight.available_memory()


HUGE = [["--n-layer", "1000000"], ["--seq-len", "10000000"], ["--batch-size", str(10**12)],
        ["--d-model", "1000000"], ["--schedule", "gpipe", "--micro-batches", str(10**12)],
        ["--n-layer", str(10**30), "--batch-size", str(10**30)]]  # beyond float: Python ints throughout


@pytest.mark.parametrize("command", ["train", "verify"])
@pytest.mark.parametrize("flags", HUGE, ids=lambda flags: " ".join(flags))
def test_huge_flags_are_refused_before_anything_is_allocated(command, flags):
    """The issue's cases: a one-line error with the estimate, not a MemoryError after minutes (the
    timeout is a safety net only)."""
    done = run_local(["-m", "refimpl", command, *flags, "--steps", "2"], timeout=60, env={LIMIT: "64GB"})
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: this run needs about "), done.stderr
    assert "more than the 64.0 GB available" in lines[0] and "Traceback" not in done.stderr


def _estimates(flags: list[str], world: int) -> list[int]:
    """Each rank's estimated total for `python -m refimpl train FLAGS` on `world` ranks."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cfg = config_from_args(parser.parse_args(flags))
    task = build_task(cfg)
    vocab, seq = task_sizes(cfg, task)
    task_bytes = preflight._task_bytes(task)
    return [preflight.estimate(cfg, vocab, seq, world, rank, task_bytes).total for rank in range(world)]


def test_the_ranks_on_one_host_are_summed():
    """Each of 2 ranks fits the limit, their sum does not: refused on both; at the sum, it runs."""
    flags = ["--steps", "2", "--batch-size", "8", "--zero", "1"]
    each = _estimates(flags, 2)
    between = (max(each) + sum(each)) // 2
    refused = run_mpi(2, ["-m", "refimpl", "train", *flags], timeout=300, env={LIMIT: between})
    assert refused.returncode == 2, refused.stderr
    assert "this run needs about" in refused.stderr and "on 2 ranks on this host" in refused.stderr, refused.stderr
    assert refused.stderr.count("this run needs") == 1  # printed once, every rank refused alike
    check_ok(run_mpi(2, ["-m", "refimpl", "train", *flags], timeout=300, env={LIMIT: sum(each)}))


def test_on_the_gpu_the_device_part_is_compared_with_the_gpus_free_memory(monkeypatch):
    """CuPy backend: parameters, buffers and activations against the GPU's free memory, the rest
    against the host's (a stand-in GPU here: backend.name and the free-memory query replaced)."""
    monkeypatch.setenv(LIMIT, "off")  # the host has room
    monkeypatch.setattr(preflight.backend, "name", lambda: "cupy")
    cfg = config()
    task = build_task(cfg)
    est = preflight.estimate(cfg, *task_sizes(cfg, task))
    on_device = est.parts["parameters+optimizer"] + est.parts["buffers"] + est.parts["activations"]
    assert est.on_device == on_device
    monkeypatch.setattr(preflight, "_device_memory", lambda: ("GPU 0", on_device))
    preflight.check(cfg, task)  # exactly fits
    monkeypatch.setattr(preflight, "_device_memory", lambda: ("GPU 0", on_device - 1))
    with pytest.raises(AgreedError, match=r"on this host \(GPU 0\) .* available \(free memory of GPU 0\)"):
        preflight.check(cfg, task)
