"""Loading rules shared by every program's pydantic-settings model, and broker credentials.

Precedence, highest first: command-line flags, `PFL_*` environment variables, the TOML file given
with `--config`, then the model's defaults.
"""

from __future__ import annotations

from contextvars import ContextVar
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, Field, ValidationError
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from protocols.settings_errors import SettingsError, describe_settings_error
from protocols.transport.settings import BrokerSettings

SettingsT = TypeVar("SettingsT", bound="TomlSettings")
_CONFIG_FILE: ContextVar[Path | None] = ContextVar("pfl_config_file", default=None)


class TomlSettings(BaseSettings):
    """Shared loading rules: flags > PFL_* environment > TOML file > defaults."""

    model_config = SettingsConfigDict(env_prefix="PFL_", extra="forbid")

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Flags, then the environment, then the `--config` file; no dotenv or secrets dir."""
        del dotenv_settings, file_secret_settings
        path = _CONFIG_FILE.get()
        if path is None:
            return (init_settings, env_settings)
        return (init_settings, env_settings, TomlConfigSettingsSource(settings_cls, toml_file=path))

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
            raise SettingsError(describe_settings_error(error)) from None
        finally:
            _CONFIG_FILE.reset(token)


class BrokerAccess(BaseModel):
    """TLS and credential options shared by the programs that connect to a broker."""

    username: str | None = Field(None, description="broker user name")
    password: str | None = Field(None, description="broker password")
    ca_file: str | None = Field(None, description="CA certificate that signed the broker's")
    cert_file: str | None = Field(None, description="client certificate (with key_file)")
    key_file: str | None = Field(None, description="client certificate's private key")
    tls_insecure: bool = Field(False, description="skip the broker host name check")

    def broker_settings(self, url: str) -> BrokerSettings:
        """Connection settings for `url` with these credentials."""
        return BrokerSettings(
            url=url,
            username=self.username,
            password=self.password,
            ca_file=self.ca_file,
            cert_file=self.cert_file,
            key_file=self.key_file,
            tls_insecure=self.tls_insecure,
        )
