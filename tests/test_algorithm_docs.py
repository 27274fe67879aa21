"""The algorithm pages stay honest: a page per algorithm, every config field, runnable commands.

The rule: docs/algorithms/README.md holds one table row per page; its first cell names the
algorithms (in backticks) the page covers and its last cell links the page.
"""

from __future__ import annotations

import ast
import re
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from benchmarks.doc_commands import fenced_commands
from coordinator.cli.app import app as coord_app
from protocols.algorithms import ALGORITHM_CONFIGS
from tests.test_docs import APPS, parses, tiny

PAGES = Path(__file__).resolve().parent.parent / "docs" / "algorithms"
INDEX = PAGES / "README.md"
FIELD_ROW = re.compile(r"^\| `(\w+)` \| ([^|]*) \|", flags=re.MULTILINE)


def index_rows() -> list[tuple[tuple[str, ...], str]]:
    """(algorithm names, linked page) for every row of the index table that ends in a link."""
    rows = []
    for line in INDEX.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        link = re.fullmatch(r"\[[^\]]*\]\(([^)#]+)\)", cells[-1])
        if line.startswith("|") and link is not None:
            rows.append((tuple(re.findall(r"`([^`]+)`", cells[0])), link.group(1)))
    return rows


def page_of() -> dict[str, str]:
    """Each algorithm name in the index, mapped to its page's file name."""
    return {name: page for names, page in index_rows() for name in names}


def page_text(name: str) -> str:
    """The page documenting algorithm `name`; fails (never skips) when there is none."""
    page = page_of().get(name)
    if page is None or not (PAGES / page).is_file():
        pytest.fail(f"no page in docs/algorithms/ documents {name!r} (see the index's rule)")
    return (PAGES / page).read_text()


def literals(cell: str) -> list[object]:
    """The Python literals written in backticks in a table cell (`None`, `0.1`, `"mean"`)."""
    values = []
    for text in re.findall(r"`([^`]+)`", cell):
        try:
            values.append(ast.literal_eval(text))
        except (ValueError, SyntaxError):
            continue  # a name such as `selffl-aug`, not a value
    return values


def same_value(documented: object, default: object) -> bool:
    """Equal and of the same type, so `1` does not pass for `True` nor `"1"` for `1`."""
    return type(documented) is type(default) and documented == default


def page_files() -> list[Path]:
    return sorted(p for p in PAGES.glob("*.md") if p != INDEX)


def test_every_algorithm_has_a_page() -> None:
    pages = page_of()
    missing = [
        name
        for name in sorted(ALGORITHM_CONFIGS)
        if name not in pages or not (PAGES / pages[name]).is_file()
    ]
    assert not missing, (
        f"no page in docs/algorithms/ for: {', '.join(missing)}; add <name>.md and a row "
        "linking it in docs/algorithms/README.md"
    )


def test_index_names_only_registered_algorithms() -> None:
    unknown = sorted(set(page_of()) - set(ALGORITHM_CONFIGS))
    assert not unknown, f"docs/algorithms/README.md lists unregistered algorithms: {unknown}"


def test_index_links_only_existing_files() -> None:
    targets = re.findall(r"\]\(([^)#\s]+)", INDEX.read_text())
    broken = [t for t in targets if "://" not in t and not (PAGES / t).exists()]
    assert not broken, f"docs/algorithms/README.md links missing files: {broken}"


@pytest.mark.parametrize("name", sorted(ALGORITHM_CONFIGS))
def test_page_documents_every_config_field_with_its_default(name: str) -> None:
    # Prepare
    text = page_text(name)
    documented = dict(FIELD_ROW.findall(text))
    config_type = ALGORITHM_CONFIGS[name]
    # Execute
    missing = [field for field in config_type.model_fields if field not in documented]
    wrong = [
        f"{field} (code: {info.default!r}, page: {documented[field].strip()})"
        for field, info in config_type.model_fields.items()
        if field in documented
        and not any(same_value(v, info.default) for v in literals(documented[field]))
    ]
    # Assert
    assert f"`{name}`" in text, f"the page linked for {name} never names it"
    assert not missing, f"{name}'s page lacks the fields {missing}"
    assert not wrong, f"{name}'s page shows defaults the code does not have: {wrong}"


@pytest.mark.parametrize("page", page_files(), ids=lambda p: p.name)
def test_page_documents_no_stale_fields(page: Path) -> None:
    names = [name for name, linked in page_of().items() if linked == page.name]
    known = {field for name in names for field in ALGORITHM_CONFIGS[name].model_fields}
    stale = sorted(set(dict(FIELD_ROW.findall(page.read_text()))) - known)
    assert names, f"{page.name} is not linked from docs/algorithms/README.md"
    assert not stale, f"{page.name} documents fields no config of {names} has: {stale}"


@pytest.mark.parametrize("page", page_files(), ids=lambda p: p.name)
def test_page_commands_parse_with_the_real_programs(page: Path) -> None:
    # Prepare
    commands = fenced_commands(page.read_text())
    names = [name for name, linked in page_of().items() if linked == page.name]
    # Execute
    for words in commands:
        assert words[0] in APPS, f"{page.name}: not a pfl-edge command: {shlex.join(words)}"
        parses(words)
    # Assert: a digits simulation of every algorithm the page covers
    for name in names:
        assert any(
            words[:2] == ["pfl-coord", "simulate"]
            and f"--algorithm {name} " in f"{shlex.join(words)} "
            and "--task digits" in shlex.join(words)
            for words in commands
        ), f"{page.name} has no `pfl-coord simulate --task digits --algorithm {name}` example"


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("page", page_files(), ids=lambda p: p.name)
def test_page_simulations_run_as_written(page: Path, tmp_path, monkeypatch) -> None:
    """Each simulate example, on tiny settings; `--config X` gets the page's ```toml block."""
    # Prepare
    text = page.read_text()
    toml_blocks = re.findall(r"```toml\n(.*?)```", text, flags=re.DOTALL)
    assert len(toml_blocks) <= 1, f"{page.name}: which ```toml block does --config mean?"
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    simulations = [w for w in fenced_commands(text) if w[:2] == ["pfl-coord", "simulate"]]
    for words in simulations:
        assert "--out" in words, f"{page.name}: give every example an --out directory"
        if "--config" in words:
            assert toml_blocks, f"{page.name}: --config names a file the page never shows"
            (tmp_path / words[words.index("--config") + 1]).write_text(toml_blocks[0])
        command = tiny(words)
        # Execute
        result = runner.invoke(coord_app, command[1:])
        # Assert
        assert result.exit_code == 0, f"{shlex.join(command)}:\n{result.output}"
        assert (tmp_path / words[words.index("--out") + 1] / "summary.json").is_file()
