"""docs/cli.md from the typer apps: `python -m coordinator.cli.docs [--check]`."""

from __future__ import annotations

import inspect
import sys
from pathlib import Path
from typing import Any, Final

import typer

from coordinator.cli.app import app as coord_app
from device_agent.cli import app as agent_app

CLI_MD: Final = Path(__file__).resolve().parents[2] / "docs" / "cli.md"
PROGRAMS: Final = (("pfl-coord", coord_app), ("pfl-agent", agent_app))


def _escape(text: str) -> str:
    return text.replace("|", "\\|").replace("<", "\\<").replace("\n", " ")


def _default(parameter: Any) -> str:
    """A parameter's default as the markdown cell shows it ("" when the help names it)."""
    if parameter.required:
        return "required"
    default = parameter.default
    if getattr(parameter, "is_flag", False):
        return "on" if default else "off"
    shown = getattr(parameter, "show_default", None)
    if isinstance(shown, str):  # options generated from settings show the setting's default
        return f"`{shown}`"
    if default is None or callable(default) or default in ((), []):
        return ""
    return f"`{default}`"


def _names(parameter: Any) -> str:
    if parameter.param_type_name == "argument":
        return f"`{parameter.name.upper()}` (argument)"
    return ", ".join(f"`{name}`" for name in [*parameter.opts, *parameter.secondary_opts])


def _command_section(program: str, name: str, command: Any) -> list[str]:
    lines = [f"### `{program} {name}`", "", inspect.cleandoc(command.help or ""), ""]
    parameters = [p for p in command.params if p.name != "help"]
    if not parameters:
        return lines
    lines += ["| option | default | help |", "|---|---|---|"]
    for parameter in parameters:
        help_cell = _escape(getattr(parameter, "help", None) or "")
        lines.append(f"| {_names(parameter)} | {_default(parameter)} | {help_cell} |")
    lines.append("")
    return lines


def render_cli_docs() -> str:
    """The markdown reference of every command of pfl-coord and pfl-agent, options and defaults.

    Commands are sorted by name; each table lists the options in the order `--help` shows them.
    """
    lines = [
        "# Command-line reference",
        "",
        "Generated from the programs by `python -m coordinator.cli.docs`; do not edit by hand",
        "(`tests/test_docs.py` fails when this file is out of date). The options of `simulate`,",
        "`compare`, `serve` and `pfl-agent start`/`pool`/`export` are generated from the",
        "settings models (coordinator/run/settings.py and sections.py, device_agent/settings.py)",
        "and can also be set as `PFL_<NAME>` environment variables or in the `--config` TOML",
        "file; a flag wins over both. A setting of a section (`[dp]`, `[secagg]`, `[async]`,",
        "`[guard]`, `[compress]`, `[sim]`, `[dashboard]`; the agent's `[limits]`) may also be",
        "written in its table (`[dp]` `clip = 1.0` for `dp_clip = 1.0`) or as",
        "`PFL_<TABLE>__<NAME>` (`PFL_DP__CLIP`). An empty default means none, or the one the",
        "help text names. `--help` lists the options of each section in a panel of their own.",
        "",
    ]
    for program, app in PROGRAMS:
        group: Any = typer.main.get_command(app)
        lines += [f"## `{program}`", "", inspect.cleandoc(group.help or ""), ""]
        lines += [f"- [`{program} {name}`](#{program}-{name})" for name in sorted(group.commands)]
        lines.append("")
        for name in sorted(group.commands):
            lines += _command_section(program, name, group.commands[name])
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    """Write docs/cli.md, or with --check exit 1 when it is out of date."""
    arguments = sys.argv[1:] if argv is None else argv
    text = render_cli_docs()
    if "--check" in arguments:
        current = CLI_MD.read_text() if CLI_MD.is_file() else ""
        if current != text:
            sys.stderr.write(f"{CLI_MD} is out of date: run python -m coordinator.cli.docs\n")
            return 1
        return 0
    CLI_MD.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
