"""Hub settings (same loading rules as the appliance: YAML file, KVL_ environment, flags)."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_DATA_DIR = Path.home() / ".local" / "share" / "kovenlab" / "hub"


class HubServerSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    host: str = Field("127.0.0.1", min_length=1, description="Address the hub API listens on.")
    port: int = Field(8443, ge=1, le=65535, description="TCP port of the hub API.")


class HubSettings(BaseSettings):
    model_config = SettingsConfigDict(extra="forbid")

    data_dir: Path = Field(DEFAULT_DATA_DIR, description="Directory for the hub database and keys.")
    server: HubServerSettings = Field(default_factory=HubServerSettings, description="The hub API.")
