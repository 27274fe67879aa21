"""Do the defaults work where each algorithm is documented? Its examples, as written and bare.

For every `pfl-coord simulate` example on an algorithm's page (docs/algorithms/): the run as
written (its `--config` reads the page's TOML block), the same workload at the algorithm's
defaults (without `--lr`, `--local-epochs`, `--batch-size` and `--config`), and local training at
its defaults on that workload, the reference every personalized method must beat. Seeds 0 to
N-1; the personalized mean of the final evaluation.

    OMP_NUM_THREADS=1 python -m benchmarks.defaults_check [--seeds 2] [--out docs/results.md]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import markdown_table, publish_section
from benchmarks.doc_commands import fenced_commands, flag_value, toml_block, without_flags

MARKER = "<!-- defaults-check -->"
PAGES = Path("docs/algorithms")
HYPERPARAMETERS = frozenset({"--lr", "--local-epochs", "--batch-size", "--config"})
"""What a bare run drops: the algorithm's own settings, leaving the workload."""
ALGORITHM_ONLY = frozenset({"--algorithm", "--pretrain-rounds", "--personal-preset", "--personal"})
"""What the local reference drops besides the hyperparameters."""
GLOBAL_ONLY = frozenset({"fedavg", "fedprox"})
"""Algorithms that deploy one global model: beating local is not what they are for."""


@dataclass(frozen=True)
class Example:
    """One documented simulation: its page, its words, and the TOML its --config reads."""

    page: str
    words: tuple[str, ...]
    toml: str | None

    @property
    def algorithm(self) -> str:
        """The algorithm the example runs."""
        return flag_value(list(self.words), "--algorithm") or "fedavg"

    def workload(self) -> str:
        """The example's flags that are not the algorithm's hyperparameters, for the table."""
        kept = without_flags(list(self.words[2:]), HYPERPARAMETERS | {"--out", "--algorithm"})
        return " ".join(kept)

    def bare(self) -> list[str]:
        """The same workload at the algorithm's defaults."""
        return without_flags(list(self.words), HYPERPARAMETERS | {"--out"})

    def local(self) -> list[str]:
        """Local training at its defaults on the same workload."""
        words = without_flags(list(self.words), HYPERPARAMETERS | ALGORITHM_ONLY | {"--out"})
        return [*words, "--algorithm", "local"]

    def as_written(self) -> list[str] | None:
        """The example as the page shows it; None when it sets no hyperparameter."""
        if not any(flag in self.words for flag in HYPERPARAMETERS):
            return None
        return without_flags(list(self.words), frozenset({"--out"}))


def examples(pages: Path) -> list[Example]:
    """Every simulate example of every algorithm page, in page order."""
    found = []
    for page in sorted(pages.glob("*.md")):
        text = page.read_text()
        for words in fenced_commands(text):
            if words[:2] == ["pfl-coord", "simulate"]:
                found.append(Example(page.name, tuple(words), toml_block(text)))
    return found


def simulate(words: list[str], seed: int, toml: str | None) -> tuple[float, str]:
    """One run in a fresh process; (personalized mean, metric name)."""
    with tempfile.TemporaryDirectory() as scratch:
        command = [sys.executable, "-m", "coordinator.cli.app", *words[1:]]
        if "--config" in words:
            config = Path(scratch) / "options.toml"
            config.write_text(toml or "")
            command[command.index("--config") + 1] = str(config)
        command += ["--seed", str(seed), "--workers", "1", "--out", f"{scratch}/run"]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run(command, check=True, capture_output=True, env=env)
        summary = json.loads((Path(scratch) / "run" / "summary.json").read_text())
    return float(summary["metrics"]["personalized_mean"]), str(summary["metric_name"])


def mean_of(
    pool: ThreadPoolExecutor, words: list[str], seeds: int, toml: str | None
) -> tuple[float, str]:
    """The mean over seeds of `words`' personalized mean, and the metric's name."""
    runs = list(pool.map(lambda seed: simulate(words, seed, toml), range(seeds)))
    return statistics.fmean(value for value, _ in runs), runs[0][1]


def better(metric: str, candidate: float, reference: float) -> bool:
    """Whether `candidate` beats `reference` (MSE: lower is better)."""
    return candidate < reference if metric == "mse" else candidate > reference


def main() -> None:
    """Run every example three ways and write the table."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("docs/results.md"))
    args = parser.parse_args()
    rows = []
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        for example in examples(PAGES):
            bare = mean_of(pool, example.bare(), args.seeds, None)
            as_written = example.as_written()
            written = (
                None if as_written is None else mean_of(pool, as_written, args.seeds, example.toml)
            )
            local = mean_of(pool, example.local(), args.seeds, None)
            metric = bare[1]
            verdict = "yes" if better(metric, bare[0], local[0]) else "**no**"
            if example.algorithm in GLOBAL_ONLY:
                verdict = f"{verdict.strip('*')} (one global model)"
            rows.append(
                [
                    example.algorithm,
                    f"`{example.workload()}`",
                    metric,
                    f"{bare[0]:.4f}",
                    "=" if written is None else f"{written[0]:.4f}",
                    f"{local[0]:.4f}",
                    verdict if example.algorithm != "local" else "-",
                ]
            )
            print(" | ".join(rows[-1]), flush=True)
    header = ["algorithm", "workload", "metric", "defaults", "as written", "local", "beats local"]
    publish_section(
        args.out,
        MARKER,
        [
            "## Defaults against each algorithm's documented examples",
            "",
            "Every `pfl-coord simulate` example of the algorithm pages, at the algorithm's "
            "defaults (without `--lr`, `--local-epochs`, `--batch-size` and `--config`), as "
            "written (`=`: the example sets none of them) and as local training at its defaults; "
            f"personalized mean of seeds 0-{args.seeds - 1}.",
            "",
            *markdown_table(header, rows),
            "",
            "Command: `OMP_NUM_THREADS=1 python -m benchmarks.defaults_check "
            f"--seeds {args.seeds}`.",
        ],
    )


if __name__ == "__main__":
    main()
