"""The centralized MNIST-1D benchmark's training: the CNN learns far above chance."""

from __future__ import annotations

from benchmarks.mnist1d_central import MODELS, PUBLISHED, table, train_central
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
    assert [line.split(" | ")[0].strip("| ") for line in lines[2:6]] == list(MODELS)
    assert lines[-1] == "Command: `python -m benchmarks.mnist1d_central --steps 1`"
