"""The dashboard's settings, apart from its server so that reading them imports no web stack."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field


class DashboardSettings(BaseModel):
    """Where the dashboard listens and how a browser gets in."""

    listen: str = Field("127.0.0.1:8080", description="HOST:PORT the dashboard listens on")
    token: str | None = Field(
        None, description="token a browser must present; made up per run when not given"
    )
    token_file: Path | None = Field(
        None, description="file the token is written to (mode 0600), e.g. for scripts"
    )
    open_to_local_users: bool = Field(
        False, description="no token on loopback: every user of this machine reads the fleet"
    )
    cert_file: Path | None = Field(None, description="TLS certificate for the dashboard (PEM)")
    key_file: Path | None = Field(None, description="its private key (PEM)")
