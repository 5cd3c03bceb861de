"""verify as an instrument: a verdict a trainer cannot override, a PASS that says what it checked,
every rank checked, flags refused unless declared, and the small things a researcher meets first.

The trainers under test are tests/trainers/dishonest.py's (each says how it cheats)."""

import argparse
import json
import textwrap

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from mpi_util import REPO, last_json, run_local, run_mpi

from refimpl.protocols import IMPLEMENTATION_FLAGS
from refimpl.tools.commands.verify import add_arguments
from refimpl.tools.compare import compare_step
from refimpl.tools.flags import config_from_args
from refimpl.tools.run import TrainConfig
from refimpl.tools.sweep import draw_flags, numpy_chooser
from refimpl.tools.testing import VerifyError, assert_trains_like_reference, run_verify
from refimpl.tools.verification import flags_used, float32_hint

DISHONEST = REPO / "tests" / "trainers" / "dishonest.py"
BROKEN = REPO / "tests" / "trainers" / "broken.py"
EXAMPLE = REPO / "docs" / "examples" / "flat_allreduce_trainer.py"
SMALL = ["--n-layer", "1", "--d-model", "8", "--n-head", "2", "--seq-len", "8", "--batch-size", "4"]


def verify(n, *args, timeout=300):
    command = ["-m", "refimpl", "verify", *SMALL, *map(str, args)]
    return run_mpi(n, command, timeout=timeout) if n > 1 else run_local(command, timeout=timeout)


def only_error_line(done) -> str:
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stdout + done.stderr
    assert len(lines) == 1 and lines[0].startswith("error: ") and done.stdout == "", done.stdout + done.stderr
    return lines[0]


# -- a verdict nothing can override -----------------------------------------------------------------

@pytest.mark.mpi
def test_a_report_that_claims_ok_cannot_turn_a_failure_into_a_pass():
    done = verify(2, "--trainer", f"{DISHONEST}:claims_ok", "--steps", "2", "--json")
    assert done.returncode == 1, done.stdout + done.stderr
    result = last_json(done)
    assert result["ok"] is False and result["tolerance_used"] > 1e6
    assert [step["ok"] for step in result["per_step"]] == [False, False]
    assert result["trainer_report"] == {"ok": True, "tolerance_used": 0, "max_abs_diff": 0.0, "problems": [],
                                        "worst_name": None}  # kept, under its own key, and nothing more
    assert result["worst_what"] == "gradient" and result["worst_rank"] == 0
    assert "verify FAIL: Averaging on 2 process(es)" in done.stderr  # with --json the report lines go to stderr
    honest = last_json(verify(2, "--trainer", f"{DISHONEST}:honest", "--steps", "2", "--json"))
    assert honest["ok"] is True and honest["trainer_report"]["ok"] is True and honest["tolerance_used"] < 1


@pytest.mark.mpi
def test_report_is_called_once_at_the_end():
    result = last_json(verify(2, "--trainer", f"{DISHONEST}:counts_reports", "--steps", "3", "--json"))
    assert result["ok"] is True
    assert result["trainer_report"] == {"calls": 1, "steps_done_at_each_call": [3]}


# -- every rank is checked --------------------------------------------------------------------------

@pytest.mark.mpi
def test_ranks_other_than_0_that_drop_the_reduced_gradient_fail_at_the_first_step():
    done = verify(2, "--trainer", f"{DISHONEST}:drops_on_other_ranks", "--steps", "1", "--json")
    assert done.returncode == 1, done.stdout + done.stderr
    result = last_json(done)
    assert result["ok"] is False and result["worst_rank"] == 1 and result["tolerance_used"] > 1e6
    assert result["per_step"][0]["ranks_differing_from_rank0"] == [1]
    assert result["problems"][-1].startswith("rank 1: step 0: its records are not rank 0's and fail: largest "
                                             "difference in ")
    assert result["records_by_rank"] == [{"parameters": 17, "gradients": 17}] * 2


@pytest.mark.mpi
def test_a_data_parallel_replica_of_a_later_pipeline_stage_is_checked_on_its_own_rank():
    # dp 2 x pp 2: rank 0 gathers the whole model from replica 0's stages (ranks 0 and 1); rank 3, the
    # other replica of stage 1, steps with twice the learning rate: only its own copy (local_records()) shows it
    pipeline = ["--pp", "2", "--n-layer", "2", "--micro-batches", "2", "--steps", "1"]
    done = verify(4, "--trainer", f"{BROKEN}:replica_lr_doubled", *pipeline, "--json")
    assert done.returncode == 1, done.stdout + done.stderr
    result = last_json(done)
    assert result["ok"] is False and result["worst_rank"] == 3 and result["worst_what"] == "parameter"
    assert result["tolerance_used"] > 1e6 and result["per_step"][0]["ranks_differing_from_rank0"] == [3]
    assert len(result["problems"]) == 1 and result["problems"][0].startswith(
        "rank 3: step 0: the copy it holds (local_records()) is not rank 0's and fail: largest difference in "
        "parameter "), result["problems"]
    assert "verify FAIL: Trainer on 4 process(es)" in done.stderr and " on rank 3, passes at <= 1" in done.stderr
    right = last_json(verify(4, *pipeline, "--json"))
    assert right["ok"] is True and right["per_step"][0]["ranks_differing_from_rank0"] == []
    # rank 0 returns the whole model (29 tensors), the others nothing; each holds its stage: 14 or 15 tensors
    assert right["records_by_rank"] == [{"parameters": p, "gradients": p, "local_parameters": h, "local_gradients": h}
                                        for p, h in ((29, 14), (0, 14), (0, 15), (0, 15))]


# -- a PASS that says what it checked ---------------------------------------------------------------

def test_the_pass_line_and_the_json_list_the_configuration_checked():
    done = verify(1, "--zero", "1", "--grad-accum", "2", "--steps", "1")
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""  # the report is on stdout, nothing on stderr
    verdict = done.stdout.strip().splitlines()[-1]
    assert verdict.startswith("verify PASS: Trainer on 1 process(es) vs single-process reference, 1 steps, checked "
                              "dp 1 x pp 1 x tp 1: --model gpt --dtype float64 --optimizer adamw --clip 1 "
                              "--collectives mpi --grad-accum 2 --zero 1 --checkpoint none;"), verdict
    with_json = verify(1, "--zero", "1", "--grad-accum", "2", "--steps", "1", "--json")
    assert len(with_json.stdout.splitlines()) == 1  # --json: stdout holds the object alone
    result = json.loads(with_json.stdout)
    assert result["configuration"]["flags"] == {"--model": "gpt", "--dtype": "float64", "--optimizer": "adamw",
                                                "--clip": 1.0, "--collectives": "mpi", "--grad-accum": 2,
                                                "--zero": 1, "--checkpoint": "none"}
    assert (result["configuration"]["dp"], result["configuration"]["pp"], result["configuration"]["tp"]) == (1, 1, 1)
    assert "--pp" in result["configuration"]["implements"]  # refimpl's own trainer implements every flag


@pytest.mark.parametrize("args, expected", [
    (["--zero", "2"], "error: --trainer: DataParallel does not implement --zero; it declares none of the flags that "
                      "choose how a step is computed (DataParallel.implements)"),
    (["--grad-accum", "2", "--checkpoint", "sqrt"], "does not implement --grad-accum, --checkpoint; it declares none"),
    (["--dtype", "mixed"], "does not implement --dtype mixed"),
    (["--zero", "1", "--trainer-fn", "declares_grad_accum"], "does not implement --zero; it declares --grad-accum"),
    (["--trainer-fn", "declares_a_string"], "DataParallel.implements is str '--pp'; it is a set of flags"),
    (["--trainer-fn", "declares_unknown_flag"], "DataParallel.implements names ['--turbo'], which are not flags"),
    (["--dtype", "mixed", "--trainer-fn", "mixed_without_state"],
     "error: --dtype mixed: DataParallel lacks full_optimizer_state, optimizer_steps (refimpl/protocols.py, "
     "MixedPrecisionVerifiable"),
    (["--trainer-fn", "report_not_a_dict"], "DataParallel.report() returned list ['ok']; it returns a dict"),
    (["--trainer-fn", "local_records_not_a_dict"], "DataParallel.local_records() returned list [{'wte.weight': "),
])
def test_a_flag_the_trainer_does_not_declare_and_a_bad_declaration_are_one_line(args, expected):
    function = args[args.index("--trainer-fn") + 1] if "--trainer-fn" in args else "honest"
    args = [a for i, a in enumerate(args) if "--trainer-fn" not in args[max(0, i - 1):i + 1]]
    line = only_error_line(verify(1, "--trainer", f"{DISHONEST}:{function}", "--steps", "1", *args))
    assert expected in line, line


@pytest.mark.mpi
def test_pp_is_refused_unless_declared_and_a_declared_pp_that_is_ignored_fails_naming_it():
    refused = verify(2, "--trainer", f"{EXAMPLE}:make_trainer", "--pp", "2", "--n-layer", "2", "--steps", "1")
    assert "FlatAllReduceTrainer does not implement --pp; it declares none" in only_error_line(refused)
    done = verify(2, "--trainer", f"{DISHONEST}:declares_pp_ignores_it", "--pp", "2", "--n-layer", "2", "--steps", "1",
                  "--json")
    assert done.returncode == 1, done.stdout + done.stderr
    result = last_json(done)
    assert result["ok"] is False and result["declared_flags_in_use"] == ["--pp"]
    assert result["problems"] == [IGNORED.format(given="--pp 2", name="DataParallel", flag="--pp")]


IGNORED = ("{given}: {name} declares it but ignores it: a step with it made the same operations and communicator "
           "calls, in the same order and with the same bytes, on every rank, as a step without it, where refimpl's "
           "own trainer does not (verify without {flag}, or honour it; refimpl/tools/flag_check.py)")


@pytest.mark.mpi
@pytest.mark.parametrize("args", [["--zero", "2"], ["--zero", "1", "--grad-accum", "2"], ["--checkpoint", "sqrt"],
                                  ["--bucket-bytes", "64"], ["--tp", "2", "--sequence-parallel"]])
def test_every_declared_flag_that_is_ignored_fails_in_one_line_naming_it(args):
    """A trainer that declares every flag and runs plain data parallelism: each flag in use that
    changes what refimpl's own trainer does fails, one line for each (and the others are not named)."""
    done = verify(2, "--trainer", f"{DISHONEST}:declares_everything_ignores_it", "--n-layer", "4", "--batch-size", "8",
                  "--steps", "1", "--json", *args)
    assert done.returncode == 1, done.stdout + done.stderr
    result = last_json(done)
    given = [f"{flag} {value}" if value else flag for flag, value in zip(args[::2], args[1::2] + [""])] \
        if "--sequence-parallel" not in args else ["--tp 2", "--sequence-parallel"]
    given.sort(key=lambda g: IMPLEMENTATION_FLAGS.index(g.split()[0]))  # in the protocol's order
    assert result["problems"] == [IGNORED.format(given=g, name="DataParallel", flag=g.split()[0]) for g in given]
    assert result["configuration"]["not_exercised"] == []


@pytest.mark.mpi
def test_a_flag_that_this_configuration_does_not_exercise_is_listed_not_failed(tmp_path):
    """--trace and --mem-budget only watch, and a bucket larger than the model is one bucket, as
    the default's is: refimpl's own trainer runs the same with and without them, so nothing is
    claimed, and the PASS says so; refimpl's own trainer through --trainer is never accused."""
    trace = tmp_path / "trace.json"
    args = ["--trace", trace, "--mem-budget", "1GB", "--bucket-bytes", 1 << 24, "--steps", "1", "--json"]
    result = last_json(verify(2, "--trainer", f"{DISHONEST}:declares_everything_ignores_it", *args))
    assert result["ok"] is True and result["problems"] == []
    assert result["configuration"]["not_exercised"] == ["--bucket-bytes", "--mem-budget", "--trace"]
    assert result["checked"].endswith("(not exercised in this configuration: --bucket-bytes --mem-budget --trace)")
    own = last_json(verify(2, "--trainer", f"{DISHONEST}:refimpls_own", "--zero", "3", "--checkpoint", "sqrt",
                           "--n-layer", "4", "--grad-accum", "2", "--steps", "1", "--json"))
    assert own["ok"] is True and own["configuration"]["not_exercised"] == []


@pytest.mark.mpi
def test_a_declared_flag_is_verified_listed_and_drawn_by_the_sweep_alone():
    result = last_json(verify(2, "--trainer", f"{DISHONEST}:declares_grad_accum", "--grad-accum", "2", "--steps", "2",
                              "--json"))
    assert result["ok"] is True and result["configuration"]["flags"]["--grad-accum"] == 2
    assert result["configuration"]["implements"] == ["--grad-accum"] and "--grad-accum 2" in result["checked"]
    done = run_mpi(2, ["-m", "refimpl", "verify", "--trainer", f"{DISHONEST}:declares_grad_accum", "--sweep", "3",
                       "--sweep-seed", "5", "--json"], timeout=300)
    sweep = last_json(done)
    assert sweep["ok"] is True and len(sweep["sweep"]) == 3, done.stderr
    for entry in sweep["sweep"]:
        assert flags_used(config_of(entry["flags"])) in ([], ["--grad-accum"])
    assert "declares --grad-accum, the others keep their defaults" in done.stderr


PARSER = argparse.ArgumentParser()
add_arguments(PARSER)


def config_of(flags):
    return config_from_args(PARSER.parse_args(flags))


DRAWABLE = ["--grad-accum", "--dp-mode", "--bucket-bytes", "--zero", "--prefetch", "--param-threshold", "--checkpoint",
            "--pp", "--schedule", "--micro-batches", "--chunks", "--tp", "--sequence-parallel", "--ep"]


@given(world=st.sampled_from([1, 2, 3, 4]), implements=st.sets(st.sampled_from(DRAWABLE)),
       seed=st.integers(0, 2 ** 32 - 1))
def test_the_sweep_draws_for_a_plugin_only_the_flags_it_declares(world, implements, seed):
    rng = np.random.default_rng(seed)
    for _ in range(40):
        cfg = config_of(draw_flags(world, numpy_chooser(rng), implements=frozenset(implements)))
        cfg.check()
        assert set(flags_used(cfg)) <= implements, (implements, flags_used(cfg))


def test_the_sweep_draws_every_flag_a_plugin_declares():
    rng = np.random.default_rng(0)
    for implements in ({"--grad-accum"}, {"--zero", "--tp"}, {"--pp", "--schedule", "--micro-batches", "--zero"}):
        seen = set()
        for _ in range(300):
            seen |= set(flags_used(config_of(draw_flags(4, numpy_chooser(rng), implements=frozenset(implements)))))
        assert seen == implements


# -- the small things -------------------------------------------------------------------------------

def test_verify_help_shows_verify_defaults_not_trains():
    done = run_local(["-m", "refimpl", "verify", "--help"], timeout=60)
    text = " ".join(done.stdout.split())
    assert "optimizer steps compared (default 3; 2 in each --sweep configuration)" in text
    assert "(default float64)" in text and "gpt 400" not in text and "(default float32)" not in text


def test_a_plugin_file_imports_the_modules_beside_it(tmp_path):
    folder = tmp_path / "my_research"
    folder.mkdir()
    (folder / "my_reduction_helpers.py").write_text("def summed(comm, grad):\n    comm.allreduce(grad)\n"
                                                    "    return grad\n")
    (folder / "my_trainer.py").write_text(textwrap.dedent(f'''
        import importlib.util

        from my_reduction_helpers import summed  # a sibling module: no sys.path of the user's own

        spec = importlib.util.spec_from_file_location("dishonest", {str(DISHONEST)!r})
        dishonest = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(dishonest)


        class Mine(dishonest.DataParallel):
            def reduce(self, grad):
                return summed(self.comm, grad)


        def make(cfg, model, world):
            return Mine(cfg, model, world)
    '''))
    done = verify(1, "--trainer", f"{folder / 'my_trainer.py'}:make", "--steps", "1")  # run from the repository
    assert done.returncode == 0 and "verify PASS: Mine" in done.stdout, done.stdout + done.stderr


def test_float32_failures_carry_a_hint():
    assert float32_hint(TrainConfig(dtype="float64"), 1e-10) is None
    assert float32_hint(TrainConfig(dtype="float32", optimizer="sgd"), 1e-5) is None
    tight = float32_hint(TrainConfig(dtype="float32", optimizer="sgd"), 1e-10)
    assert tight.startswith("float32 cannot meet rtol 1e-10: it rounds at 6.0e-08 relative")
    assert "--dtype float64" in tight
    assert "AdamW amplifies the rounding" in float32_hint(TrainConfig(dtype="float32", optimizer="adamw"), 1e-5)


@pytest.mark.mpi
def test_a_float32_run_held_to_float64s_tolerance_fails_with_the_hint():
    done = verify(2, "--trainer", f"{EXAMPLE}:make_trainer", "--dtype", "float32", "--rtol", "1e-10", "--atol",
                  "1e-12", "--steps", "1")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "; hint: float32 cannot meet rtol 1e-10: it rounds at 6.0e-08 relative" in done.stdout


def test_the_largest_difference_says_whether_it_is_a_gradient_a_parameter_or_the_loss():
    ref = {"loss": 1.0, "grads": {"w": np.ones(2)}, "params": {"w": np.ones(2)}}
    for changed, what in (("grads", "gradient"), ("params", "parameter")):
        ours = {**ref, changed: {"w": np.array([1.0, 1.5])}}
        c = compare_step(0, ours, ref, 1e-10, 1e-12)
        assert (c.ok, c.worst_name, c.worst_what) == (False, "w", what)
    loss = compare_step(0, {**ref, "loss": 2.0}, ref, 1e-10, 1e-12)
    assert (loss.worst_name, loss.worst_what) == ("loss", "loss")


# -- a public helper for researchers' tests -------------------------------------------------------------

def test_the_public_helper_passes_a_right_trainer_and_names_bad_input():
    result = assert_trains_like_reference(f"{DISHONEST}:honest", ranks=1, flags=[*SMALL, "--steps", "1"])
    assert result["ok"] is True and result["trainer"] == "DataParallel"
    with pytest.raises(VerifyError, match="does not implement --zero"):
        run_verify(f"{DISHONEST}:honest", ranks=1, flags=[*SMALL, "--steps", "1", "--zero", "1"])
    with pytest.raises(ValueError, match="flags is a list of command-line words"):
        run_verify(f"{DISHONEST}:honest", ranks=1, flags="--zero 1")


@pytest.mark.mpi
def test_the_public_helper_fails_a_wrong_trainer_on_two_ranks_with_the_command_to_reproduce_it():
    with pytest.raises(AssertionError) as failed:
        assert_trains_like_reference(f"{DISHONEST}:drops_on_other_ranks", ranks=2, flags=[*SMALL, "--steps", "1"])
    lines = str(failed.value).splitlines()
    assert lines[0].startswith("verify FAIL: DropsOnOtherRanks, checked dp 2 x pp 1 x tp 1: --model gpt")
    assert lines[0].endswith("on rank 1") and lines[-1].startswith("  reproduce: ") and "-n 2" in lines[-1]
