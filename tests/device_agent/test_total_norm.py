"""require_finite works on torch older than 2.6, which has no torch.nn.utils.get_total_norm."""

from __future__ import annotations

import math

import pytest
import torch

from device_agent.training import require_finite, total_norm
from protocols.errors import TrainingError


@pytest.fixture
def torch_before_2_6(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.nn.utils as torch 2.1 to 2.5 have it (FedAlt failed so on arm64 with torch 2.1.2)."""
    monkeypatch.delattr(torch.nn.utils, "get_total_norm", raising=False)


def test_total_norm_is_the_norm_of_everything_together() -> None:
    values = [torch.tensor([3.0]), torch.tensor([[4.0, 0.0]], dtype=torch.float16)]
    assert float(total_norm(values)) == pytest.approx(5.0)


@pytest.mark.usefixtures("torch_before_2_6")
def test_finite_state_passes_and_non_finite_is_refused() -> None:
    state = {"w": torch.ones(3, 2), "steps": torch.tensor(4), "b": torch.zeros(0)}
    require_finite(state, "personal state")
    for bad in (math.nan, math.inf):
        state["w"][1, 1] = bad
        with pytest.raises(TrainingError, match="personal state became non-finite"):
            require_finite(state, "personal state")
