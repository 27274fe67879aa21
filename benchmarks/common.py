"""What every benchmark shares.

Quiet single-threaded workers, "mean ± std" cells, markdown tables, and the writer of a
benchmark's own section of a shared doc.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Sequence
from pathlib import Path

import torch

from protocols.atomic import write_atomically


def one_thread() -> None:
    """Pin torch to one thread: side-by-side timings and parallel workers stay comparable."""
    torch.set_num_threads(1)


def init_worker() -> None:
    """A process-pool worker: one torch thread, and no per-round warnings over the progress."""
    one_thread()
    logging.disable(logging.WARNING)


def mean_std(values: Sequence[float | None]) -> tuple[float, float] | None:
    """Mean and sample std (0 for one value) of the values present; None when none is."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    spread = statistics.stdev(present) if len(present) > 1 else 0.0
    return statistics.fmean(present), spread


def mean_std_cell(
    values: Sequence[float | None], *, scale: float = 1.0, digits: int = 3, std: bool = True
) -> str:
    """The "mean ± std" of `scale` x the values present, to `digits` decimals; "-" if none is."""
    stats = mean_std([None if v is None else scale * v for v in values])
    if stats is None:
        return "-"
    mean, spread = stats
    return f"{mean:.{digits}f} ± {spread:.{digits}f}" if std else f"{mean:.{digits}f}"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """A markdown table's lines, every column left-aligned."""
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def write_section(path: Path, section: str, marker: str) -> None:
    """Replace one benchmark's section of `path` (between two `marker`s), keeping the rest.

    The file is shared with other benchmarks and edited by hand, so it is read right before the
    atomic write, not at start-up; a section not there yet is appended.
    """
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    if text.count(marker) >= 2:
        before, _, rest = text.partition(marker)
        _, _, after = rest.partition(marker)
        text = before + section + after
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    write_atomically(path, text.encode("utf-8"))


def publish_section(path: Path, marker: str, lines: Sequence[str]) -> None:
    """Write `lines` as one benchmark's section of `path` (`write_section`) and print it."""
    section = "\n".join([marker, *lines, marker])
    write_section(path, section, marker)
    print(section)


def write_table_section(
    path: Path, marker: str, header: Sequence[str], rows: Sequence[Sequence[str]], footer: str
) -> None:
    """One benchmark's section of `path` that is a table and a line under it (`write_section`)."""
    lines = [marker, *markdown_table(header, rows), "", footer, marker]
    write_section(path, "\n".join(lines), marker)


def choose(text: str | None, valid: Sequence[str], what: str) -> list[str]:
    """The comma-separated names of `text` (all of `valid` when None), each checked.

    Raises:
        ValueError: a name not in `valid`, or none at all.
    """
    if text is None:
        return list(valid)
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in valid]
    if unknown or not names:
        msg = f"unknown {what} {', '.join(unknown) or '(none)'}; choose from: {', '.join(valid)}"
        raise ValueError(msg)
    return names
