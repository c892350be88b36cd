"""Every appliance setting, with a description and bounds (see appliance/config.example.yaml)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_DATA_DIR = Path.home() / ".local" / "share" / "kovenlab" / "appliance"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ServerSettings(_Section):
    host: str = Field(
        "0.0.0.0",  # noqa: S104 - the appliance serves its LAN by design
        description="Address the LAN API listens on; 0.0.0.0 for every interface.",
        min_length=1,
    )
    port: int = Field(8080, ge=1, le=65535, description="TCP port of the LAN API.")
    max_body_bytes: int = Field(
        1_048_576,
        ge=1024,
        le=64 * 1_048_576,
        description="Largest request body accepted; larger bodies get 413.",
    )
    tls_cert_file: Path | None = Field(
        None, description="PEM certificate chain for HTTPS on the LAN; unset serves plain HTTP."
    )
    tls_key_file: Path | None = Field(None, description="PEM private key matching tls_cert_file.")

    @model_validator(mode="after")
    def _tls_pair(self) -> Self:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("set both tls_cert_file and tls_key_file, or neither")
        return self


class ModelSettings(_Section):
    default: str = Field(
        "gemma-3-270m",
        min_length=1,
        max_length=200,
        description=(
            "Model served at start, as `name` or `name@version` from `kvl appliance models list`."
        ),
    )
    n_ctx: int = Field(
        4096, ge=256, le=131_072, description="Context window in tokens (prompt plus output)."
    )
    n_batch: int = Field(
        512, ge=32, le=8192, description="Prompt tokens evaluated per decode call (prefill chunk)."
    )
    n_threads: int | None = Field(
        None, ge=1, le=512, description="CPU threads for decoding; unset uses every core."
    )
    n_gpu_layers: int = Field(
        0, ge=-1, le=1000, description="Layers offloaded to a GPU (-1 = all); 0 on CPU-only nodes."
    )
    max_queue: int = Field(
        16,
        ge=0,
        le=4096,
        description="Requests that may wait for the model; one more gets 429 with Retry-After.",
    )
    max_tokens_limit: int = Field(
        4096, ge=1, le=131_072, description="Largest `max_tokens` a request may ask for."
    )


class DiscoverySettings(_Section):
    enabled: bool = Field(default=True, description="Announce the appliance on the LAN over mDNS.")
    node_name: str | None = Field(
        None,
        min_length=1,
        max_length=63,
        description="Instance name announced on the LAN; unset uses the host name.",
    )
    interfaces: list[str] | None = Field(
        None, description="IP addresses to announce on; unset announces on every interface."
    )


class ApplianceSettings(BaseSettings):
    model_config = SettingsConfigDict(extra="forbid")

    data_dir: Path = Field(
        DEFAULT_DATA_DIR, description="Directory for the database, models and packages."
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "INFO", description="Least severe log level written to stderr."
    )
    server: ServerSettings = Field(default_factory=ServerSettings, description="The LAN API.")
    model: ModelSettings = Field(default_factory=ModelSettings, description="Model serving.")
    discovery: DiscoverySettings = Field(
        default_factory=DiscoverySettings,
        description="LAN discovery (zeroconf).",
    )

    @property
    def db_path(self) -> Path:
        return self.data_dir / "appliance.db"

    @property
    def models_dir(self) -> Path:
        return self.data_dir / "models"
