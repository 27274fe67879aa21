"""Every file parses as Python 3.10 (pyproject: requires-python >= 3.10; JetPack 6 ships 3.10).

The test suite runs on 3.11; syntax only 3.11+ accepts (`except*`, PEP 695 generics, ...) would
pass it and break a 3.10 board at import. `ast.parse(feature_version=(3, 10))` rejects such
syntax in any interpreter; where a real 3.10 interpreter is on the machine it also compiles every
file. The standard-library APIs are checked by mypy (`python_version = "3.10"` in pyproject).
"""

from __future__ import annotations

import ast
import glob
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("coordinator", "device_agent", "export", "pfl_tasks", "protocols", "benchmarks")


def _sources() -> list[Path]:
    files = [path for folder in FOLDERS for path in (ROOT / folder).rglob("*.py")]
    return sorted([*files, *(ROOT / "tests").rglob("*.py"), *(ROOT / "examples").rglob("*.py")])


def _python310() -> str | None:
    """A Python 3.10 interpreter on this machine: on PATH, or one of pyenv's."""
    pyenv = os.path.expanduser("~/.pyenv/versions/3.10*/bin/python3.10")
    for candidate in [shutil.which("python3.10"), *sorted(glob.glob(pyenv))]:
        if candidate is None:
            continue
        probe = subprocess.run([candidate, "--version"], capture_output=True, text=True)
        if probe.returncode == 0 and probe.stdout.startswith("Python 3.10"):
            return candidate
    return None


def test_the_feature_version_parse_rejects_newer_syntax() -> None:
    with pytest.raises(SyntaxError):
        ast.parse("try:\n    pass\nexcept* ValueError:\n    pass\n", feature_version=(3, 10))


def test_every_file_parses_as_python_310() -> None:
    failed = []
    for path in _sources():
        try:
            ast.parse(path.read_text(encoding="utf-8"), str(path), feature_version=(3, 10))
        except SyntaxError as error:
            failed.append(f"{path.relative_to(ROOT)}: {error}")
    assert len(_sources()) > 300
    assert failed == []


def test_a_python_310_interpreter_compiles_every_file() -> None:
    interpreter = _python310()
    if interpreter is None:
        pytest.skip("no Python 3.10 interpreter on this machine (the ast check above still ran)")
    code = (
        "import sys\n"
        "for path in sys.argv[1:]:\n"
        "    compile(open(path, encoding='utf-8').read(), path, 'exec', dont_inherit=True)\n"
    )
    done = subprocess.run(
        [interpreter, "-c", code, *map(str, _sources())], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
