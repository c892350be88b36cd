"""Request bodies of the HTTP-only routes (the admin API), as pydantic models; those of the
OpenAI-compatible API are `appliance.inference.schemas`."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from appliance.serving.registry import MAX_REPLICAS
from shared import protocol
from shared.provisioning import ACCOUNT_NAME, KEY_PREFIX


class AdminModelRequest(BaseModel):
    """Load a model, or change its replicas or pin."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=200, description="`name` or `name@version`.")
    replicas: int | None = Field(
        None, ge=1, le=MAX_REPLICAS, description="Worker processes serving it (default 1)."
    )
    pinned: bool | None = Field(
        None, description="Pinned models stay loaded and are loaded again at start."
    )


# A name made here follows the node name's rule; one looked up may be any the store holds
# (the hub's, or the command line's), as long as it is text the store can keep.
AccountName = Annotated[str, StringConstraints(pattern=ACCOUNT_NAME)]
AnyAccountName = protocol.Name


class AccountRequest(BaseModel):
    """Make an account on a site without a hub."""

    model_config = ConfigDict(extra="forbid")

    name: AccountName = Field(
        description="1 to 63 of `A-Z a-z 0-9 . _ -`, a letter or digit first."
    )
    service_class: Literal["S0", "S1", "S2", "S3", "S4"] = Field(
        "S1", description="Its service class (`classes`)."
    )
    requests_per_minute: int | None = Field(
        None, ge=0, le=1_000_000, description="Its own rate; unset: the class's; 0: no limit."
    )
    tokens_per_day: int | None = Field(
        None, ge=0, le=10**12, description="Its own allowance; unset: the class's; 0: no limit."
    )


class KeyRequest(BaseModel):
    """Make a key of an account; the answer holds the key, once."""

    model_config = ConfigDict(extra="forbid")

    account: AnyAccountName = Field(description="An existing account that is not disabled.")
    admin: bool = Field(default=False, description="The key may use the `/v1/admin` routes.")


class KeyFilter(BaseModel):
    """The query of `GET /v1/admin/keys`."""

    model_config = ConfigDict(extra="forbid")

    account: AnyAccountName | None = None


class AccountPath(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: AnyAccountName


class KeyPath(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prefix: str = Field(pattern=KEY_PREFIX, description="The key's prefix, `kvl_<prefix>_…`.")
