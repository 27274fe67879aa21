"""Warnings said once per subject: a condition that repeats every round is news only once."""

from __future__ import annotations

import logging
import re
from collections.abc import Hashable

_FIRST_NUMBER = re.compile(r"\d")


def kind_of(reason: str) -> str:
    """A reason's wording up to its first number: `weight capped from 599 to 569` -> its kind."""
    return _FIRST_NUMBER.split(reason, maxsplit=1)[0].strip()


class OnceEach:
    """Logs a warning the first time for each key, and at debug level after that."""

    def __init__(self, logger: logging.Logger, later: str) -> None:
        self._logger = logger
        self._later = later
        self._said: set[Hashable] = set()

    def warning(self, key: Hashable, message: str) -> None:
        """`message` as a warning (with where later ones go) if `key` is new, else at debug."""
        if key in self._said:
            self._logger.debug("%s", message)
            return
        self._said.add(key)
        self._logger.warning("%s (%s)", message, self._later)
