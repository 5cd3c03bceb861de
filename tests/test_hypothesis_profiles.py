"""The property tests draw new examples on every run, in CI too (tests/conftest.py).

Hypothesis derandomizes by default where the environment says CI (CI=true, GITHUB_ACTIONS=true):
a profile that did not state derandomize=False would then draw the same examples every run.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
SHOW = ("import sys; sys.path.insert(0, sys.argv[1]); import conftest; from hypothesis import settings; "
        "print(settings.get_current_profile_name(), settings.default.derandomize, conftest.RUN_SEED)")


def profile(**env):
    inherited = {k: v for k, v in os.environ.items() if not k.startswith(("HYPOTHESIS_", "REFIMPL_HYPOTHESIS"))}
    out = subprocess.run([sys.executable, "-c", SHOW, str(TESTS)], capture_output=True, text=True, check=True,
                         env={**inherited, **env})
    name, derandomize, seed = out.stdout.split()
    return name, derandomize == "True", int(seed)


@pytest.mark.parametrize("ci", [{}, {"CI": "true"}, {"GITHUB_ACTIONS": "true", "CI": "1"}])
def test_every_run_draws_anew_also_on_ci(ci):
    first, second = profile(**ci), profile(**ci)
    assert first[:2] == ("refimpl", False) and second[:2] == ("refimpl", False)
    assert first[2] != second[2]  # two seeds drawn from 2**32: equal once in four billion runs


def test_a_printed_seed_replays_and_replay_profile_derandomizes():
    assert profile(CI="true", REFIMPL_HYPOTHESIS_SEED="123")[1:] == (False, 123)
    assert profile(HYPOTHESIS_PROFILE="deep", CI="true")[:2] == ("deep", False)
    assert profile(HYPOTHESIS_PROFILE="replay")[:2] == ("replay", True)
