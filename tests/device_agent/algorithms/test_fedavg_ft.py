"""FedAvg+FT's fine-tuning keeps the better of fine-tuned and global model on validation."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from device_agent.algorithms.fedavg_ft import FedAvgFtUpdate
from device_agent.training import at_least_as_good
from pfl_tasks.base import Split
from protocols.algorithms import FedAvgFtConfig
from tests.device_agent.algorithms.linear_problem import make_problem


@pytest.mark.parametrize(
    ("metric", "candidate", "incumbent", "expected"),
    [
        ("accuracy", 0.9, 0.8, True),
        ("accuracy", 0.8, 0.8, True),  # ties keep the candidate (the fine-tuned model)
        ("accuracy", 0.7, 0.8, False),
        ("mse", 0.1, 0.2, True),
        ("mse", 0.3, 0.2, False),
        ("mse", math.nan, 0.2, False),
        ("accuracy", 0.5, math.nan, True),  # nothing to compare with (an empty split)
    ],
)
def test_at_least_as_good(metric: str, candidate: float, incumbent: float, expected: bool) -> None:
    assert at_least_as_good(metric, candidate, incumbent) is expected


def _fine_tuned(
    select: bool, validation_targets_flipped: bool
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    problem = make_problem(FedAvgFtConfig(finetune_select=select, finetune_lr=0.05))
    ctx = problem.ctx
    if validation_targets_flipped:  # fine-tuning on train moves away from these targets
        val = ctx.data.train
        ctx = dataclasses.replace(
            ctx, data=dataclasses.replace(ctx.data, val=Split(val.inputs, -10 * val.targets))
        )
    before = {k: v.clone() for k, v in ctx.model.state_dict().items()}
    FedAvgFtUpdate().personalize(ctx)
    return before, dict(ctx.model.state_dict())


def test_the_global_model_stays_where_fine_tuning_loses_on_validation() -> None:
    before, after = _fine_tuned(select=True, validation_targets_flipped=True)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_fine_tuning_is_kept_where_it_wins_on_validation() -> None:
    before, after = _fine_tuned(select=True, validation_targets_flipped=False)
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_without_selection_every_device_fine_tunes() -> None:
    before, after = _fine_tuned(select=False, validation_targets_flipped=True)
    assert any(not torch.equal(before[k], after[k]) for k in before)
