"""The one compatibility check of a run, and docs/compatibility.md written from the same source.

`check` asks every feature the run turns on (coordinator/stages/features.py) what it needs of
each stage's algorithm and of the other features, and raises the first problem with its reason.
`python -m coordinator.stages.compatibility [--check]` writes (or checks) the algorithm x
feature and feature x feature tables; tests/coordinator/test_compatibility.py runs every cell.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from pydantic import ValidationError
from torch import nn

from coordinator.run.sections import GuardOptions
from coordinator.run.settings import RunSettings, SimulationSettings
from coordinator.stages.features import FEATURES, Choices, Feature
from pfl_tasks.registry import load_task
from pfl_tasks.split import state_kinds
from protocols.algorithms import ALGORITHM_CONFIGS, AlgorithmConfig, parse_algorithm_config
from protocols.capabilities import SHARING
from protocols.settings_errors import describe_settings_error

COMPATIBILITY_MD: Final = Path(__file__).resolve().parents[2] / "docs" / "compatibility.md"
REGENERATE: Final = "python -m coordinator.stages.compatibility"
VARIANTS: Final[tuple[tuple[str, Mapping[str, object]], ...]] = (
    ("fedavg", {"robust_aggregation": "median"}),
    ("fedavg", {"clip_update_norm": 1.0}),
    ("pfedbred", {"train_all_clients": True}),
)
"""Settings that change what an algorithm shares: rows of their own in the algorithm table."""


def choices_of(settings: RunSettings, model: nn.Module | None = None) -> Choices:
    """What `settings` turn on for `model`, as the features read it (None: the task's model)."""
    if model is None:
        model = load_task(settings.task, settings.task_options).build_model(0)
    has_statistics = "statistic" in state_kinds(model).values()
    defaults = GuardOptions.model_fields
    guard = {
        "norm_bound": (settings.guard.norm_bound, 0.0),
        "max_count_ratio": (settings.guard.max_count_ratio, 0.0),
        "max_weight_share": (settings.guard.max_weight_share, 1.0),
    }
    simulated = settings if isinstance(settings, SimulationSettings) else None
    return Choices(
        privacy=settings.privacy(),
        secure=settings.secagg.enabled,
        asynchronous=settings.mode == "async",
        uplink=settings.uplink(),
        downlink=settings.compress.down,
        pretrain_rounds=settings.pretrain_rounds,
        participation=settings.participation,
        guard_flags=frozenset(
            name
            for name, (value, off) in guard.items()
            if value not in (off, defaults[name].default)
        ),
        stateless=simulated is not None and simulated.stateless,
        tier=bool(settings.tier.names()),
        simulation=simulated is not None,
        simulated_clock=simulated is not None
        and settings.mode == "sync"
        and simulated.sync_on_simulated_clock(),
        norm_stats=settings.norm_stats if has_statistics else None,
    )


def problem(
    settings: RunSettings, configs: Sequence[AlgorithmConfig], model: nn.Module | None = None
) -> str | None:
    """The first reason the run cannot go as asked, prefixed with its feature (None: it can).

    `configs` are the algorithm configs of the run's stages (pretraining, then the algorithm);
    `model` the run's (None: the task's, built here).
    """
    try:
        choices = choices_of(settings, model)
    except ValidationError as invalid:  # options of one feature that contradict each other
        return f"differential privacy: {describe_settings_error(invalid)}"
    active = [feature for feature in FEATURES if feature.on(choices)]
    keys = {feature.key for feature in active}
    for feature in active:
        reasons = [feature.refuses(config, choices) for config in configs]
        reasons += [why for key, why in feature.needs.items() if key not in keys]
        reasons += [why for key, why in feature.conflicts.items() if key in keys]
        for reason in reasons:
            if reason is not None:
                return f"{feature.title}: {reason}"
    return None


def check(
    settings: RunSettings, configs: Sequence[AlgorithmConfig], model: nn.Module | None = None
) -> None:
    """Refuse a run whose features do not compose with each other or with its algorithms.

    Raises:
        ValueError: the first problem, e.g. "differential privacy: selffl: ...".
    """
    found = problem(settings, configs, model)
    if found is not None:
        raise ValueError(found)


def resolutions(
    settings: RunSettings,
    configs: Sequence[AlgorithmConfig],
    among: Sequence[str] | None = None,
    model: nn.Module | None = None,
) -> list[str]:
    """The declared changes the run's features make to each other and for its algorithms.

    With `among` (feature keys), only the changes that involve one of those features.
    """
    choices = choices_of(settings, model)
    active = [feature for feature in FEATURES if feature.on(choices)]
    keys = {feature.key for feature in active}
    involved = keys if among is None else set(among)
    found = [
        f"{feature.key}: {text}"
        for feature in active
        for key, text in feature.resolutions.items()
        if key in keys and {key, feature.key} & involved
    ]
    for feature in (feature for feature in active if feature.key in involved):
        found += [f"{feature.key}: {n}" for n in map(feature.note, configs) if n is not None]
    return found


@dataclass(frozen=True)
class Cell:
    """One cell of a table: the settings it stands for and what the check says of them."""

    row: str
    column: str
    values: Mapping[str, Any]
    """`SimulationSettings` values (the compatibility tests add a tiny task and fleet)."""
    problem: str | None
    notes: tuple[str, ...]


def stage_configs(settings: RunSettings) -> list[AlgorithmConfig]:
    """The configs of the stages `settings` plan: FedAvg pretraining (if asked), the algorithm."""
    pretrain = [parse_algorithm_config("fedavg", {})] if settings.pretrain_rounds else []
    return [*pretrain, settings.algorithm_config()]


def _cell(row: str, column: str, values: Mapping[str, Any], among: Sequence[str]) -> Cell:
    settings = SimulationSettings(**values)
    configs = stage_configs(settings)
    model = load_task(settings.task, settings.task_options).build_model(0)
    found = problem(settings, configs, model)
    notes = () if found is not None else tuple(resolutions(settings, configs, among, model))
    return Cell(row, column, values, found, notes)


def _rows() -> list[tuple[str, dict[str, Any]]]:
    rows: list[tuple[str, dict[str, Any]]] = [
        (name, {"algorithm": name}) for name in ALGORITHM_CONFIGS
    ]
    for name, options in VARIANTS:
        label = ", ".join(f"{key} {value}" for key, value in options.items())
        rows.append((f"{name} ({label})", {"algorithm": name, "algorithm_options": dict(options)}))
    return rows


def _standalone(feature: Feature) -> bool:
    """Whether the feature runs without another one (the rest need a partner to show)."""
    return not feature.needs


def algorithm_cells() -> list[Cell]:
    """Every algorithm (and variant) with every feature that runs on its own."""
    return [
        _cell(row, feature.key, {**values, **feature.example}, [feature.key])
        for row, values in _rows()
        for feature in FEATURES
        if _standalone(feature)
    ]


def feature_cells() -> list[Cell]:
    """FedAvg with every two features whose settings differ, and on the diagonal each alone."""
    cells = []
    for i, first in enumerate(FEATURES):
        for second in FEATURES[i:]:
            shared = first.example.keys() & second.example.keys()
            if any(first.example[key] != second.example[key] for key in shared):
                continue  # two choices of one setting (int8 or top-k uplink)
            values = {"algorithm": "fedavg", **first.example, **second.example}
            cells.append(_cell(first.key, second.key, values, [first.key, second.key]))
    return cells


class _Footnotes:
    """Long texts as numbered footnotes under a table, each text numbered once."""

    def __init__(self) -> None:
        self.numbers: dict[str, int] = {}

    def ref(self, text: str) -> str:
        return f"[{self.numbers.setdefault(text, len(self.numbers) + 1)}]"

    def lines(self) -> list[str]:
        return ["", *(f"[{n}] {text}  " for text, n in self.numbers.items()), ""]


def _label(key: str) -> str:
    return f"`{key}`" if key.startswith("-") else key


def _row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _table(cells: Sequence[Cell], rows: Sequence[str], columns: Sequence[str]) -> list[str]:
    """A markdown table of "works" / "no" cells, each reason and resolution as a footnote."""
    notes = _Footnotes()

    def mark(cell: Cell | None) -> str:
        if cell is None:
            return ""
        if cell.problem is not None:
            return f"no {notes.ref(cell.problem)}"
        return " ".join(["works", *map(notes.ref, cell.notes)])

    by_place = {(cell.row, cell.column): cell for cell in cells}
    lines = [_row(["", *map(_label, columns)]), "|---" * (len(columns) + 1) + "|"]
    for row in rows:
        lines.append(_row([_label(row), *(mark(by_place.get((row, c))) for c in columns)]))
    return lines + notes.lines()


def _capabilities_table() -> list[str]:
    """What each registered algorithm declares (protocols/capabilities.py and its config)."""
    notes = _Footnotes()
    header = ["algorithm", "aggregation", "scalars in clear", "rounds", "devices", "update norms"]
    lines = [_row(header), "|---" * len(header) + "|"]
    for name, config in ALGORITHM_CONFIGS.items():
        declared = config.capabilities
        scalars, synchronous = declared.clear_scalars, declared.synchronous
        cells = [
            SHARING[declared.aggregation],
            "none" if scalars is None else f"yes {notes.ref(scalars)}",
            "sync or async" if synchronous is None else f"sync only {notes.ref(synchronous)}",
            "stateful only" if config.stateful_only else "stateful or stateless",
            "comparable" if config.comparable_update_norms else "not comparable",
        ]
        lines.append(_row([f"`{name}`", *cells]))
    return lines + notes.lines()


def _flags(example: Mapping[str, object]) -> str:
    """A feature's example settings as the command-line flags that give them."""
    words = []
    for key, value in example.items():
        flag = f"--{key.replace('_', '-')}"
        if isinstance(value, Mapping):  # a TOML table
            flag = f"[{key}] " + ", ".join(f"{name} = {item}" for name, item in value.items())
        words.append(flag if value is True or isinstance(value, Mapping) else f"{flag} {value}")
    return f"`{' '.join(words)}`" if words else "the defaults (always on)"


INTRO: Final = """# What composes with what

Generated from the algorithms' declared capabilities (`protocols/capabilities.py`, the
`capabilities` of each config in `protocols/algorithms.py`) and the features' requirements
(`coordinator/stages/features.py`) by `python -m coordinator.stages.compatibility`; do not edit
by hand (`tests/test_docs.py` fails when this file is out of date). Every run is checked against
the same declarations before its first round, and refused with the reason a footnote gives here.
`tests/coordinator/test_compatibility.py` runs every "works" cell for two rounds and every "no"
cell up to its refusal.

"works [n]" works with a documented change to another feature (no flag is changed silently: a
run that sets a flag such a change turns off, to anything but its default or off, is refused).
"""


def render_compatibility_docs() -> str:
    """The markdown of docs/compatibility.md."""
    columns = [feature.key for feature in FEATURES if _standalone(feature)]
    every = [feature.key for feature in FEATURES]
    lines = [INTRO, "## What each algorithm declares", "", *_capabilities_table()]
    lines += ["## Algorithms and features", ""]
    lines += ["Each algorithm with its defaults, and with each feature alone.", ""]
    lines += _table(algorithm_cells(), [row for row, _ in _rows()], columns)
    lines += ["## Features with each other", ""]
    lines += ["FedAvg with both features (the diagonal: the feature alone).", ""]
    lines += _table(feature_cells(), every, every)
    lines += ["The settings each feature stands for in these tables:", ""]
    lines += [f"- {_label(feature.key)}: {_flags(feature.example)}" for feature in FEATURES]
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    """Write docs/compatibility.md, or with --check exit 1 when it is out of date."""
    text = render_compatibility_docs()
    if "--check" not in (sys.argv[1:] if argv is None else argv):
        COMPATIBILITY_MD.write_text(text)
    elif not COMPATIBILITY_MD.is_file() or COMPATIBILITY_MD.read_text() != text:
        sys.stderr.write(f"{COMPATIBILITY_MD} is out of date: run {REGENERATE}\n")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
