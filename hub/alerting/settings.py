"""The alerts' settings (`alerts` of the hub's settings, hub/settings.py): the burn-rate
pairs, the rules' thresholds and grace periods, and the webhook receivers."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class BurnWindow(BaseModel):
    """One multi-window burn-rate alert: it fires while the error budget burns faster than
    `factor` times its sustainable rate over both the long and the short window."""

    model_config = ConfigDict(extra="forbid")

    long_s: float = Field(gt=0, le=2_592_000, description="The long window, in seconds.")
    short_s: float = Field(gt=0, le=2_592_000, description="The short window, in seconds.")
    factor: float = Field(gt=0, le=1000, description="The burn rate over both that fires it.")
    severity: Literal["page", "ticket"] = Field(description="`page` or `ticket`.")


def _default_burn() -> list[BurnWindow]:
    # The SRE workbook's: 2 % of a 30-day budget in an hour, 5 % in six hours (pages),
    # 10 % in a day (a ticket); each short window a twelfth of its long one, so the
    # alert ends soon after the burn does.
    return [
        BurnWindow(long_s=3600, short_s=300, factor=14.4, severity="page"),
        BurnWindow(long_s=21_600, short_s=1800, factor=6.0, severity="page"),
        BurnWindow(long_s=86_400, short_s=7200, factor=3.0, severity="ticket"),
    ]


class AlertWebhook(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str = Field(
        min_length=1, max_length=2000, pattern=r"^https?://", description="Where to POST."
    )
    secret: str = Field(
        min_length=16,
        max_length=500,
        description=(
            "The secret its deliveries are signed with (`Kvl-Signature`, shared/webhooks.py)."
        ),
    )


class AlertsSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    every_s: float = Field(
        15.0, ge=0.1, le=3600, description="Seconds between evaluations of the alert rules."
    )
    burn: list[BurnWindow] = Field(
        default_factory=_default_burn,
        max_length=10,
        description=(
            "The objective burn-rate alerts, per class and objective: windows, factor and "
            "severity of each (the SRE workbook's multi-window, multi-burn-rate alerts)."
        ),
    )
    restarts: int = Field(
        3,
        ge=0,
        le=1_000_000,
        description=(
            "A node whose model workers restarted more than this often in "
            "`restarts_window_s` fires `worker_restarts`."
        ),
    )
    restarts_window_s: float = Field(
        900.0, ge=1.0, le=86_400, description="The window of `restarts`, in seconds (15 min)."
    )
    certificate_expiry_s: float = Field(
        86_400.0,
        ge=1.0,
        le=7_776_000,
        description=(
            "A node certificate that expires within this many seconds fires "
            "`certificate_expiry` (nodes renew with a third of its lifetime left: one this "
            "close to its end was not renewed)."
        ),
    )
    renew_grace_s: float = Field(
        600.0,
        ge=0.0,
        le=604_800,
        description=(
            "A node heard from whose newest certificate is still the old CA's this long "
            "after it was told to renew (a CA rotation) fires `certificate_renewal`."
        ),
    )
    lease_grace_s: float = Field(
        300.0,
        ge=0.0,
        le=86_400,
        description=(
            "A node heard from whose heartbeats have said this many seconds that it serves "
            "accounts without a live quota lease (its lease calls fail: it serves them on "
            "their class's safe capacity, or refuses them) fires `lease_lapsed`. Keep it "
            "longer than a node takes to renew once the hub answers again (its lease "
            "checks, every few seconds); 0 fires at the first such heartbeat."
        ),
    )
    webhooks: list[AlertWebhook] = Field(
        default_factory=list,
        max_length=20,
        description=(
            "Receivers of every alert that fires or resolves (signed POSTs); silenced "
            "ones are not sent."
        ),
    )
    timeout_s: float = Field(
        10.0, ge=0.1, le=300, description="Seconds a webhook receiver has to answer."
    )
    backoff_initial_s: float = Field(
        1.0, ge=0.01, le=3600, description="The first retry's wait after a failed delivery."
    )
    backoff_max_s: float = Field(
        300.0, ge=0.01, le=86_400, description="The longest wait between retries."
    )
    retry_s: float = Field(
        86_400.0,
        ge=1.0,
        le=2_592_000,
        description="A delivery still failing this long after the alert changed is given up.",
    )
