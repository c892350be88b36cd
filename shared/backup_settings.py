"""The `backups` section of the hub's and the appliance's settings: when backups run
themselves, how many are kept, where, and how they are sealed (shared/backup_schedule.py
runs them). Light to import: the cron parser and age load only when a schedule or a
recipient is set."""

from __future__ import annotations

import zoneinfo
from pathlib import Path
from typing import TYPE_CHECKING, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

if TYPE_CHECKING:
    from apscheduler.triggers.cron import CronTrigger

    from shared.sealing import Sealing


class ScheduleSettings(BaseModel):
    """The `backups` section of both sides' settings."""

    model_config = ConfigDict(extra="forbid")

    schedule: str | None = Field(
        None,
        description="When to take a backup, as a crontab line (`30 2 * * *`: 02:30 every day) "
        "in `timezone`; unset takes none.",
        max_length=200,
    )
    timezone: str = Field("UTC", description="The schedule's time zone (IANA: Europe/Paris).")
    keep: int = Field(7, ge=1, le=1000, description="Backups kept; older ones are removed.")
    folder: Path | None = Field(
        None, description="Where they are kept; unset: DATA/backups (mode 0700)."
    )
    recipients: list[str] = Field(
        default_factory=list,
        max_length=16,
        description="Seal each with age to these X25519 recipients (`age1…`).",
    )
    passphrase_file: Path | None = Field(
        None,
        description="Seal each with the passphrase on this file's first line instead "
        "(keep the file mode 0600).",
    )
    grace_s: float = Field(
        3600.0,
        gt=0,
        le=7 * 86_400,
        description="How long a scheduled backup may take before the hub says it is overdue.",
    )

    @field_validator("schedule")
    @classmethod
    def _crontab(cls, value: str | None) -> str | None:
        if value is not None:
            from apscheduler.triggers.cron import CronTrigger  # noqa: PLC0415 - used when set

            try:
                CronTrigger.from_crontab(value, timezone="UTC")
            except ValueError as err:
                raise ValueError(
                    f"not a crontab line (minute hour day month weekday): {err}"
                ) from err
        return value

    @field_validator("timezone")
    @classmethod
    def _zone(cls, value: str) -> str:
        try:
            zoneinfo.ZoneInfo(value)
        except (zoneinfo.ZoneInfoNotFoundError, ValueError) as err:
            raise ValueError(f"{value!r} is not an IANA time zone") from err
        return value

    @field_validator("recipients")
    @classmethod
    def _recipients(cls, value: list[str]) -> list[str]:
        from shared import sealing  # noqa: PLC0415 - pyrage, when backups are sealed

        for recipient in value:
            try:
                sealing.check_recipient(recipient)
            except sealing.SealError as err:
                raise ValueError(str(err)) from err
        return value

    @model_validator(mode="after")
    def _one_seal(self) -> Self:
        if self.recipients and self.passphrase_file is not None:
            raise ValueError("seal backups to recipients or with a passphrase, not both")
        return self

    def trigger(self) -> CronTrigger | None:
        if self.schedule is None:
            return None
        from apscheduler.triggers.cron import CronTrigger  # noqa: PLC0415

        return CronTrigger.from_crontab(self.schedule, timezone=zoneinfo.ZoneInfo(self.timezone))

    def sealing(self) -> Sealing | None:
        """How each is sealed; the passphrase read now (its file may change)."""
        from shared import sealing  # noqa: PLC0415
        from shared.backup_archive import BackupError  # noqa: PLC0415

        if self.passphrase_file is not None:
            lines = self.passphrase_file.read_text().splitlines()
            if not lines or not lines[0]:
                raise BackupError(f"{self.passphrase_file} holds no passphrase")
            return sealing.Sealing(passphrase=lines[0])
        return sealing.sealing_of(self.recipients, None)
