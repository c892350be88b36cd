"""The operator API's request models (hub/api/operator.py), which the console's forms are
checked against too (hub/console/pages.py), and the OpenAPI document describes
(hub/api/openapi.py)."""

from __future__ import annotations

import uuid
from typing import Annotated, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    field_validator,
    model_validator,
)

from hub.fleet.budgets import window_s
from hub.fleet.objectives import Grouping, SloFilters
from hub.state.accounts import Tenancy
from hub.state.store import DeploymentRecord
from shared import protocol
from shared.classes import IsolationLevel

# Any text an operator sends the store: neither NUL nor a lone surrogate, which
# PostgreSQL's text cannot hold (SQLite's can), so that the driver's refusal (a 500) is a
# 400 here, on either store; the protocol's rule for what nodes send.
Text = Annotated[str, StringConstraints(max_length=200), protocol.Clean]


def storable(text: str) -> bool:
    """Whether `text` passes `Text`'s rule (for the path and the query, which no model
    parses)."""
    try:
        text.encode("utf-8")  # a lone surrogate is not UTF-8
    except UnicodeEncodeError:
        return False
    return "\x00" not in text


class DeploymentRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: Text = Field(pattern=r"^[^@\s]+@[^@\s]+$", description="name@version")
    replicas: int = Field(1, ge=0, le=10_000)
    service_class: str = Field("S1", pattern=r"^S[0-4]$")
    sites: list[Text] = Field(default_factory=list, max_length=100)
    regions: list[Text] = Field(default_factory=list, max_length=100)
    labels: dict[Text, Text] = Field(default_factory=dict, max_length=32)
    gpu: bool = False
    gpu_memory_mib: int = Field(0, ge=0)
    tenant: Text | None = None
    isolation: IsolationLevel = Field(
        IsolationLevel.I1, description="I1, I2 or I3 (docs/hub.md#tenancy-and-isolation)"
    )

    def record(self) -> DeploymentRecord:
        """The deployment to store, with a new id."""
        return DeploymentRecord(
            id=uuid.uuid4().hex[:12],
            model=self.model,
            replicas=self.replicas,
            service_class=self.service_class,
            isolation=self.isolation.value,
            constraints=self.model_dump(include={"sites", "regions", "labels", "gpu",
                                                 "gpu_memory_mib", "tenant"}),
        )  # fmt: skip

    @model_validator(mode="after")
    def _dedicated(self) -> Self:
        if self.service_class == "S3" and not self.tenant:
            raise ValueError("an S3 (dedicated) deployment names its tenant")
        if self.isolation == IsolationLevel.I3 and not self.tenant:
            raise ValueError("an I3 deployment names its tenant (it runs on its nodes only)")
        return self


class TenancyRequest(BaseModel):
    """An account's binding, set whole: `{}` makes it a shared account on every site."""

    model_config = ConfigDict(extra="forbid")

    tenant: Text | None = Field(None, min_length=1, description="None: a shared account")
    sites: list[Annotated[Text, Field(min_length=1)]] = Field(
        default_factory=list, max_length=100, description="only nodes of these (empty: any)"
    )
    dedicated: bool = Field(default=False, description="only its tenant's dedicated nodes serve it")

    @model_validator(mode="after")
    def _dedicated_needs_tenant(self) -> Self:
        if self.dedicated and not self.tenant:
            raise ValueError("an account restricted to dedicated nodes names its tenant")
        return self

    def tenancy(self) -> Tenancy:
        return Tenancy(self.tenant, tuple(dict.fromkeys(self.sites)), self.dedicated)


class DrainRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    draining: bool = True


class TokenRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    site: Text = Field(min_length=1)
    uses: int = Field(1, ge=1, le=100_000)
    expires_in_s: float = Field(86_400, gt=0, le=366 * 86_400)


class KeyRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    account: Text = Field(min_length=1)
    admin: bool = False


class SeedRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: Text | None = Field(None, max_length=100, description="the newest held if unset")
    site: Text | None = Field(None, description="every node if unset")


class SilenceRequest(BaseModel):
    """A silence: alerts whose rule (`rule`) and labels match every matcher exactly are
    recorded but not delivered, for `duration_s`."""

    model_config = ConfigDict(extra="forbid")

    matchers: dict[Annotated[Text, Field(min_length=1, max_length=100)], Text] = Field(
        min_length=1,
        max_length=20,
        description='label (or "rule") -> value, e.g. {"rule": "node_offline", "node": "n1"}',
    )
    duration_s: float = Field(3600, gt=0, le=90 * 86_400, description="how long it holds")
    comment: Text = Field("", max_length=500)


WINDOW_PATTERN = r"^[0-9]{1,7}[smhdw]$"


class ObjectivesQuery(BaseModel):
    """The query of `GET /v1/admin/objectives` and `…/objectives/series` (and the console's
    objectives page): a window, a grouping, filters."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    window: str = Field("1h", description="5m, 1h, 1d, 30d, … (at most 35d)")
    by: Grouping = "class"
    service_class: protocol.ServiceClassName | None = Field(None, alias="class")
    account: Text | None = None
    site: Text | None = None
    node: Text | None = Field(None, description="a node's id or name")
    step: str | None = Field(None, description="the series' step (rounded to the buckets)")

    @field_validator("service_class", "account", "site", "node", "step", mode="before")
    @classmethod
    def _blank_is_none(cls, value: object) -> object:
        # A form's empty field (the console's filters): no filter.
        return None if value == "" else value

    @field_validator("window", "step")
    @classmethod
    def _duration(cls, value: str | None) -> str | None:
        if value is not None:
            window_s(value)
        return value

    @property
    def step_s(self) -> float | None:
        return None if self.step is None else window_s(self.step)

    def filters(self) -> SloFilters:
        return SloFilters(self.service_class, self.account, self.site, self.node)
