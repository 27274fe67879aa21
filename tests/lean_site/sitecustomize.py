"""Makes the packages named in PFL_TEST_UNIMPORTABLE unimportable in this interpreter.

Put on PYTHONPATH by tests/device_agent/test_lean_agent.py: Python runs `sitecustomize` at
start-up, before any of our code, so an agent started this way behaves as one installed without
the coordinator's extra (`import sklearn` raises ModuleNotFoundError as if it were absent).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType

UNIMPORTABLE = frozenset(filter(None, os.environ.get("PFL_TEST_UNIMPORTABLE", "").split(",")))


class Unimportable:
    """A meta-path finder, first in line, that refuses the listed top-level packages."""

    def find_spec(
        self, name: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        """Refuse a listed package (and its submodules); leave every other import alone."""
        del path, target
        if name.split(".")[0] in UNIMPORTABLE:
            message = f"No module named {name!r}"
            raise ModuleNotFoundError(message, name=name)
        return None


sys.meta_path.insert(0, Unimportable())
