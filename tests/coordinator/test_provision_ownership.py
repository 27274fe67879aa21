"""provision gives mosquitto the files it reads as its own user, or says the command that will."""

from __future__ import annotations

import os
import pwd
from pathlib import Path

import pytest

from coordinator.ops.provision import BROKER_FILES, hand_to_broker_user, provision


def test_broker_files_go_to_the_broker_user_or_the_command_is_given(tmp_path: Path) -> None:
    # Prepare
    files = {name: tmp_path / name for name in BROKER_FILES}
    for path in files.values():
        path.write_text("x")
    # Execute: a user this host does not have (the broker runs elsewhere)
    command = hand_to_broker_user(files, user="no-such-broker-user")
    # Assert: nothing changed here, and the command names every broker file
    assert command is not None
    assert command.startswith("chown no-such-broker-user: ")
    assert all(str(path) in command for path in files.values())
    assert all(path.stat().st_uid == os.geteuid() for path in files.values())


@pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root; the command path is tested above")
def test_as_root_the_broker_files_belong_to_mosquitto(tmp_path: Path) -> None:
    # Prepare: the mosquitto package creates its user
    account = pwd.getpwnam("mosquitto")
    # Execute
    result = provision(["dev-1"], tmp_path / "deploy", use_mosquitto_passwd=False)
    # Assert: mosquitto's files are its own; the fleet's secrets stay with whoever provisioned
    assert result.chown_command is None
    for name in BROKER_FILES:
        assert result.files[name].stat().st_uid == account.pw_uid, name
    assert result.files["credentials.json"].stat().st_uid == 0
