"""A plug-in's failure is named in one line, never a traceback, a hang or a silent success.

A schedule generator (--schedule FILE.py:FUNCTION) or a trainer factory (verify --trainer) that
calls sys.exit (any code: 0 must not pass for --help or a finished run), returns steps that are
not Actions, or a trainer whose records are not what protocols.Verifiable says, stops the run at
once with exit status 2 and one `error:` line naming the plug-in and the first bad value.
"""

import re
import textwrap

import pytest
from mpi_util import run_local, run_mpi

EXAMPLE_TRAINER = "docs/examples/flat_allreduce_trainer.py"

PLUGIN = textwrap.dedent('''
    import sys
    from dataclasses import replace

    from refimpl.parallel.pipeline import SCHEDULES, Action


    def exits(pp, m, chunks=None):
        sys.exit(0)

    def exits_with_3(pp, m, chunks=None):
        sys.exit(3)

    def strings(pp, m, chunks=None):
        return replace(SCHEDULES["1f1b"](pp, m), ranks=(("F0", "B0"),) * pp)

    def not_lists(pp, m, chunks=None):
        return replace(SCHEDULES["1f1b"](pp, m), ranks=7)

    def sleeps(pp, m, chunks=None):
        import time
        time.sleep(1000)

    def later_string(pp, m, chunks=None):
        built = SCHEDULES["1f1b"](pp, m)
        return replace(built, ranks=(built.ranks[0], built.ranks[1][:-1] + ("B3",)))
''')


@pytest.fixture
def plugin(tmp_path):
    path = tmp_path / "plugin.py"
    path.write_text(PLUGIN)
    return path


def one_error_line(done, *expected):
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert "Traceback" not in done.stderr, done.stderr
    errors = [re.sub(r"^\[rank \d+\] ", "", line) for line in lines]  # a rank that aborts the job names itself
    errors = [line for line in errors if line.startswith("error:")]
    assert errors, done.stderr
    for text in expected:
        assert text in errors[0], errors[0]


@pytest.mark.parametrize("function,expected", [
    ("exits", ["exits(pp=2, micro_batches=4, chunks=None) called sys.exit(0)"]),
    ("exits_with_3", ["called sys.exit(3)"]),
    ("strings", ["rank 0's step 0 is str 'F0'", "not an Action"]),
    ("not_lists", ["whose ranks are int"]),
    ("later_string", ["rank 1's step 7 is str 'B3'"]),
])
def test_a_bad_schedule_generator_is_one_line_in_the_schedule_command(plugin, function, expected):
    done = run_local(["-m", "refimpl", "schedule", "--schedule", f"{plugin}:{function}", "--pp", "2",
                      "--micro-batches", "4"], timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    one_error_line(done, f"--schedule '{plugin}:{function}'", *expected)


def test_sys_exit_at_import_is_the_plugins_failure(tmp_path):
    path = tmp_path / "exits_on_import.py"
    path.write_text("import sys\nsys.exit(0)\n")
    done = run_local(["-m", "refimpl", "schedule", "--schedule", f"{path}:anything", "--pp", "2",
                      "--micro-batches", "4"], timeout=60)
    assert done.returncode == 2
    one_error_line(done, "importing", "called sys.exit(0)")


def test_sys_exit_in_a_schedule_ends_a_training_run_on_every_rank(plugin):
    done = run_mpi(2, ["-m", "refimpl", "train", "--pp", "2", "--schedule", f"{plugin}:exits", "--steps", "1"],
                   timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    one_error_line(done, "called sys.exit(0)")
    assert "step 1/1" not in done.stdout  # nothing trained


@pytest.mark.parametrize("broken,expected", [
    ("full_parameters = lambda: 3.0", "full_parameters() is float 3.0"),
    ("full_parameters = lambda: {'w': 3.0}", "full_parameters()['w'] is float 3.0"),
])
def test_a_trainer_whose_records_are_not_the_protocols_is_named(tmp_path, broken, expected):
    path = tmp_path / "broken_trainer.py"
    path.write_text(textwrap.dedent(f'''
        import importlib.util

        spec = importlib.util.spec_from_file_location("example", {str(EXAMPLE_TRAINER)!r})
        example = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(example)


        def make_trainer(cfg, model, world):
            trainer = example.make_trainer(cfg, model, world)
            trainer.{broken}
            return trainer
    '''))
    done = run_mpi(2, ["-m", "refimpl", "verify", "--trainer", f"{path}:make_trainer", "--steps", "1",
                       "--d-model", "8", "--n-head", "2", "--seq-len", "8"], timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    one_error_line(done, expected)


def test_a_plugin_that_computes_forever_on_every_rank_ends_at_the_timeout(plugin):
    """--timeout covers computation as well as waits: every rank sleeps inside the plug-in (no rank
    waits in MPI), and the watchdog still ends the job, naming where each rank is."""
    done = run_mpi(2, ["-m", "refimpl", "train", "--pp", "2", "--schedule", f"{plugin}:sleeps", "--steps", "1",
                       "--timeout", "2"], timeout=60)  # a safety net: the watchdog ends it in < timeout + 10 s
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Every rank computes without reaching a progress point" in done.stderr, done.stderr
    assert "in sleeps" in done.stderr and "rank 0" in done.stderr and "rank 1" in done.stderr
