"""The operator API's request models (hub/api/operator.py), which the console's forms are
checked against too (hub/console/pages.py), and the OpenAPI document describes
(hub/api/openapi.py)."""

from __future__ import annotations

import uuid
from typing import Annotated, Literal, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    field_validator,
    model_validator,
)

from hub.fleet.budgets import window_s
from hub.planning.rollout import Strategy
from hub.planning.slo import Grouping
from hub.planning.tenancy import Tenancy
from hub.state.configuration import scope_of
from hub.state.deployments import DeploymentRecord
from hub.state.objectives import SloFilters
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
    preset: protocol.ModelPreset | None = Field(
        None, description="The model's settings on its nodes (docs/hub.md#model-presets)"
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
            preset=None if self.preset is None else self.preset.model_dump(exclude_defaults=True),
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


class NodeTenancyRequest(BaseModel):
    """A node's tenancy, the operator's to set (a node's labels grant it none): `{}` makes
    it a shared node."""

    model_config = ConfigDict(extra="forbid")

    tenant: Text | None = Field(
        None, min_length=1, description="dedicated to this tenant (S3); None: to none"
    )
    private: bool = Field(default=False, description="on its tenant's private site (S4)")


class SettingRequest(BaseModel):
    """One node setting the hub sets (hub/state/configuration.py): fleet-wide, or for a site
    or a node; `value` null unsets it there."""

    model_config = ConfigDict(extra="forbid")

    key: Text = Field(
        min_length=1,
        description="chat_default, default, aliases.ALIAS, objectives.CLASS.OBJECTIVE or "
        "packages.FIELD",
    )
    value: Text | None = Field(
        description="a model (name or name@version), or the field's number; null: unset"
    )
    site: Text | None = None
    node: Text | None = None

    @model_validator(mode="after")
    def _one_scope(self) -> Self:
        if self.site is not None and self.node is not None:
            raise ValueError("a setting is for a site or a node, not both")
        return self


class UploadRequest(BaseModel):
    """A model file the operator will upload in pieces (hub/api/uploads.py)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
    version: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
    size_bytes: int = Field(ge=1, le=1 << 44, description="the whole file's size")
    sha256: str | None = Field(
        None, pattern=r"^[0-9a-f]{64}$", description="checked once whole (unset: not checked)"
    )
    memory_mib: int | None = Field(None, ge=1, le=1 << 30)


class PullRequest(BaseModel):
    """A model to pull into the hub (hub/models/reference.py says what a reference is)."""

    model_config = ConfigDict(extra="forbid")

    reference: str = Field(
        min_length=1,
        max_length=1000,
        description="hf://OWNER/REPO[@REVISION]:QUANT, hf://OWNER/REPO[@REVISION]/FILE.gguf "
        "or an https:// URL",
    )
    name: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
    version: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
    memory_mib: int | None = Field(None, ge=1, le=16 << 20)


class TokenRequest(NodeTenancyRequest):
    """An enrollment token; the nodes it enrolls get its tenancy."""

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


# -- releases and rollouts --------------------------------------------------------------------

ReleaseVersion = Annotated[
    str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._+~-]{0,99}$"), protocol.Clean
]
Clock = Annotated[str, StringConstraints(pattern=r"^([01][0-9]|2[0-3]):[0-5][0-9]$")]


class ReleaseQuery(BaseModel):
    """The query of `POST /v1/admin/releases` (the body is the bundle)."""

    model_config = ConfigDict(extra="forbid")

    version: ReleaseVersion = Field(description="the image version the bundle installs")
    notes: Annotated[str, StringConstraints(max_length=2000), protocol.Clean] = ""


class WindowRequest(BaseModel):
    """A site's update window, UTC: its nodes fetch and install a release only from
    `start` up to `end` (past midnight when `end` is earlier)."""

    model_config = ConfigDict(extra="forbid")

    start: Clock = Field(description="HH:MM, UTC")
    end: Clock = Field(description="HH:MM, UTC")

    def window(self) -> protocol.UpdateWindow:
        def minutes(clock: str) -> int:
            hours, mins = clock.split(":")
            return int(hours) * 60 + int(mins)

        return protocol.UpdateWindow(start_min=minutes(self.start), end_min=minutes(self.end))

    @model_validator(mode="after")
    def _not_empty(self) -> Self:
        if self.start == self.end:
            raise ValueError("an update window from a time to the same time is empty")
        return self


class BandwidthRequest(BaseModel):
    """A site's bandwidth for the files its nodes fetch from the hub, shared by its nodes."""

    model_config = ConfigDict(extra="forbid")

    bytes_per_s: int = Field(ge=10_000, le=100_000_000_000, description="Bytes a second.")


class StrategyRequest(BaseModel):
    """How a rollout moves: a canary, then waves by share of its nodes or by site."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    canary: int = Field(1, ge=0, le=10_000, description="nodes in the canary wave")
    canary_nodes: list[Text] = Field(
        default_factory=list, max_length=100, description="the canary's nodes, by name or id"
    )
    waves: list[float] = Field(
        default_factory=lambda: [100.0],
        min_length=1,
        max_length=20,
        description="cumulative shares of the rollout's nodes, in %, ascending (the last "
        "wave takes the rest)",
    )
    sites: list[Annotated[list[Text], Field(min_length=1, max_length=100)]] = Field(
        default_factory=list, max_length=20, description="or: the sites of each wave, in order"
    )
    soak_s: float = Field(300.0, ge=0, le=7 * 86_400)
    max_unavailable: int = Field(1, ge=1, le=10_000)
    offline_after_s: float = Field(300.0, ge=1, le=7 * 86_400)
    max_burn_rate: float | None = Field(14.4, gt=0, le=1e6, description="None: not gated")
    min_requests: int = Field(20, ge=1, le=1_000_000_000)
    min_score: int | None = Field(
        None,
        ge=0,
        le=1000,
        description="a model rollout: instructions the node's evaluation of the new model "
        "must see followed (of 12); below it halts the rollout. None: not gated",
    )

    @model_validator(mode="after")
    def _waves(self) -> Self:
        if any(not 0 < w <= 100 for w in self.waves):
            raise ValueError("each wave's share is above 0 and at most 100 (%)")
        if any(b <= a for a, b in zip(self.waves, self.waves[1:], strict=False)):
            raise ValueError("wave shares are cumulative: each above the one before")
        if self.sites and "waves" in self.model_fields_set:
            raise ValueError("waves by share or by site, not both")
        return self

    def strategy(self) -> Strategy:
        return Strategy(
            canary=self.canary,
            canary_nodes=tuple(dict.fromkeys(self.canary_nodes)),
            waves=tuple(self.waves),
            sites=tuple(tuple(s) for s in self.sites),
            soak_s=self.soak_s,
            max_unavailable=self.max_unavailable,
            offline_after_s=self.offline_after_s,
            max_burn_rate=self.max_burn_rate,
            min_requests=self.min_requests,
            min_score=self.min_score,
        )


class RolloutRequest(BaseModel):
    """A staged rollout: of an image release to the fleet, or of a deployment's new model
    to the nodes that hold its replicas."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["release", "model", "settings"]
    release: ReleaseVersion | None = Field(None, description="kind release: its version")
    deployment: Text | None = Field(None, description="kind model: the deployment's id")
    model: Text | None = Field(
        None, pattern=r"^[^@\s]+@[^@\s]+$", description="kind model: the new name@version"
    )
    setting: Text | None = Field(
        None, description="kind settings: the key (as `PUT /v1/admin/settings` takes it)"
    )
    value: Text | None = Field(None, description="kind settings: its new value")
    site: Text | None = Field(None, description="kind settings: for this site's nodes only")
    node: Text | None = Field(None, description="kind settings: for this node only")
    strategy: StrategyRequest = Field(default_factory=StrategyRequest)

    @model_validator(mode="after")
    def _target(self) -> Self:
        settings = (self.setting, self.value, self.site, self.node)
        if self.kind == "release" and (
            not self.release or self.deployment or self.model or any(settings)
        ):
            raise ValueError("a release rollout names `release` (only)")
        if self.kind == "model" and (
            not self.deployment or not self.model or self.release or any(settings)
        ):
            raise ValueError("a model rollout names `deployment` and `model` (only)")
        if self.kind == "settings" and (
            not self.setting or self.value is None or self.release or self.deployment
            or self.model or (self.site and self.node)
        ):  # fmt: skip
            raise ValueError(
                "a settings rollout names `setting` and `value`, and `site` or `node` (or "
                "neither: the fleet)"
            )
        return self

    def target(self) -> dict[str, str]:
        if self.kind == "release":
            return {"release": str(self.release)}
        if self.kind == "settings":
            scope = scope_of(self.site, f"{self.node}" if self.node else None)
            return {"scope": scope, "key": str(self.setting), "value": str(self.value)}
        return {"deployment": str(self.deployment), "model": str(self.model)}
