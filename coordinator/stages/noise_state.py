"""A noise generator's state as JSON text: a resumed DP run draws the noise it would have."""

from __future__ import annotations

import base64
import binascii

import torch


def generator_state(generator: torch.Generator) -> str:
    """A noise generator's state, as text a JSON checkpoint holds."""
    return base64.b64encode(generator.get_state().numpy().tobytes()).decode()


def restore_generator(generator: torch.Generator, state: str) -> None:
    """Put `generator` where `generator_state` found it.

    Raises:
        ValueError: not a generator's state.
    """
    try:
        raw = base64.b64decode(state, validate=True)
        generator.set_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    except (TypeError, RuntimeError, binascii.Error) as error:
        msg = f"not a noise generator's state: {error}"
        raise ValueError(msg) from error
