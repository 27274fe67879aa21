"""Start-up cost of the CLI: what `import coordinator.cli.app` costs and which packages it loads.

Feature-only packages (differential privacy's accountant, the dashboard's server, the report's
plots, ...) load where their feature runs; this measures the path every command shares, in fresh
interpreters: the cumulative import time `python -X importtime` reports for the CLI module, the
wall time of `pfl-coord --help`, and which feature-only packages are in `sys.modules` afterwards.

    python -m benchmarks.startup [--repeats 5] [--out docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from benchmarks.common import markdown_table, publish_section

MODULE: Final = "coordinator.cli.app"
FEATURE_ONLY: Final = ("dp_accounting", "scipy", "starlette", "uvicorn", "matplotlib", "sklearn")
"""Packages only a feature needs (DP accounting, the dashboard, reports); none loads with the CLI."""
STILL_LOADED: Final = ("torch", "numpy", "cryptography", "amqtt", "paho", "onnx", "onnxruntime")
"""Heavy packages the CLI's import path still loads, reported for the record."""
MARKER: Final = "<!-- startup -->"
CUMULATIVE: Final = re.compile(r"import time:\s+\d+ \|\s+(\d+) \| " + re.escape(MODULE) + r"$")


def loaded_after_import(statement: str, packages: Sequence[str]) -> list[str]:
    """Which of `packages` a fresh interpreter has in `sys.modules` after running `statement`."""
    code = f"import json, sys\n{statement}\nprint(json.dumps([p for p in {list(packages)!r} if p in sys.modules]))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded: list[str] = json.loads(out.stdout.strip().splitlines()[-1])
    return loaded


def import_seconds() -> float:
    """The CLI module's cumulative import time in one fresh interpreter (`-X importtime`)."""
    run = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", f"import {MODULE}"],
        capture_output=True,
        text=True,
        check=True,
    )
    for line in run.stderr.splitlines():
        found = CUMULATIVE.match(line.rstrip())
        if found:
            return int(found.group(1)) / 1e6
    message = f"no import time line for {MODULE}"
    raise RuntimeError(message)


def help_seconds() -> float:
    """Wall time of `pfl-coord --help` (the console script's entry point, in a fresh process)."""
    code = f"import sys; sys.argv[0] = 'pfl-coord'; from {MODULE} import app; app()"
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-c", code, "--help"], capture_output=True, check=True, env=os.environ
    )
    return time.perf_counter() - start


def measure(repeats: int) -> tuple[float, float]:
    """Medians of `repeats` alternating runs: import time and `--help` wall time, in seconds."""
    imports, helps = [], []
    for _ in range(repeats):
        imports.append(import_seconds())
        helps.append(help_seconds())
    return statistics.median(imports), statistics.median(helps)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks.md"))
    parser.add_argument(
        "--before",
        default=None,
        help="'IMPORT_S,HELP_S' measured the same way on the code before the change, for the table",
    )
    args = parser.parse_args(argv)
    imported, helped = measure(args.repeats)
    rows = []
    if args.before:
        old_import, old_help = (float(v) for v in args.before.split(","))
        rows.append(["before (eager imports)", f"{old_import:.2f}", f"{old_help:.2f}"])
    rows.append(["now", f"{imported:.2f}", f"{helped:.2f}"])
    absent = [p for p in FEATURE_ONLY if p not in loaded_after_import(f"import {MODULE}", FEATURE_ONLY)]
    still = loaded_after_import(f"import {MODULE}", STILL_LOADED)
    lines = [
        "## Start-up: importing the CLI",
        "",
        f"Median of {args.repeats} fresh interpreters each; the machine was shared (other jobs "
        "running), so compare rows measured together.",
        "",
        *markdown_table(
            ["code", f"`import {MODULE}`, cumulative (s)", "`pfl-coord --help`, wall (s)"], rows
        ),
        "",
        f"Not loaded by `import {MODULE}` (checked in `sys.modules`): "
        + ", ".join(f"`{p}`" for p in absent)
        + ". Still loaded on that path: "
        + ", ".join(f"`{p}`" for p in still)
        + ".",
        "",
        "Command: `python -m benchmarks.startup` (`--before IMPORT_S,HELP_S` adds the row of an "
        "earlier checkout measured with the same command).",
    ]
    publish_section(args.out, MARKER, lines)


if __name__ == "__main__":
    main()
