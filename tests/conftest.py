"""Hypothesis profiles: property tests draw new examples on every run, and a failure replays.

    python -m pytest -q                              # profile "refimpl": new draws every run
    HYPOTHESIS_PROFILE=deep python -m pytest -q      # 10x more examples (nightly, or by hand)
    REFIMPL_HYPOTHESIS_SEED=123 python -m pytest -q  # the draws of the run that printed seed 123
    HYPOTHESIS_PROFILE=replay python -m pytest -q    # derandomized: the same draws every run

Every run picks a seed (printed in pytest's header) and hands it to every property test, so a run
can be replayed whole from its seed. A failing example is also saved in hypothesis' database
(.hypothesis/) and tried first on the next run, and printed with its @reproduce_failure blob.
The MPI tests that draw configurations (test_verify_drawn.py) scale their launches with the
profile's max_examples: 1 launch per world size under "refimpl", 10 under "deep".
"""

import os
import random
from pathlib import Path

import numpy as np
import pytest
from hypothesis import seed as use_seed
from hypothesis import settings

# derandomize=False is stated, not inherited: where the environment says CI (CI=true, GITHUB_ACTIONS),
# hypothesis' own default profile derandomizes, and a profile registered without it would too.
settings.register_profile("refimpl", max_examples=25, deadline=None, print_blob=True, derandomize=False)
settings.register_profile("deep", max_examples=250, deadline=None, print_blob=True, derandomize=False)
settings.register_profile("replay", max_examples=25, deadline=None, print_blob=True, derandomize=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "refimpl"))

RUN_SEED = int(os.environ.get("REFIMPL_HYPOTHESIS_SEED") or random.SystemRandom().randrange(2 ** 32))


def pytest_report_header(config):
    profile = settings.get_current_profile_name()
    if settings.default.derandomize:
        return f"hypothesis: profile {profile!r}, derandomized (the same draws every run)"
    return (f"hypothesis: profile {profile!r}, seed {RUN_SEED} "
            f"(replay this run's draws: REFIMPL_HYPOTHESIS_SEED={RUN_SEED})")


VERIFIED = []  # (world size, configurations) of each drawn verify launch (test_verify_drawn.py)


def pytest_terminal_summary(terminalreporter):
    """The seed again at the end, where `pytest -q` shows it too, and how many configurations were verified."""
    terminalreporter.write_line(pytest_report_header(terminalreporter.config))
    if VERIFIED:
        by_world = {}
        for world, count in VERIFIED:
            by_world[world] = by_world.get(world, 0) + count
        worlds = ", ".join(f"{n} at {w} rank(s)" for w, n in sorted(by_world.items()))
        terminalreporter.write_line(f"verify: {sum(by_world.values())} drawn and pinned configurations equal "
                                    f"single-process training ({worlds})")


SLOW = {line for line in (Path(__file__).with_name("slow_tests.txt")).read_text().splitlines()
        if line and not line.startswith("#")}  # the slow tier, measured (slow_tests.py)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.split("[")[0] in SLOW:
            item.add_marker(pytest.mark.slow)
    scale = settings.default.max_examples // 25  # 1, or 10 under "deep"
    for test in {id(item.obj): item.obj for item in items if getattr(getattr(item, "obj", None),
                                                                     "is_hypothesis_test", False)}.values():
        own = getattr(test, "_hypothesis_internal_use_settings", None)
        if scale > 1 and own is not None and own.max_examples != settings.default.max_examples:
            # a test's own @settings(max_examples=N) becomes scale·N ("deep": 10x everywhere)
            test._hypothesis_internal_use_settings = settings(own, max_examples=scale * own.max_examples)
        if not settings.default.derandomize and getattr(test, "_hypothesis_internal_use_seed", None) is None:
            use_seed(RUN_SEED)(test)


def launches(per_profile_default: int = 1) -> int:
    """MPI launches of a drawn test: scaled with the profile (1 under "refimpl", 10 under "deep")."""
    return max(1, per_profile_default * settings.default.max_examples // 25)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
