"""The mutation catalogue stays usable: every patch applies to the tree, the manifest covers the areas.

benchmarks/mutation.py runs the whole catalogue (minutes: every mutant against its checks); this
file is the cheap part that CI runs on every change. If a patch stops applying because the code it
mutates was rewritten, remake it against the new code (docs/mutation_testing.md, "Adding or
remaking a mutant") rather than deleting it.
"""

import importlib.util
import re
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("mutation", REPO / "benchmarks" / "mutation.py")
mutation = importlib.util.module_from_spec(spec)
sys.modules["mutation"] = mutation  # dataclasses look their module up while the file runs
spec.loader.exec_module(mutation)

REQUIRED_AREAS = {"ring collectives", "DDP buckets", "DDP accumulation", "ZeRO-1", "ZeRO-2", "ZeRO-3",
                  "mixed precision", "checkpoint replay", "pipeline executor", "DualPipe gradient sum",
                  "schedule generators", "autograd backward", "optimizer"}
# Files the catalogue may mutate: the algorithms, not the checks that judge them.
ALGORITHMS = ("refimpl/parallel/ring.py", "refimpl/parallel/data_parallel.py", "refimpl/parallel/zero/",
              "refimpl/parallel/pipeline/", "refimpl/checkpointing/", "refimpl/autograd/", "refimpl/nn/",
              "refimpl/optim/", "refimpl/parallel/trainer.py", "refimpl/parallel/tensor_parallel/",
              "refimpl/parallel/experts.py", "refimpl/tools/cluster/", "refimpl/tools/saved_runs/fingerprint.py")

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git applies the patches")


@pytest.fixture(scope="module")
def catalogue():
    return mutation.load_catalogue()


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    """A copy of the repository's files as they are in the working tree (what the runner mutates)."""
    root = tmp_path_factory.mktemp("tree")
    mutation.copy_tree(mutation.repository_files(), REPO, root)
    return root


@needs_git
def test_every_patch_applies_to_the_current_tree(catalogue, tree):
    _, mutants = catalogue
    failures = {m.name: mutation.apply_patch(m.patch, tree, check_only=True) for m in mutants}
    assert {name: error for name, error in failures.items() if error} == {}


def test_the_catalogue_covers_every_area_with_at_least_20_mutants(catalogue):
    checks, mutants = catalogue
    assert len(mutants) >= 20
    assert REQUIRED_AREAS <= {m.area for m in mutants}
    numbers = [int(m.name.split("_")[0]) for m in mutants]
    assert numbers == list(range(1, len(mutants) + 1)), "mutants are numbered 01, 02, ... in manifest order"
    used = {c for m in mutants for c in m.checks}
    assert used == set(checks), f"checks defined but never used: {set(checks) - used}"
    # verify is blind to a wrong backward or optimizer formula (both sides use it): gradcheck, or the
    # comparison with the published optimizer formulas, must be there
    for m in mutants:
        if m.area == "autograd backward":
            assert m.checks[-1] == "test_gradcheck", m.name
        if m.area == "optimizer":
            assert m.checks[-1] == "test_optim", m.name


def test_every_patch_says_what_why_and_what_catches_it(catalogue):
    _, mutants = catalogue
    for m in mutants:
        header = " ".join(mutation.header_of(m.patch))
        assert "Realistic:" in header and "Caught by:" in header, m.name
        files = mutation.patched_files(m.patch)
        assert files and all(f.startswith(ALGORITHMS) for f in files), (m.name, files)
        assert m.summary, f"{m.name}: give it a one-line bug in catalogue.toml"


def test_the_docs_table_lists_every_mutant(catalogue):
    _, mutants = catalogue
    page = (REPO / "docs" / "mutation_testing.md").read_text()
    missing = [m.name for m in mutants if m.name not in page]
    assert missing == [], "add them to docs/mutation_testing.md's table"


def test_check_command_lines_are_run_in_the_copy(tmp_path):
    argv = mutation.command_of("pytest tests/test_comm.py -k 'a or b'")
    assert argv[1:] == [*mutation.PYTEST, "tests/test_comm.py", "-k", "a or b"]
    env = mutation.check_env(tmp_path)
    assert env["PYTHONPATH"] == str(tmp_path) and not any(k.startswith("PMI_") for k in env)
    check = mutation.Check.of("x", {"cmd": "python -c pass", "timeout": 5})
    assert check.timeout == 5.0 and mutation.Check.of("y", "python -c pass").timeout is None


@needs_git
def test_a_patch_that_no_longer_applies_is_an_error_not_caught(tmp_path):
    stale = tmp_path / "99_stale.patch"
    stale.write_text(re.sub(r"(?m)^-(\s+b = \(r - step - 2\) % n)", r"-\1  # not there any more",
                            (REPO / "benchmarks/mutations/01_ring_reduce_scatter_block_off_by_one.patch").read_text()))
    mutant = mutation.Mutant("99_stale", "ring collectives", [], stale)
    outcome = mutation.run_mutant(mutant, {}, ["refimpl/parallel/ring.py"], tmp_path / "work", timeout=10)
    assert outcome.status == "ERROR" and outcome.check == "patch does not apply"
