"""Command-line options generated from a settings model: each flag is written once, as a field.

`settings_options(Model)` gives a typer command one option per setting of `Model` (a section's
settings under their flat names, `--dp-clip`): the field's type, its help, its default (shown,
not passed: an option not given is None, so the environment and the `--config` file can still
set it) and its `--help` panel. The command receives the given values as one `flags` dict for
`Model.load(config, **flags)`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Collection, Iterator, Mapping
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, TypeVar, Union, get_args, get_origin

import typer
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from protocols.settings_sections import Setting, settings_of

CommandT = TypeVar("CommandT", bound=Callable[..., Any])
_PLAIN: tuple[type, ...] = (bool, int, float, str, Path)


def option_type(annotation: Any) -> Any:
    """The type click parses a setting as (Literal choices as text), or None for TOML only."""
    origin = get_origin(annotation)
    if origin in (Union, UnionType):
        members = [member for member in get_args(annotation) if member is not type(None)]
        return option_type(members[0]) if len(members) == 1 else None
    if origin is Literal:
        return str
    if origin is list:
        return list[str]
    if annotation in _PLAIN:
        return annotation
    return None


def _shown_default(setting: Setting) -> str | bool:
    default = setting.field.default
    if default is PydanticUndefined or default is None or isinstance(default, bool):
        return False
    return str(default)


def _option(setting: Setting, help_text: str | None, environment: bool) -> inspect.Parameter:
    kind = option_type(setting.field.annotation)
    flag = "--" + setting.flat.replace("_", "-")
    required = setting.field.is_required()
    option = typer.Option(  # a command's own help for a setting says its own default
        flag,
        help=setting.field.description if help_text is None else help_text,
        show_default=_shown_default(setting) if help_text is None else False,
        rich_help_panel=setting.panel,
        envvar=f"PFL_{setting.flat.upper()}" if environment else None,
    )
    annotation = Annotated[kind if required else kind | None, option]  # type: ignore[valid-type]
    return inspect.Parameter(
        setting.flat,
        inspect.Parameter.KEYWORD_ONLY,
        default=inspect.Parameter.empty if required else None,
        annotation=annotation,
    )


def command_settings(
    model: type[BaseModel],
    *,
    only: Collection[str] | None = None,
    exclude: Collection[str] = (),
) -> Iterator[Setting]:
    """The settings of `model` a command offers as flags, in the order `--help` lists them.

    That is the settings without a panel first, then each panel's in the order panels first
    appear; within a panel, declaration order. Settings with no command-line type are left out.
    """
    chosen = [
        setting
        for setting in settings_of(model)
        if (only is None or setting.flat in only)
        and setting.flat not in exclude
        and option_type(setting.field.annotation) is not None
    ]
    panels = list(dict.fromkeys(setting.panel for setting in chosen if setting.panel))
    yield from sorted(chosen, key=lambda s: 0 if s.panel is None else 1 + panels.index(s.panel))


def settings_options(
    model: type[BaseModel],
    *,
    only: Collection[str] | None = None,
    exclude: Collection[str] = (),
    helps: Mapping[str, str] | None = None,
    environment: bool = False,
) -> Callable[[CommandT], CommandT]:
    """Give the decorated command one option per setting of `model`, passed on as `flags`.

    The command declares its own parameters as usual plus `flags: dict[str, Any]`; its own
    parameters before `flags` are listed first, those after it last. `helps` replaces the
    help of a flag where one command means something narrower by it. With `environment`, the
    options read `PFL_<NAME>` themselves (for a command that loads no settings model).
    """

    def decorate(command: CommandT) -> CommandT:
        chosen = list(command_settings(model, only=only, exclude=exclude))
        options = [
            _option(setting, (helps or {}).get(setting.flat), environment) for setting in chosen
        ]
        own = list(inspect.signature(command, eval_str=True).parameters.values())
        split = [parameter.name for parameter in own].index("flags")
        before, after = own[:split], own[split + 1 :]
        parameters = [
            parameter.replace(kind=inspect.Parameter.KEYWORD_ONLY)
            for parameter in (*before, *options, *after)
        ]
        names = [setting.flat for setting in chosen]

        def run(**given: Any) -> Any:
            flags = {name: given.pop(name) for name in names}
            return command(flags=flags, **given)

        run.__name__, run.__qualname__ = command.__name__, command.__qualname__
        run.__doc__, run.__module__ = command.__doc__, command.__module__
        run.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
        run.__annotations__ = {parameter.name: parameter.annotation for parameter in parameters}
        return run  # type: ignore[return-value]

    return decorate
