"""Settings in sections: flat and nested spellings fold to one setting, per source, in order."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import Field

from protocols.program_settings import TomlSettings
from protocols.settings_errors import SettingsError
from protocols.settings_sections import Section, flat_name, flatten, fold, is_class, settings_of


class _Limits(Section):
    table = "limits"
    flag_prefix = "limit_"
    panel = "Limits"

    steps: int = Field(default=10, ge=1, description="most steps")
    on: bool = Field(
        default=False, description="limits apply", json_schema_extra=flat_name("limits")
    )


class _Tool(TomlSettings):
    name: str = Field(default="a", description="a top-level setting")
    limits: _Limits = Field(default_factory=_Limits)


def test_each_setting_has_one_flat_name_in_declaration_order() -> None:
    flats = [(s.flat, s.section, s.name) for s in settings_of(_Tool)]
    assert flats == [
        ("name", None, "name"),
        ("limit_steps", "limits", "steps"),
        ("limits", "limits", "on"),
    ]


class _Generic(TomlSettings):
    tags: list[str] = Field(default_factory=list, description="a generic alias")
    pair: tuple[int, int] = Field(default=(1, 2), description="another")
    limits: _Limits = Field(default_factory=_Limits)


def test_generic_aliases_are_settings_not_sections() -> None:
    # On Python 3.10 `isinstance(list[str], type)` is true and issubclass() on it raises.
    assert not is_class(list[str])
    assert not is_class(tuple[int, int])
    assert is_class(_Limits)
    assert is_class(int)

    flats = [(s.flat, s.section) for s in settings_of(_Generic)]

    assert flats == [
        ("tags", None),
        ("pair", None),
        ("limit_steps", "limits"),
        ("limits", "limits"),
    ]


@pytest.mark.parametrize(
    "values",
    [
        {"limit_steps": 3, "limits": True},
        {"limits": {"steps": 3, "on": True}},
        {"limit_steps": 3, "limits": {"on": True}},
    ],
)
def test_flat_names_and_tables_fold_alike(values: dict[str, object]) -> None:
    # Act
    folded = fold(_Tool, values)

    # Assert: a bool under the table's name is its flat setting, a dict the table
    assert folded == {"limits": {"steps": 3, "on": True}}
    assert _Tool.model_validate(values).limits == _Limits(steps=3, on=True)


def test_one_setting_given_twice_in_one_source_is_refused() -> None:
    with pytest.raises(SettingsError, match=r"\[limits\] steps and limit_steps are the same"):
        fold(_Tool, {"limit_steps": 3, "limits": {"steps": 4}})


def test_dumps_keep_flat_names_and_load_back() -> None:
    tool = _Tool.model_validate({"limit_steps": 4})

    dumped = tool.model_dump()

    assert dumped == {"name": "a", "limit_steps": 4, "limits": False}
    assert flatten(_Tool, {"limits": {"steps": 4, "on": False}}) == {
        "limit_steps": 4,
        "limits": False,
    }
    assert _Tool.model_validate(dumped) == tool


def test_precedence_holds_per_setting_across_spellings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Arrange: the file sets both settings nested; the environment one of them flat
    config = tmp_path / "tool.toml"
    config.write_text("name = 'file'\n[limits]\nsteps = 7\non = true\n")
    monkeypatch.setenv("PFL_LIMIT_STEPS", "8")

    # Act
    from_env = _Tool.load(config)
    from_flag = _Tool.load(config, limit_steps=9, name=None)

    # Assert: the environment wins over the file for its setting only; a flag over both
    assert (from_env.limits.steps, from_env.limits.on, from_env.name) == (8, True, "file")
    assert (from_flag.limits.steps, from_flag.limits.on) == (9, True)


def test_a_nested_variable_wins_over_the_flat_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PFL_LIMIT_STEPS", "8")
    monkeypatch.setenv("PFL_LIMITS__STEPS", "5")

    assert _Tool.load().limits.steps == 5


def test_an_error_inside_a_section_names_the_flat_flag(tmp_path: Path) -> None:
    config = tmp_path / "tool.toml"
    config.write_text("[limits]\nsteps = 0\n")

    with pytest.raises(SettingsError, match=r"^--limit-steps 0: must be at least 1$"):
        _Tool.load(config)


def test_an_unknown_key_in_a_table_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "tool.toml"
    config.write_text("[limits]\nstep = 3\n")

    with pytest.raises(SettingsError, match=r"limits\.step 3: is not a setting of this command"):
        _Tool.load(config)
