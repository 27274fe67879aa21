"""Start-up cost of the CLI: what `import coordinator.cli.app` costs and which packages it loads.

Feature-only packages (differential privacy's accountant, the dashboard's server, the report's
plots, ...) load where their feature runs; this measures the path every command shares, in fresh
interpreters: the cumulative import time `python -X importtime` reports for the CLI module, the
wall time of `pfl-coord --help`, and which feature-only packages are in `sys.modules` afterwards.

    python -m benchmarks.startup [--repeats 5] [--before-root DIR] [--out docs/benchmarks.md]

`--before-root` is another checkout (e.g. `git worktree add --detach /tmp/before main`): its code
is measured the same way, alternating run by run with this one's, for a before/after row.
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
FEATURE_ONLY: Final = (
    *("dp_accounting", "scipy", "starlette", "uvicorn", "matplotlib", "sklearn"),
    *("onnx", "onnxruntime", "amqtt"),
)
"""Packages only a feature needs (DP accounting, the dashboard, reports, ONNX export, the
embedded broker): none loads with it."""
STILL_LOADED: Final = ("torch", "numpy", "cryptography", "paho")
"""Heavy packages the CLI's import path still loads, reported for the record."""
DEMO_ARGS: Final = (
    *("simulate", "--task", "digits", "--algorithm", "fedavg-ft"),
    *("--devices", "20", "--rounds", "10", "--seed", "0"),
)
"""The README's demo: its whole-process time is start-up plus the run."""
MARKER: Final = "<!-- startup -->"
CUMULATIVE: Final = re.compile(r"import time:\s+\d+ \|\s+(\d+) \| " + re.escape(MODULE) + r"$")


def loaded_after_import(statement: str, packages: Sequence[str]) -> list[str]:
    """Which of `packages` a fresh interpreter has in `sys.modules` after running `statement`."""
    wanted = list(packages)
    report = f"print(json.dumps([p for p in {wanted!r} if p in sys.modules]))"
    code = f"import json, sys\n{statement}\n{report}"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded: list[str] = json.loads(out.stdout.strip().splitlines()[-1])
    return loaded


def code_of(root: Path) -> dict[str, str]:
    """The environment of a fresh interpreter that imports the checkout at `root`."""
    return {**os.environ, "PYTHONPATH": str(root.resolve())}


def commit_of(root: Path) -> str:
    """The checkout's commit, for the row's name (with `+` when its work tree has changes)."""
    git = ["git", "-C", str(root)]
    commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    changed = subprocess.run([*git, "status", "--porcelain"], capture_output=True, text=True)
    return commit.stdout.strip() + ("+" if changed.stdout.strip() else "")


def import_seconds(root: Path) -> float:
    """The CLI module's cumulative import time in one fresh interpreter (`-X importtime`)."""
    run = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", f"import {MODULE}"],
        capture_output=True,
        text=True,
        check=True,
        env=code_of(root),
        cwd=root,
    )
    for line in run.stderr.splitlines():
        found = CUMULATIVE.match(line.rstrip())
        if found:
            return int(found.group(1)) / 1e6
    message = f"no import time line for {MODULE}"
    raise RuntimeError(message)


def help_seconds(root: Path, args: Sequence[str] = ("--help",)) -> float:
    """Wall time of `pfl-coord ARGS` (the console script's entry point, in a fresh process)."""
    code = f"import sys; sys.argv[0] = 'pfl-coord'; from {MODULE} import app; app()"
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        check=True,
        env=code_of(root),
        cwd=root,
    )
    return time.perf_counter() - start


def measure(roots: Sequence[Path], repeats: int, demos: int) -> list[tuple[float, float, float]]:
    """Per checkout, the medians (import, `--help`, README demo; s) of alternating runs."""
    imports: list[list[float]] = [[] for _ in roots]
    helps: list[list[float]] = [[] for _ in roots]
    runs: list[list[float]] = [[] for _ in roots]
    for repeat in range(repeats):
        for index, root in enumerate(roots):
            imports[index].append(import_seconds(root))
            helps[index].append(help_seconds(root))
            if repeat < demos:
                runs[index].append(help_seconds(root, DEMO_ARGS))
    return [
        (statistics.median(i), statistics.median(h), statistics.median(r))
        for i, h, r in zip(imports, helps, runs, strict=True)
    ]


def main(argv: Sequence[str] | None = None) -> None:
    """Measure, then write the section of `--out`."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--demo-repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks.md"))
    parser.add_argument("--before-root", type=Path, default=None, help="checkout to compare")
    args = parser.parse_args(argv)
    here = Path(__file__).resolve().parent.parent
    roots = [here] if args.before_root is None else [args.before_root, here]
    names = [f"{commit_of(root)}" for root in roots]
    demos = max(1, min(args.demo_repeats, args.repeats))
    rows = [
        [name, f"{imported:.2f}", f"{helped:.2f}", f"{demo:.2f}"]
        for name, (imported, helped, demo) in zip(
            names, measure(roots, args.repeats, demos), strict=True
        )
    ]
    loaded = loaded_after_import(f"import {MODULE}", FEATURE_ONLY)
    absent = [p for p in FEATURE_ONLY if p not in loaded]
    still = loaded_after_import(f"import {MODULE}", STILL_LOADED)
    lines = [
        "## Start-up: importing the CLI",
        "",
        f"Median of {args.repeats} fresh interpreters each ({demos} for the README's demo, "
        f"`pfl-coord {' '.join(DEMO_ARGS)}`), alternating between the rows' checkouts; "
        "2 shared cores with other jobs running, so only rows measured together compare.",
        "",
        *markdown_table(
            [
                "commit",
                f"`import {MODULE}`, cumulative (s)",
                "`pfl-coord --help`, wall (s)",
                "demo, whole process (s)",
            ],
            rows,
        ),
        "",
        f"Not loaded by `import {MODULE}` (checked in `sys.modules`): "
        + ", ".join(f"`{p}`" for p in absent)
        + ". Still loaded on that path: "
        + ", ".join(f"`{p}`" for p in still)
        + ".",
        "",
        "Command: `python -m benchmarks.startup --before-root DIR` (DIR: a checkout of the "
        "code before lazy imports).",
    ]
    publish_section(args.out, MARKER, lines)


if __name__ == "__main__":
    main()
