"""`kovenlab.json`, the provisioning file: how an appliance joins its fleet. The hub writes
it (`kvl hub provision`, `kvl image configure`); the appliance reads it to enroll."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from shared import pki

if TYPE_CHECKING:
    from pathlib import Path

NODE_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"


class ProvisioningError(Exception):
    """The provisioning file is missing or wrong; the message says how to fix it."""


class Provisioning(BaseModel):
    """`kovenlab.json`: how this appliance joins its fleet (written by the operator, or by
    `kvl image configure` into a flashed image)."""

    model_config = ConfigDict(extra="forbid")

    hub_url: str = Field(pattern=r"^https://", max_length=300, description="The hub's API.")
    token: str = Field(min_length=1, max_length=200, description="An enrollment token.")
    hub_fingerprint: str = Field(
        pattern=r"^sha256:[0-9a-fA-F:]{64,95}$",
        description="`kvl hub serve` prints it: the hub's certificate is pinned to it.",
    )
    name: str = Field(pattern=NODE_NAME, description="Node name.")
    labels: dict[str, str] = Field(default_factory=dict, max_length=32)

    @classmethod
    def load(cls, path: Path) -> Provisioning:
        try:
            return cls.model_validate_json(path.read_bytes())
        except FileNotFoundError as err:
            raise ProvisioningError(f"no provisioning file at {path}") from err
        except ValidationError as err:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or '(file)'}: {e['msg']}"
                for e in err.errors()
            )
            raise ProvisioningError(f"{path} is not a valid provisioning file: {problems}") from err

    def pin(self) -> bytes:
        return pki.fingerprint_bytes(self.hub_fingerprint)
