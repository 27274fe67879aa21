"""Tests that docs/protocol.md is exactly what the code renders, so the two cannot drift."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from protocols import topics
from protocols.messages import ALL_MESSAGE_TYPES, Message
from protocols.schema import PROTOCOL_DOC, main, render_protocol_markdown
from protocols.versions import PROTOCOL_VERSION


def test_protocol_doc_is_up_to_date() -> None:
    # Execute
    rendered = render_protocol_markdown()

    # Assert
    assert PROTOCOL_DOC.read_text(encoding="utf-8") == rendered, (
        "docs/protocol.md is stale; run `python -m protocols.schema`"
    )


def test_rendering_is_deterministic() -> None:
    # Assert
    assert render_protocol_markdown() == render_protocol_markdown()


@pytest.mark.parametrize("message_type", ALL_MESSAGE_TYPES, ids=lambda cls: cls.__name__)
def test_every_message_schema_appears_in_the_doc(message_type: type[Message]) -> None:
    # Prepare
    text = render_protocol_markdown()
    kind = message_type.model_fields["kind"].default

    # Execute
    section = text.split(f"### `{kind}`: {message_type.__name__}\n", 1)[1]
    schema = re.search(r"```json\n(.*?)\n```", section, re.DOTALL)

    # Assert
    assert schema is not None
    assert json.loads(schema.group(1)) == message_type.model_json_schema()


def test_doc_states_the_version_frame_layout_and_topics() -> None:
    # Prepare
    text = render_protocol_markdown()

    # Assert
    assert f"Protocol version: **{PROTOCOL_VERSION}**" in text
    assert "`PFL\\x01`" in text
    assert "big-endian" in text
    assert "safetensors" in text
    assert "QoS 1" in text
    assert "chunked" in text
    for line in (topics.__doc__ or "").splitlines():
        if line.startswith("    pfl/"):
            assert line.strip() in text


def test_check_flags_a_stale_file_and_write_fixes_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Prepare
    output = tmp_path / "protocol.md"
    output.write_text("stale\n", encoding="utf-8")

    # Execute
    stale = main(["--check", "--output", str(output)])
    written = main(["--output", str(output)])
    fresh = main(["--check", "--output", str(output)])

    # Assert
    assert (stale, written, fresh) == (1, 0, 0)
    assert output.read_text(encoding="utf-8") == render_protocol_markdown()
    assert "out of date" in capsys.readouterr().out
