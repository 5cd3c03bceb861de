import os

import numpy as np
import pytest
from hypothesis import settings

# Hypothesis: explicit example counts and no deadline (these machines are noisy).
settings.register_profile("refimpl", max_examples=25, deadline=None, derandomize=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "refimpl"))


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
