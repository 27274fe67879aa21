"""The centralized MNIST-1D benchmark's training: the CNN learns far above chance."""

from __future__ import annotations

import torch

from benchmarks.mnist1d_central import MODELS, PUBLISHED, batch_index, table, train_central
from pfl_tasks.base import Split
from pfl_tasks.mnist1d_task import MODELS as TASK_MODELS
from pfl_tasks.mnist1d_task import generate_mnist1d


def test_the_cnn_learns_well_above_chance_on_a_small_slice() -> None:
    # Prepare: 1,000 training signals, 300 held out (chance: 10%)
    data = generate_mnist1d()
    train = Split(data.train.inputs[:1000], data.train.targets[:1000])
    test = Split(data.test.inputs[:300], data.test.targets[:300])

    # Execute
    run = train_central("cnn", train, test, steps=200, seed=0)
    untrained = train_central("cnn", train, test, steps=0, seed=0)

    # Assert
    assert run.accuracy > 0.6
    assert untrained.accuracy < 0.3
    assert run.parameters == 16906


def test_every_model_has_a_published_figure_and_a_table_row() -> None:
    data = generate_mnist1d()
    tiny = Split(data.test.inputs[:20], data.test.targets[:20])
    runs = [train_central(name, tiny, tiny, steps=1) for name in MODELS]
    lines = table(runs, "python -m benchmarks.mnist1d_central --steps 1")
    assert set(PUBLISHED) == set(MODELS)
    assert set(MODELS) == set(TASK_MODELS) - {"cnn-bn"}  # the one the paper has no figure for
    assert [line.split(" | ")[0].strip("| ") for line in lines[2:7]] == list(MODELS)
    assert lines[-1] == "Command: `python -m benchmarks.mnist1d_central --steps 1`"


def test_cycled_batches_walk_the_training_set_in_order_and_wrap() -> None:
    generator = torch.Generator().manual_seed(0)
    assert batch_index(0, 250, "cycle", generator).tolist() == list(range(100))
    assert batch_index(2, 250, "cycle", generator).tolist() == list(range(200, 250))
    assert batch_index(5, 250, "cycle", generator).tolist() == list(range(100))
    drawn = batch_index(0, 250, "random", generator)
    assert len(drawn) == 100
    assert int(drawn.max()) < 250


def test_the_papers_cnn_learns_well_above_chance_with_the_papers_batches() -> None:
    data = generate_mnist1d()
    train = Split(data.train.inputs[:1000], data.train.targets[:1000])
    test = Split(data.test.inputs[:300], data.test.targets[:300])
    run = train_central("cnn-paper", train, test, steps=300, seed=0, batches="cycle")
    assert run.accuracy > 0.5
    assert run.parameters == 5210
