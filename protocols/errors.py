"""One small error hierarchy for everything pfl-edge raises on purpose.

PflError
├── ProtocolError     malformed message, unsupported version, payload too large, bad checksum,
│                     tensor manifest mismatch, NaN/Inf in a tensor
├── RoundError        stale round, unknown device, round that cannot close
├── StateError        personal or coordinator state that cannot be written or read back
├── TrainingError     local training diverged (non-finite loss or gradient)
└── MemoryBudgetError the memory budget cannot fit even a micro-batch of one
"""

from __future__ import annotations


class PflError(Exception):
    """Base of every error pfl-edge raises deliberately; carries optional context."""

    def __init__(
        self,
        message: str,
        *,
        device_id: str | None = None,
        round_id: int | None = None,
        topic: str | None = None,
    ) -> None:
        self.device_id = device_id
        self.round_id = round_id
        self.topic = topic
        context = ", ".join(
            f"{key}={value}"
            for key, value in (("device", device_id), ("round", round_id), ("topic", topic))
            if value is not None
        )
        super().__init__(f"{message} [{context}]" if context else message)


class ProtocolError(PflError):
    """Inbound bytes or a message do not satisfy the wire contract."""


class RoundError(PflError):
    """A message does not fit the round in progress (stale round, unknown device)."""


class StateError(PflError):
    """State on disk cannot be written atomically or does not match what is expected."""


class TrainingError(PflError):
    """Local training produced a non-finite loss or gradient."""


class MemoryBudgetError(PflError):
    """Local training cannot fit in the memory budget even at a micro-batch of one."""


def describe(error: BaseException) -> str:
    """One line for a log or a status: our own errors say what is wrong, others name their type."""
    return str(error) if isinstance(error, PflError) else f"{type(error).__name__}: {error}"
