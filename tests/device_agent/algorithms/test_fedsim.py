"""FedSim's device half against the closed form of spec §1.4."""

import itertools
from typing import Any

import numpy as np
import torch

from device_agent.algorithms import build_local_update
from device_agent.algorithms.fedavg import FedAvgUpdate
from device_agent.algorithms.fedsim import FedSimUpdate
from protocols.algorithms import FedAvgConfig, FedSimConfig

from .linear_problem import (
    PERSONAL,
    SHARED,
    Problem,
    assert_round_result,
    descend,
    gradients,
    make_problem,
)

GAMMA_U, GAMMA_V = 0.05, 0.2


def _local_sim(problem: Problem, tau: int) -> dict[str, np.ndarray]:
    """LocalSim with full batches: both gradients at the same point, each with its own step."""
    p = problem.params()
    for _ in range(tau):
        g = gradients(problem.x, problem.y, p)
        p = {k: v - (GAMMA_V if k in PERSONAL else GAMMA_U) * g[k] for k, v in p.items()}
    return p


def test_fedsim_matches_the_closed_form_simultaneous_descent() -> None:
    # Prepare: three full-batch steps with gamma_u != gamma_v
    config = FedSimConfig(lr=GAMMA_U, personal_lr=GAMMA_V, local_epochs=3, batch_size=12)
    problem = make_problem(config)
    start = problem.params()
    expected = _local_sim(problem, 3)
    # Execute
    result = FedSimUpdate().run(problem.ctx)
    # Assert
    assert_round_result(result, start, expected)
    assert tuple(result.shared_delta) == SHARED
    # ... and not the plausible wrong answers: one step size for both, or alternating
    one_lr = start
    for _ in range(3):
        one_lr = descend(problem.x, problem.y, one_lr, SHARED + PERSONAL, GAMMA_U)
    alternating = start
    for names in [PERSONAL] * 3 + [SHARED] * 3:
        alternating = descend(problem.x, problem.y, alternating, names, GAMMA_V)
    for wrong in (one_lr, alternating):
        assert not np.allclose(wrong["hidden.weight"], expected["hidden.weight"], rtol=1e-3)
        assert not np.allclose(wrong["output.weight"], expected["output.weight"], rtol=1e-3)


def test_fedsim_moves_both_parts_on_every_minibatch() -> None:
    # Prepare: 12 samples in batches of 5 (3 per epoch), 2 epochs capped at 5 steps
    config = FedSimConfig(batch_size=5, local_epochs=2, max_steps=5, personal_lr=0.3)
    problem = make_problem(config, record=True)
    # Execute
    FedSimUpdate().run(problem.ctx)
    # Assert: one loss call (one backward) per step, and both parts changed between calls
    calls = problem.task.calls
    assert len(calls) == 5
    for before, after in itertools.pairwise(calls):
        for name in SHARED + PERSONAL:
            assert not torch.equal(before[name][0], after[name][0]), name
            assert after[name][1]  # everything trains in the one phase


def test_fedsim_with_one_step_size_is_local_sgd_on_the_whole_model() -> None:
    # Spec §1.4: FedSim is ordinary local SGD, except that only u is sent back
    settings: dict[str, Any] = {"lr": 0.07, "batch_size": 5, "local_epochs": 2}
    fedsim = FedSimUpdate().run(make_problem(FedSimConfig(**settings)).ctx)
    fedavg = FedAvgUpdate().run(make_problem(FedAvgConfig(**settings)).ctx)
    for name in SHARED:
        assert torch.equal(fedsim.shared_delta[name], fedavg.shared_delta[name])
    assert fedsim.train_loss == fedavg.train_loss


def test_fedsim_is_registered() -> None:
    assert isinstance(build_local_update("fedsim"), FedSimUpdate)
