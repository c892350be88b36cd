"""`kvl hub ca …`: the fleet's certificate authority: its phase and its rotation
(hub/certificates.py). The running hub follows each step within `pki.reload_s`."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import click

from hub.certificates import Authority
from hub.cli.common import hub_settings, opened_store
from shared import pki
from shared.cli import common_options, config_errors_exit

if TYPE_CHECKING:
    from pathlib import Path


@click.group("ca")
def ca() -> None:
    """The fleet's certificate authority."""


@ca.command("status")
@common_options
@config_errors_exit
def status(config_file: Path | None, data_dir: Path | None) -> None:
    """The CA's phase, the CAs trusted, and the live node certificates each one signed."""
    settings = hub_settings(config_file, data_dir)
    authority = Authority(settings)
    phase = authority.phase()
    with opened_store(settings) as store:
        live = store.certificates.live(time.time())
    click.echo(f"phase: {phase.name}")
    click.echo(f"bundle: {phase.digest}")
    roles = [("signing", phase.signing.cert_pem), ("staged", phase.staged),
             ("previous", phase.previous)]  # fmt: skip
    for role, pem in roles:
        if pem is None:
            continue
        fingerprint = pki.fingerprint(pem)
        click.echo(f"{role}: {fingerprint} ({live.get(fingerprint, 0)} live node certificates)")


@ca.command("rotate")
@common_options
@click.option("--force", is_flag=True, help="Take the step even though nodes are not ready.")
@config_errors_exit
def rotate(config_file: Path | None, data_dir: Path | None, force: bool) -> None:
    """The next step of a CA rotation: stage a new CA (trusted, not yet signing), switch
    to it (it signs; nodes renew), or retire the old one (once no live node certificate
    is its)."""
    settings = hub_settings(config_file, data_dir)
    authority = Authority(settings)
    before = authority.phase()
    if before.name == "staged" and not force:
        # The hub's own certificate moves to the new CA at the switch: a node that does
        # not trust it yet would lose the hub.
        now = time.time()
        with opened_store(settings) as store:
            behind = [
                n.name
                for n in store.nodes.all()
                if not n.revoked
                and n.last_seen is not None
                and now - n.last_seen < settings.fleet.offline_after_s
                and n.capacity.trust_digest != before.digest
            ]
        if behind:
            raise click.ClickException(
                f"{len(behind)} nodes do not hold the staged CA yet "
                f"({', '.join(behind[:10])}): wait for their next heartbeat"
            )
    if before.name == "switched" and before.previous is not None and not force:
        with opened_store(settings) as store:
            left = store.certificates.live(time.time()).get(pki.fingerprint(before.previous), 0)
        if left:
            raise click.ClickException(
                f"{left} live node certificates are the old CA's: retire it once their "
                "nodes have renewed (`kvl hub ca status`), or they stop being trusted"
            )
    after = authority.rotate()
    steps = {
        "staged": "a new CA is staged: nodes fetch the new bundle with their next "
        "heartbeat; rotate again to switch once they have (`kvl hub ca status`)",
        "switched": "the new CA signs; nodes renew at their next heartbeat; rotate again to "
        "retire the old CA once none of its certificates is live",
        "steady": "the old CA is retired",
    }
    click.echo(steps[after])
