"""Operator tools refuse the coordinator's account, whose session they would take over."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from coordinator.ops.identity import ToolAccountError, tool_client_id
from protocols.access import COORDINATOR_USER, VIEWER_USER
from protocols.transport.settings import BrokerSettings

URL = "mqtt://127.0.0.1:1"  # never reached: the refusal comes first


def test_each_tool_logs_in_under_an_id_of_its_own_account() -> None:
    viewer = tool_client_id(BrokerSettings(url=URL, username=VIEWER_USER), "status")
    anonymous = tool_client_id(BrokerSettings(url=URL), "status")
    assert viewer.startswith("pfl-viewer-status-")
    assert anonymous.startswith("pfl-status-")
    assert viewer != tool_client_id(BrokerSettings(url=URL, username=VIEWER_USER), "status")
    with pytest.raises(ToolAccountError, match="disconnect a running `serve`"):
        tool_client_id(BrokerSettings(url=URL, username=COORDINATOR_USER), "export")


@pytest.mark.parametrize("tool", ["status", "export"])
def test_a_tool_given_the_coordinators_account_says_so_in_one_line(tool: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "coordinator.cli.app", tool, "--broker", URL],
        env={
            **{k: v for k, v in os.environ.items() if not k.startswith("PFL_")},
            "PFL_USERNAME": COORDINATOR_USER,
            "PFL_PASSWORD": "x",
        },
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    output = " ".join((done.stdout + done.stderr).split())
    assert "Traceback" not in output
    assert f"{COORDINATOR_USER} is the coordinator's account" in output
    assert "viewer.env for status" in output
