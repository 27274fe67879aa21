"""Pieces FedAlt and FedSim share: stage c fine-tunes only the personal part (spec §3.1(c))."""

import numpy as np
import pytest

from device_agent.algorithms.base import LocalUpdate
from device_agent.algorithms.fedalt import FedAltUpdate
from device_agent.algorithms.fedsim import FedSimUpdate
from protocols.algorithms import FedAltConfig, FedSimConfig, PartialConfig

from .linear_problem import PERSONAL, SHARED, descend, make_problem

GAMMA_V = 0.2
PARTIAL = [(FedAltUpdate(), FedAltConfig), (FedSimUpdate(), FedSimConfig)]


@pytest.mark.parametrize(("update", "config_type"), PARTIAL)
@pytest.mark.parametrize("finetune_lr", [None, 0.01])
def test_personalize_fine_tunes_only_the_personal_part(
    update: LocalUpdate, config_type: type[PartialConfig], finetune_lr: float | None
) -> None:
    # Prepare: three full-batch epochs; finetune_lr None falls back to personal_lr
    config = config_type(
        personal_lr=GAMMA_V, finetune_lr=finetune_lr, finetune_epochs=3, batch_size=12
    )
    problem = make_problem(config)
    expected = problem.params()
    for _ in range(3):
        expected = descend(problem.x, problem.y, expected, PERSONAL, finetune_lr or GAMMA_V)
    # Execute
    update.personalize(problem.ctx)
    # Assert
    after = problem.params()
    for name in SHARED:
        assert np.array_equal(after[name], expected[name])
    for name in PERSONAL:
        np.testing.assert_allclose(after[name], expected[name], rtol=1e-10)


@pytest.mark.parametrize(("update", "config_type"), PARTIAL)
def test_personalize_with_zero_epochs_keeps_the_model(
    update: LocalUpdate, config_type: type[PartialConfig]
) -> None:
    problem = make_problem(config_type(finetune_epochs=0))
    before = problem.params()
    update.personalize(problem.ctx)
    after = problem.params()
    assert all(np.array_equal(before[k], after[k]) for k in before)
