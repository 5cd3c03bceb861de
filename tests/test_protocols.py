"""Every gradient strategy provides protocols.GradientStrategy; both trainers provide Checkpointable."""

import pytest

from refimpl.local_trainer import LocalTrainer
from refimpl.parallel.comm import LocalComm
from refimpl.parallel.data_parallel import DataParallel
from refimpl.parallel.pipeline.stage import split_model
from refimpl.parallel.trainer import Trainer
from refimpl.parallel.zero import STAGES
from refimpl.protocols import Checkpointable, GradientStrategy, Verifiable, missing
from refimpl.tools.run import TrainConfig, build_model, build_optimizer, build_task, make_trainer


def _model():
    cfg = TrainConfig(model="gpt", steps=1, batch_size=4, n_layer=1, d_model=8, n_head=2, seq_len=8)
    return cfg, build_model(cfg, build_task(cfg))


@pytest.mark.parametrize("stage", [None, 0, 1, 2, 3])
def test_every_gradient_strategy_has_the_protocols_members(stage):
    cfg, model = _model()
    parts = split_model(model, 1)  # one stage: the whole model, as the trainer hands it over
    if stage is None:
        strategy = DataParallel(parts, lambda params: build_optimizer(cfg, params), LocalComm())
    else:
        strategy = STAGES[stage](model, parts, build_optimizer(cfg, []), LocalComm())
    assert missing(strategy, GradientStrategy) == []
    assert isinstance(strategy, GradientStrategy)


@pytest.mark.parametrize("distributed", [False, True])
def test_both_trainers_are_verifiable_and_checkpointable(distributed):
    cfg, model = _model()
    trainer = make_trainer(cfg, model, LocalComm(), distributed=distributed)
    assert isinstance(trainer, Trainer if distributed else LocalTrainer)
    assert missing(trainer, Verifiable) == [] and missing(trainer, Checkpointable) == []


def test_missing_names_what_a_trainer_lacks():
    class Partial:
        world_size, rank = 1, 0

        def step(self, x, y):
            return 0.0

    assert "full_parameters" in missing(Partial(), Verifiable) and "ledger" in missing(Partial(), Checkpointable)
