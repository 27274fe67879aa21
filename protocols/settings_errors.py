"""Settings errors as one line a user can act on: the flag, the value given and what is allowed.

pydantic's own text spans several lines, names fields rather than flags and ends in a web
address; a command line should say `--devices 0: must be at least 1` and stop.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError
from pydantic_core import ErrorDetails

_BOUNDS = {
    "greater_than_equal": ("ge", "at least"),
    "greater_than": ("gt", "above"),
    "less_than_equal": ("le", "at most"),
    "less_than": ("lt", "below"),
}


class SettingsError(ValueError):
    """Settings that cannot run, said in one line."""


def flag_name(location: tuple[int | str, ...]) -> str:
    """`("rounds",)` -> `--rounds`; nested TOML keys keep their path (`algorithm_options.lr`)."""
    if not location:
        return ""
    if len(location) == 1:
        return "--" + str(location[0]).replace("_", "-")
    return ".".join(str(part) for part in location)


def _allowed(detail: ErrorDetails) -> str:
    """What the value should have been, in words."""
    kind, context = detail["type"], detail.get("ctx") or {}
    if kind in _BOUNDS:
        key, words = _BOUNDS[kind]
        return f"must be {words} {context[key]}"
    if kind == "value_error":
        return str(detail["msg"]).removeprefix("Value error, ")
    if kind == "extra_forbidden":
        return "is not a setting of this command"
    if kind == "literal_error":
        return f"expected {context.get('expected', detail['msg'])}"
    return str(detail["msg"]).removeprefix("Input ").replace("should", "must", 1)


def _shown(value: Any) -> str:
    text = repr(value) if isinstance(value, str) and value.strip() != value else str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def describe_settings_error(
    error: ValidationError, flat_names: Mapping[tuple[str, str], str] | None = None
) -> str:
    """Every problem of `error` on one line: `--flag value: what is allowed`, joined by `; `.

    `flat_names` names the settings inside sections (`("dp", "clip")` -> `dp_clip`).
    """
    problems = []
    for detail in error.errors(include_url=False):
        location = tuple(detail["loc"])
        names = [str(part) for part in location[:2]]
        flat = (flat_names or {}).get((names[0], names[1])) if len(names) == 2 else None
        flag = flag_name(location if flat is None else (flat, *location[2:]))
        allowed = _allowed(detail)
        if not flag:
            problems.append(allowed)
        elif detail["type"] == "missing":
            problems.append(f"{flag} is required")
        elif isinstance(detail.get("input"), dict):  # a nested section failed as a whole
            problems.append(f"{flag}: {allowed}")
        else:
            problems.append(f"{flag} {_shown(detail.get('input'))}: {allowed}")
    return "; ".join(problems)
