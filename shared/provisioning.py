"""`kovenlab.json`, the provisioning file: how an appliance starts its life. The hub writes
it for a node of its fleet (`kvl hub provision`, `kvl image configure`); `kvl image
configure --no-hub` writes it for a site without a hub. The appliance reads it to enroll,
or to take its first admin key.

A file is one of two kinds, never both and never neither, so that a missing field is an
error and not, silently, a node that runs without its hub:

- **a node of a fleet**: `hub_url`, `token` and `hub_fingerprint`, all three;
- **a site without a hub**: `bootstrap_key`, the prefix and hash of an admin key (never the
  key itself), which the appliance imports at start; with it the site's operator makes
  accounts and keys over the LAN (`/v1/admin/accounts`, `/v1/admin/keys`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from shared.keys import PREFIX_LEN, generate_key
from shared.site_network import SiteNetwork

if TYPE_CHECKING:
    from pathlib import Path

NODE_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"
# The names of accounts made on an appliance (its admin API, a bootstrap key) follow the
# node name's rule: one that is safe in a URL path, a log line and a file name.
ACCOUNT_NAME = NODE_NAME
KEY_PREFIX = rf"^[A-Za-z0-9]{{{PREFIX_LEN}}}$"
KEY_HASH = r"^[0-9a-f]{64}$"
BOOTSTRAP_ACCOUNT = "admin"
_HUB_FIELDS = ("hub_url", "token", "hub_fingerprint")


class ProvisioningError(Exception):
    """The provisioning file is missing or wrong; the message says how to fix it."""


@dataclass(frozen=True)
class Hub:
    """The hub a provisioning file names: where to enroll, with what, and its pin."""

    url: str
    token: str
    fingerprint: str

    def pin(self) -> bytes:
        from shared import pki  # noqa: PLC0415 - cryptography (14 MiB): only when enrolling

        return pki.fingerprint_bytes(self.fingerprint)


class BootstrapKey(BaseModel):
    """The first admin key of a site without a hub, as the appliance stores every key: its
    prefix and the SHA-256 of the whole key (`shared/keys.py`). The key itself was shown
    once, to whoever wrote the file, and is in no file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    account: str = Field(
        BOOTSTRAP_ACCOUNT, pattern=ACCOUNT_NAME, description="The account the key belongs to."
    )
    prefix: str = Field(pattern=KEY_PREFIX, description="The key's prefix (`kvl_<prefix>_…`).")
    hash: str = Field(pattern=KEY_HASH, description="sha256 of the whole key, hex.")

    @classmethod
    def generate(cls, account: str = BOOTSTRAP_ACCOUNT) -> tuple[BootstrapKey, str]:
        """A new admin key: (what the file holds, the key, to be shown once)."""
        new = generate_key()
        return cls(account=account, prefix=new.prefix, hash=new.hash), new.plaintext


class Provisioning(BaseModel):
    """`kovenlab.json`: how this appliance joins its fleet, or takes its first admin key on
    a site without a hub (written by the operator, or by `kvl image configure` into a
    flashed image)."""

    model_config = ConfigDict(extra="forbid")

    hub_url: str | None = Field(
        None, pattern=r"^https://", max_length=300, description="The hub's API."
    )
    token: str | None = Field(
        None, min_length=1, max_length=200, description="An enrollment token."
    )
    hub_fingerprint: str | None = Field(
        None,
        pattern=r"^sha256:[0-9a-fA-F:]{64,95}$",
        description="`kvl hub serve` prints it: the hub's certificate is pinned to it.",
    )
    name: str = Field(pattern=NODE_NAME, description="Node name.")
    labels: dict[str, str] = Field(default_factory=dict, max_length=32)
    bootstrap_key: BootstrapKey | None = Field(
        None, description="A site without a hub: its first admin key, as a hash."
    )
    network: SiteNetwork | None = Field(
        None, description="The site's network: static addresses, DNS, its proxy."
    )

    @model_validator(mode="after")
    def _a_fleet_or_a_site_without_a_hub(self) -> Self:
        given = [name for name in _HUB_FIELDS if getattr(self, name) is not None]
        if given and len(given) < len(_HUB_FIELDS):
            missing = ", ".join(name for name in _HUB_FIELDS if name not in given)
            raise ValueError(
                f"a node of a fleet needs hub_url, token and hub_fingerprint together; "
                f"missing: {missing}"
            )
        if given and self.bootstrap_key is not None:
            raise ValueError(
                "bootstrap_key is for a site without a hub; a node of a fleet gets its keys "
                "from its hub"
            )
        if not given and self.bootstrap_key is None:
            raise ValueError(
                "neither a hub (hub_url, token, hub_fingerprint) nor a bootstrap_key (a site "
                "without a hub): write it with `kvl hub provision` or `kvl image configure`"
            )
        return self

    @property
    def hub(self) -> Hub | None:
        """The hub to enroll with; None on a site without one."""
        if self.hub_url is None or self.token is None or self.hub_fingerprint is None:
            return None
        return Hub(self.hub_url, self.token, self.hub_fingerprint)

    def require_hub(self) -> Hub:
        hub = self.hub
        if hub is None:
            raise ProvisioningError(
                f"the provisioning file of {self.name} names no hub: a site without one "
                "does not enroll"
            )
        return hub

    def text(self) -> str:
        """The file as written: unset fields left out, so a file without a bootstrap key
        reads the same to appliances from before bootstrap keys."""
        return self.model_dump_json(indent=2, exclude_none=True) + "\n"

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
        return self.require_hub().pin()
