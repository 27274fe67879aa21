"""Settings grouped in sections (`[dp]`, `[async]`, ...) whose settings keep their flat names.

A program's settings model holds a `Section` per feature; each setting of a section still has
one flat name (`dp.clip` is `dp_clip`): the flag `--dp-clip`, the variable `PFL_DP_CLIP`, the
flat TOML key `dp_clip` and the key in recorded settings (summary.json, checkpoints). The
nested spellings, the TOML table `[dp] clip = 1.0` and `PFL_DP__CLIP`, mean the same setting.
`fold` turns any mix of the two into the model's nested shape; `flatten` turns a dump back.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar, NamedTuple, TypeGuard

from pydantic import BaseModel, ConfigDict
from pydantic.fields import FieldInfo

from protocols.settings_errors import SettingsError


class Section(BaseModel):
    """One table of a program's settings; its fields are flags named `<flag_prefix><field>`."""

    model_config = ConfigDict(extra="forbid")

    table: ClassVar[str]
    """The TOML table and `PFL_<TABLE>__<FIELD>` prefix (`async` may not be a field name)."""
    flag_prefix: ClassVar[str] = ""
    """What the flat names of its fields start with (a field may name its own, see `flat_name`)."""
    panel: ClassVar[str]
    """The `--help` panel its flags are listed under."""


def flat_name(name: str) -> dict[str, Any]:
    """`json_schema_extra` of a section field whose flat name is not `<flag_prefix><field>`."""
    return {"flat_name": name}


def panel(title: str) -> dict[str, Any]:
    """`json_schema_extra` of a top-level field listed under its own `--help` panel."""
    return {"panel": title}


def _extra(field: FieldInfo, key: str) -> Any:
    extra = field.json_schema_extra
    return extra.get(key) if isinstance(extra, dict) else None


class Setting(NamedTuple):
    """One setting of a program: its flat name, where it lives and how it is declared."""

    flat: str
    section: str | None
    """The program model's field holding the section, or None for a top-level setting."""
    table: str | None
    """The section's TOML table (None for a top-level setting)."""
    name: str
    """The field's name (in the section, or top-level)."""
    field: FieldInfo
    panel: str | None


def is_class(annotation: Any) -> TypeGuard[type[Any]]:
    """Whether an annotation is a plain class, one `issubclass` accepts.

    On Python 3.10 `isinstance(list[str], type)` is also true, and `issubclass` then raises.
    """
    return isinstance(annotation, type) and not isinstance(annotation, types.GenericAlias)


def section_type(field: FieldInfo) -> type[Section] | None:
    """The `Section` class a program field holds, if it holds one."""
    annotation = field.annotation
    if is_class(annotation) and issubclass(annotation, Section):
        return annotation
    return None


@functools.cache
def settings_of(model: type[BaseModel]) -> tuple[Setting, ...]:
    """Every setting of `model`, in declaration order, sections' settings in their place."""
    found: list[Setting] = []
    for name, field in model.model_fields.items():
        section = section_type(field)
        if section is None:
            found.append(Setting(name, None, None, name, field, _extra(field, "panel")))
            continue
        for sub, sub_field in section.model_fields.items():
            flat = _extra(sub_field, "flat_name") or section.flag_prefix + sub
            found.append(Setting(flat, name, section.table, sub, sub_field, section.panel))
    flats = [setting.flat for setting in found]
    if len(set(flats)) != len(flats):
        msg = f"{model.__name__}: two settings share a flat name"
        raise TypeError(msg)
    return tuple(found)


@functools.cache
def _tables(model: type[BaseModel]) -> dict[str, str]:
    """TOML table names (and field names) of `model`'s sections -> the field holding each."""
    tables = {}
    for name, field in model.model_fields.items():
        section = section_type(field)
        if section is not None:
            tables[section.table] = tables[name] = name
    return tables


@functools.cache
def _nested(model: type[BaseModel]) -> dict[str, tuple[str, str]]:
    """Flat name -> (section field, field) of each setting inside a section."""
    return {
        setting.flat: (setting.section, setting.name)
        for setting in settings_of(model)
        if setting.section is not None
    }


def flag_locations(model: type[BaseModel]) -> dict[tuple[str, str], str]:
    """(section field, field) -> flat name: how an error inside a section names its flag."""
    return {place: flat for flat, place in _nested(model).items()}


def env_names(model: type[BaseModel]) -> Iterator[tuple[Setting, tuple[str, ...]]]:
    """Each setting with its variable names: `PFL_<NAME>`; nested (`PFL_DP__CLIP`) before flat."""
    for setting in settings_of(model):
        flat = f"PFL_{setting.flat}".upper()
        if setting.table is None:
            yield setting, (flat,)
        else:
            yield setting, (f"PFL_{setting.table}__{setting.name}".upper(), flat)


def fold(model: type[BaseModel], values: Mapping[str, Any]) -> dict[str, Any]:
    """`values` with flat names and TOML tables moved into `model`'s sections.

    Raises:
        SettingsError: one setting given twice in `values` (flat and in its table).
    """
    tables, nested = _tables(model), _nested(model)
    folded: dict[str, Any] = {}
    given: dict[tuple[str, str], str] = {}

    def put(section: str, name: str, value: Any, spelling: str) -> None:
        earlier = given.setdefault((section, name), spelling)
        if earlier != spelling:
            msg = f"{spelling} and {earlier} are the same setting: give it once"
            raise SettingsError(msg)
        folded.setdefault(section, {})[name] = value

    for key, value in values.items():
        table = tables.get(key)
        if table is not None and isinstance(value, (dict, Section)):
            items = value.model_dump(exclude_unset=True) if isinstance(value, Section) else value
            for name, item in items.items():
                put(table, name, item, f"[{key}] {name}")
        elif key in nested:
            put(*nested[key], value, key)
        else:
            folded[key] = value
    return folded


def flatten(model: type[BaseModel], dumped: dict[str, Any]) -> dict[str, Any]:
    """A dump of `model` with each section's settings under their flat names, in place."""
    names, tables = flag_locations(model), _tables(model)
    flat: dict[str, Any] = {}
    for key, value in dumped.items():
        if key in tables and isinstance(value, dict):
            for name, item in value.items():
                flat[names[(tables[key], name)]] = item
        else:
            flat[key] = value
    return flat
