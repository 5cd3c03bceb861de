"""A loss that becomes NaN or infinite stops training with exit status 1, on every rank together,
with one message naming the step and --json's object recording it (train.TrainingDiverged); a
float16 overflow that mixed precision skips is not divergence.

The diverging run: a small GPT trained with SGD at --lr 1e6 without clipping; its loss goes from
about 2.4 to about 1e9 at step 2 and is NaN at step 3 (float32; every configuration below adds the
same terms in another order, far from changing that).
"""

import numpy as np
import pytest
from mpi_util import last_json, run_local, run_mpi

import refimpl.tools.run as train_module
from refimpl.tools.run import TrainConfig, TrainingDiverged, train

DIVERGING = ["--optimizer", "sgd", "--clip", "0", "--lr", "1e6", "--n-layer", "2", "--d-model", "16", "--n-head", "2",
             "--batch-size", "24", "--steps", "8", "--json"]
# cli.main, then each rank's exit status into a file of its own: mpiexec reports one status for the job.
REPORT_EXIT = ("import os, sys\n"
               "from refimpl.tools.cli import main\n"
               "from refimpl.tools.runtime.launcher import launcher_rank\n"
               "code = main(sys.argv[1:])\n"
               "with open(os.path.join(os.environ['EXIT_DIR'], str(launcher_rank())), 'w') as f:\n"
               "    f.write(str(code))\n"
               "sys.exit(code)\n")


def run(tmp_path, ranks, args):
    env = {"EXIT_DIR": tmp_path}
    if ranks == 1:
        return run_local(["-c", REPORT_EXIT, *args], timeout=300, env=env)
    return run_mpi(ranks, ["-c", REPORT_EXIT, *args], timeout=300, env=env)


def check_diverged(done, world_size, exit_dir):
    """Exit 1 on every rank, the message once (no abort, no traceback), the JSON object last."""
    assert done.returncode == 1, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if "training diverged" in line]
    assert len(lines) == 1, done.stderr[-3000:]
    message = lines[0]
    assert message.startswith("error: step ") and "the loss is nan" in message
    assert message.endswith("try a smaller --lr (this run: 1e+06), or --clip 1.0 (this run: off)")
    step = int(message[len("error: step "):].split(":")[0])
    assert 2 <= step <= 8
    summary = last_json(done)
    assert summary["ok"] is False and summary["diverged_at_step"] == step and summary["error"] == message[7:]
    assert summary["final_loss"] is None and summary["world_size"] == world_size  # NaN is JSON null
    assert "Traceback" not in done.stderr and "Abort" not in done.stderr
    exits = {path.name: path.read_text() for path in exit_dir.iterdir()}
    assert exits == {str(rank): "1" for rank in range(world_size)}, done.stderr[-3000:]
    return step


def test_one_process_stops_at_the_diverging_step(tmp_path):
    done = run(tmp_path, 1, ["train", *DIVERGING])
    check_diverged(done, 1, tmp_path)
    assert "train gpt step 8/8" not in done.stderr and "done:" not in done.stderr  # it stopped there


@pytest.mark.mpi
@pytest.mark.parametrize("ranks,flags", [
    (2, []),  # data parallel, bucketed
    (3, ["--zero", "2"]),
    (4, ["--pp", "2", "--schedule", "1f1b"]),  # a pipeline of 2 stages x 2 replicas: only the last stage has the loss
], ids=["dp-2", "zero2-3", "1f1b-pp2-dp2"])
def test_every_rank_stops_together(tmp_path, ranks, flags):
    done = run(tmp_path, ranks, ["train", *DIVERGING, *flags])
    check_diverged(done, ranks, tmp_path)


def test_the_message_names_the_step_and_the_flags_to_change():
    clipped = TrainingDiverged(37, float("inf"), TrainConfig(lr=0.5, clip=2.0))
    assert str(clipped) == ("step 37: the loss is inf; training diverged: try a smaller --lr (this run: 0.5), "
                            "or a smaller --clip (this run: 2)")
    assert clipped.step == 37 and isinstance(clipped, RuntimeError) and not isinstance(clipped, ValueError)


def test_a_successful_run_says_ok():
    summary = train(TrainConfig(model="mlp", steps=2), progress=False)
    assert summary["ok"] is True


def test_an_overflow_that_mixed_precision_skips_is_not_divergence(monkeypatch):
    """An inf in one float16 gradient at the first step: the loss scaler skips that step and halves
    the scale; the loss stays finite and training goes on."""
    make_trainer = train_module.make_trainer

    def with_one_overflow(cfg, model, *args, **kwargs):
        trainer = make_trainer(cfg, model, *args, **kwargs)
        injected = []

        def inf_once(grad):
            if injected:
                return grad
            injected.append(True)
            grad = grad.copy()
            grad.reshape(-1)[0] = np.inf
            return grad

        model.parameters()[-1].register_hook(inf_once)
        return trainer

    monkeypatch.setattr(train_module, "make_trainer", with_one_overflow)
    cfg = TrainConfig(dtype="mixed", steps=3, n_layer=1, d_model=16, n_head=2, batch_size=8)
    summary = train(cfg, progress=False)
    assert summary["ok"] is True and summary["skipped_steps"] == 1 and summary["loss_scale"] == 2.0 ** 15
    assert np.isfinite(summary["final_loss"])
