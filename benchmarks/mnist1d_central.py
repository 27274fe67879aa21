"""Centralized MNIST-1D accuracy of the task's models against the published figures.

The setting of the MNIST-1D paper (Greydanus 2020): the generator's default 4,000 train and
1,000 test signals, Adam at learning rate 0.01, minibatches of 100, 6,000 steps; the final test
accuracy is reported. Published: logistic regression 32%, MLP 68%, GRU 91%, CNN 94%.

    python -m benchmarks.mnist1d_central [--models cnn-paper,cnn,gru] [--steps 6000]
        [--seeds 0,1,2] [--batches random|cycle] [--out docs/results.md]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import torch

from benchmarks.common import choose, mean_std_cell, one_thread, publish_section
from pfl_tasks.base import Split
from pfl_tasks.mnist1d_task import Mnist1dTask, generate_mnist1d

PUBLISHED: Final = {"linear": 0.32, "mlp": 0.68, "gru": 0.91, "cnn": 0.94, "cnn-paper": 0.94}
"""Test accuracy in Greydanus 2020 (logistic regression is the "linear" model; the paper's CNN
is "cnn-paper", the task's larger "cnn" is set against the same figure)."""
MODELS: Final = ("cnn-paper", "cnn", "gru", "mlp", "linear")
"""The task's models with a published central figure (cnn-bn has none)."""
BATCHES: Final = ("random", "cycle")
"""How minibatches are drawn: uniformly at random with replacement, or (the paper's training
loop) consecutive slices of the training set in its order, wrapping around."""
STEPS: Final = 6000
BATCH_SIZE: Final = 100
LEARNING_RATE: Final = 0.01
REPO: Final = Path(__file__).resolve().parents[1]
MARKER: Final = "<!-- mnist1d-central -->"


@dataclass(frozen=True)
class CentralRun:
    """One centrally trained model: its final test accuracy and its parameter count."""

    model: str
    seed: int
    accuracy: float
    parameters: int
    seconds: float


def accuracy(model: torch.nn.Module, split: Split) -> float:
    """Top-1 accuracy of `model` on `split`, in evaluation mode."""
    model.eval()
    with torch.no_grad():
        correct = (model(split.inputs).argmax(dim=-1) == split.targets).sum().item()
    model.train()
    return float(correct) / len(split)


def batch_index(step: int, size: int, batches: str, generator: torch.Generator) -> torch.Tensor:
    """The training signals of minibatch `step` out of `size`, drawn as `batches` says."""
    if batches == "cycle":
        start = (step * BATCH_SIZE) % size
        return torch.arange(start, min(start + BATCH_SIZE, size))
    return torch.randint(size, (BATCH_SIZE,), generator=generator)


def train_central(
    model_name: str,
    train: Split,
    test: Split,
    *,
    steps: int = STEPS,
    seed: int = 0,
    batches: str = "random",
) -> CentralRun:
    """Train the task's `model_name` model with the paper's recipe and score it on `test`."""
    task = Mnist1dTask(model=model_name)  # type: ignore[arg-type]
    model = task.build_model(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE)
    generator = torch.Generator().manual_seed(seed)
    started = time.perf_counter()
    for step in range(steps):
        index = batch_index(step, len(train), batches, generator)
        optimizer.zero_grad()
        task.loss(model(train.inputs[index]), train.targets[index]).backward()
        optimizer.step()
    return CentralRun(
        model=model_name,
        seed=seed,
        accuracy=accuracy(model, test),
        parameters=sum(p.numel() for p in model.parameters()),
        seconds=time.perf_counter() - started,
    )


def table(runs: list[CentralRun], command: str) -> list[str]:
    """The section of docs/results.md: measured against published, one row per model."""
    lines = [
        "| model | parameters | test accuracy (measured) | published | seeds |",
        "|---|---|---|---|---|",
    ]
    for name in dict.fromkeys(run.model for run in runs):
        mine = [run for run in runs if run.model == name]
        cell = mean_std_cell([run.accuracy for run in mine], scale=100.0, digits=1)
        lines.append(
            f"| {name} | {mine[0].parameters:,} | {cell} % | {PUBLISHED[name]:.0%} | {len(mine)} |"
        )
    return [*lines, "", f"Command: `{command}`"]


def main(argv: list[str] | None = None) -> None:
    """Train each chosen model centrally and publish the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="cnn,gru,mlp,linear")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--batches", choices=BATCHES, default="random")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "results.md")
    args = parser.parse_args(argv)
    one_thread()
    data = generate_mnist1d()
    seeds = [int(seed) for seed in args.seeds.split(",")]
    runs = []
    for name in choose(args.models, MODELS, "models"):
        for seed in seeds:
            run = train_central(
                name, data.train, data.test, steps=args.steps, seed=seed, batches=args.batches
            )
            print(f"{name} seed {seed}: {run.accuracy:.3f} ({run.seconds:.0f} s)", flush=True)
            runs.append(run)
    command = (
        f"python -m benchmarks.mnist1d_central --models {args.models} --steps {args.steps} "
        f"--seeds {args.seeds} --batches {args.batches}"
    )
    lines = table(runs, command)
    publish_section(args.out, MARKER, lines)


if __name__ == "__main__":
    main()
