"""Loading rules shared by every program's pydantic-settings model, and broker credentials.

Precedence, highest first: command-line flags, `PFL_*` environment variables, the TOML file given
with `--config`, then the model's defaults. A setting inside a section
(`protocols.settings_sections`) may be spelled flat (`dp_clip`, `PFL_DP_CLIP`) or nested (`[dp]
clip`, `PFL_DP__CLIP`) in any source; each source is folded into the nested shape before the
sources are merged, so the precedence holds setting by setting.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from contextvars import ContextVar
from pathlib import Path
from types import UnionType
from typing import Any, Final, Literal, TypeVar, Union, get_args, get_origin

from pydantic import (
    BaseModel,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    model_serializer,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from protocols.settings_errors import SettingsError, describe_settings_error
from protocols.settings_sections import env_names, flag_locations, flatten, fold, is_class, panel
from protocols.transport.settings import BrokerSettings

SettingsT = TypeVar("SettingsT", bound="TomlSettings")
_CONFIG_FILE: ContextVar[Path | None] = ContextVar("pfl_config_file", default=None)


class _Folded:
    """A settings source whose flat and nested spellings are folded into the model's sections."""

    def __init__(self, model: type[BaseModel], read: Callable[[], dict[str, Any]], name: str):
        self.model, self.read, self.__name__ = model, read, name

    def __call__(self) -> dict[str, Any]:
        return fold(self.model, self.read())


def _structured(annotation: Any) -> bool:
    """Whether a variable for a setting of this type holds JSON (a dict, list or model)."""
    members = get_args(annotation) if get_origin(annotation) in (Union, UnionType) else ()
    if members:
        return any(_structured(member) for member in members if member is not type(None))
    if get_origin(annotation) in (dict, list):
        return True
    return is_class(annotation) and issubclass(annotation, (BaseModel, dict, list))


def _environment(model: type[BaseModel]) -> dict[str, Any]:
    """Settings from `PFL_<NAME>` variables (any case); a section setting's nested name first.

    Raises:
        SettingsError: a dict- or list-valued variable that is not JSON.
    """
    environment = {name.upper(): value for name, value in os.environ.items()}
    values: dict[str, Any] = {}
    for setting, names in env_names(model):
        name = next((name for name in names if name in environment), None)
        if name is None:
            continue
        value: Any = environment[name]
        if _structured(setting.field.annotation):
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                msg = f"{name}: expected JSON, got {value!r}"
                raise SettingsError(msg) from None
        values[setting.flat] = value
    return values


class TomlSettings(BaseSettings):
    """Shared loading rules: flags > PFL_* environment > TOML file > defaults.

    The variables are read by `_environment` (flat and nested names), not pydantic-settings'
    own source, which would take `PFL_DP=...` for the whole section.
    """

    model_config = SettingsConfigDict(extra="forbid")

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Flags, then `PFL_*` variables, then the `--config` file; no dotenv or secrets dir."""
        del env_settings, dotenv_settings, file_secret_settings
        sources = [
            _Folded(settings_cls, init_settings, "flags"),
            _Folded(settings_cls, lambda: _environment(settings_cls), "environment"),
        ]
        path = _CONFIG_FILE.get()
        if path is not None:
            toml = TomlConfigSettingsSource(settings_cls, toml_file=path)
            sources.append(_Folded(settings_cls, toml, "config file"))
        return tuple(sources)  # type: ignore[arg-type]  # plain callables are sources too

    @model_validator(mode="before")
    @classmethod
    def _fold_sections(cls, values: Any) -> Any:
        """`model_validate` and nested use take flat names and TOML tables too."""
        return fold(cls, values) if isinstance(values, dict) else values

    @model_serializer(mode="wrap")
    def _flat_dump(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """Dumps (summary.json, checkpoints) keep flat names: records of earlier runs compare."""
        return flatten(type(self), handler(self))

    @classmethod
    def load(cls: type[SettingsT], config_file: Path | None = None, **overrides: Any) -> SettingsT:
        """Settings from flags (`overrides`, None meaning "not given"), environment and file.

        Raises:
            FileNotFoundError: `config_file` does not exist.
            SettingsError: a value out of its range or of the wrong kind, in one line.
        """
        if config_file is not None and not Path(config_file).is_file():
            msg = f"config file not found: {config_file}"
            raise FileNotFoundError(msg)
        token = _CONFIG_FILE.set(config_file)
        try:
            return cls(**{key: value for key, value in overrides.items() if value is not None})
        except ValidationError as error:
            raise SettingsError(describe_settings_error(error, flag_locations(cls))) from None
        finally:
            _CONFIG_FILE.reset(token)


BROKER_PANEL: Final = "Broker"


class BrokerAccess(BaseModel):
    """TLS and credential options shared by the programs that connect to a broker."""

    username: str | None = Field(
        None, description="broker user name", json_schema_extra=panel(BROKER_PANEL)
    )
    password: str | None = Field(
        None, description="broker password", json_schema_extra=panel(BROKER_PANEL)
    )
    ca_file: str | None = Field(
        None, description="CA file for mqtts:// brokers", json_schema_extra=panel(BROKER_PANEL)
    )
    cert_file: str | None = Field(
        None,
        description="client certificate (with --key-file)",
        json_schema_extra=panel(BROKER_PANEL),
    )
    key_file: str | None = Field(
        None, description="client certificate's private key", json_schema_extra=panel(BROKER_PANEL)
    )
    tls_insecure: bool = Field(
        False, description="skip the broker host name check", json_schema_extra=panel(BROKER_PANEL)
    )

    mqtt_version: Literal["3.1.1", "5"] = Field(
        "3.1.1",
        description="MQTT version: 5 lets the broker drop a closed round's call for work "
        "(message expiry); the embedded broker speaks 3.1.1 only",
        json_schema_extra=panel(BROKER_PANEL),
    )

    def broker_settings(self, url: str) -> BrokerSettings:
        """Connection settings for `url` with these credentials."""
        return BrokerSettings(
            url=url,
            protocol=self.mqtt_version,
            username=self.username,
            password=self.password,
            ca_file=self.ca_file,
            cert_file=self.cert_file,
            key_file=self.key_file,
            tls_insecure=self.tls_insecure,
        )
