"""torch built against NumPy 1.x beside NumPy 2 (torch < 2.3 on a board) stops the agent clearly."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from device_agent.capabilities import require_numpy_bridge
from device_agent.cli import app


@pytest.fixture
def numpy_1_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.from_numpy as such a torch answers (seen: torch 2.1.2 beside NumPy 2.4 on arm64)."""

    def unavailable(array: np.ndarray) -> torch.Tensor:
        msg = "Numpy is not available"
        raise RuntimeError(msg)

    monkeypatch.setattr(torch, "from_numpy", unavailable)


def test_a_working_bridge_passes() -> None:
    require_numpy_bridge()


@pytest.mark.usefixtures("numpy_1_torch")
def test_a_broken_bridge_names_both_versions_and_the_fix() -> None:
    with pytest.raises(ValueError, match="numpy<2") as caught:
        require_numpy_bridge()
    assert f"torch {torch.__version__}" in str(caught.value)
    assert f"NumPy {np.__version__}" in str(caught.value)


@pytest.mark.usefixtures("numpy_1_torch")
def test_pfl_agent_start_stops_with_one_line_before_connecting(tmp_path) -> None:
    # Execute: the shard is loaded before the broker is dialled (nothing listens on port 1)
    result = CliRunner().invoke(
        app,
        ["start", "--broker", "mqtt://127.0.0.1:1", "--device-id", "old-torch", "--task", "digits",
         "--data-shard", "0", "--num-shards", "2", "--state-dir", str(tmp_path)],
    )  # fmt: skip
    # Assert
    assert result.exit_code == 2, result.output
    assert "numpy<2" in result.output
    assert "Traceback" not in result.output
