"""serve never silently replaces an earlier run: --resume continues it, --fresh replaces it."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.run.serve import refuse_overwrite
from coordinator.run.settings import ServeSettings


def _settings(tmp_path: Path, **flags: bool) -> ServeSettings:
    return ServeSettings.load(
        None, checkpoint_dir=tmp_path / "state", out=tmp_path / "run", **flags
    )


def test_a_first_run_needs_no_flag(tmp_path: Path) -> None:
    refuse_overwrite(_settings(tmp_path))


@pytest.mark.parametrize("left", ["state/checkpoint.json", "run/metrics.jsonl"])
def test_an_earlier_runs_files_need_resume_or_fresh(tmp_path: Path, left: str) -> None:
    (tmp_path / left).parent.mkdir(parents=True)
    (tmp_path / left).write_text("{}")
    with pytest.raises(ValueError, match="pass --resume to continue it or --fresh"):
        refuse_overwrite(_settings(tmp_path))
    refuse_overwrite(_settings(tmp_path, resume=True))
    refuse_overwrite(_settings(tmp_path, fresh=True))
    with pytest.raises(ValueError, match="give one of them"):
        refuse_overwrite(_settings(tmp_path, resume=True, fresh=True))
