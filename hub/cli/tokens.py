"""`kvl hub tokens …` and `kvl hub provision`: enrollment tokens, and the provisioning file
that carries one to a node."""

from __future__ import annotations

import json
import time
from pathlib import Path

import click

from hub.cli.common import hub_settings, opened_store, parse_duration
from hub.views import tenancy_text
from shared.cli import common_options, config_errors_exit


@click.group("tokens")
def tokens() -> None:
    """Enrollment tokens (only a hash is stored)."""


@tokens.command("create")
@common_options
@click.option("--site", required=True, help="The site the enrolled nodes belong to.")
@click.option("--uses", type=click.IntRange(1, 100_000), default=1, help="Enrollments (1).")
@click.option("--expires", default="24h", help="Lifetime: 30m, 24h, 7d … (24h).")
@click.option(
    "--tenant", default=None, help="The nodes it enrolls are dedicated to this tenant (S3)."
)
@click.option(
    "--private", is_flag=True, help="The nodes it enrolls are on the tenant's private site (S4)."
)
@config_errors_exit
def tokens_create(  # click passes every option by name
    *,
    config_file: Path | None,
    data_dir: Path | None,
    site: str,
    uses: int,
    expires: str,
    tenant: str | None,
    private: bool,
) -> None:
    """Create a token; it is printed once, alone on stdout. The tenancy of the nodes it
    enrolls is the token's (what a node says of its own grants it nothing)."""
    seconds = parse_duration(expires)
    with opened_store(hub_settings(config_file, data_dir)) as store:
        new = store.tokens.create(
            site, uses=uses, expires_in_s=seconds, tenant=tenant or None, private=private
        )
    click.echo(new.plaintext)


@tokens.command("list")
@common_options
@click.option("--json", "as_json", is_flag=True, help="Print JSON lines.")
@config_errors_exit
def tokens_list(config_file: Path | None, data_dir: Path | None, as_json: bool) -> None:
    """List tokens: prefix, site, uses left, expiry, state."""
    with opened_store(hub_settings(config_file, data_dir)) as store:
        rows = store.tokens.all()
    now = time.time()
    for token in rows:
        expires = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(token.expires_at))
        if as_json:
            click.echo(
                json.dumps(
                    {
                        "prefix": token.prefix,
                        "site": token.site,
                        "uses_left": token.uses_left,
                        "expires_at": expires,
                        "state": token.state(now),
                        "tenant": token.tenant,
                        "private": token.private,
                    }
                )
            )
        else:
            click.echo(
                f"{token.prefix}  {token.site:<20} {token.uses_left:>5} left  {expires}  "
                f"{tenancy_text(token.tenant, token.private):<16} {token.state(now)}"
            )


@tokens.command("revoke")
@common_options
@click.argument("prefix")
@config_errors_exit
def tokens_revoke(config_file: Path | None, data_dir: Path | None, prefix: str) -> None:
    """Revoke a token by its prefix (or the whole token)."""
    from shared.keys import ENROLLMENT_TOKEN, parse_prefix  # noqa: PLC0415

    prefix = parse_prefix(prefix, ENROLLMENT_TOKEN) or prefix
    with opened_store(hub_settings(config_file, data_dir)) as store:
        token = store.tokens.revoke(prefix)
    click.echo(f"revoked {token.prefix} (site {token.site})")


@click.command("provision")
@common_options
@click.option("--site", required=True, help="The site the node belongs to.")
@click.option("--name", required=True, help="The node's name.")
@click.option("--url", default=None, help="The hub API the node enrolls at (https://NAME:PORT).")
@click.option("--uses", type=click.IntRange(1, 100_000), default=1, help="Enrollments (1).")
@click.option("--expires", default="24h", help="Lifetime of its token: 30m, 24h, 7d … (24h).")
@click.option(
    "--output",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="Write the file here (mode 0600) instead of printing it.",
)
@config_errors_exit
def provision(
    config_file: Path | None,
    data_dir: Path | None,
    *,
    site: str,
    name: str,
    url: str | None,
    uses: int,
    expires: str,
    output: Path | None,
) -> None:
    """Make a provisioning file (kovenlab.json) for a node: a new enrollment token, the
    hub's URL and the fingerprint of its CA, which the node pins."""
    from pydantic import ValidationError  # noqa: PLC0415

    from hub.identity import certificates  # noqa: PLC0415
    from shared import protocol  # noqa: PLC0415
    from shared.files import write_private  # noqa: PLC0415
    from shared.provisioning import Provisioning  # noqa: PLC0415

    try:  # the hub enrolls only such a name: said now, not when the node first boots
        name = protocol.node_name(name)
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="--name") from err
    settings = hub_settings(config_file, data_dir)
    url = url or f"https://{settings.server.names[0]}:{settings.server.port}"
    seconds = parse_duration(expires)
    ca, _ = certificates(settings)
    try:  # checked before a token is made for it
        document = Provisioning(
            hub_url=url,
            token="-",  # noqa: S106 - a placeholder, replaced below
            hub_fingerprint=ca.fingerprint,
            name=name,
        )
    except ValidationError as err:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors())
        raise click.BadParameter(problems) from err
    with opened_store(settings) as store:
        token = store.tokens.create(site, uses=uses, expires_in_s=seconds).plaintext
    document = document.model_copy(update={"token": token})
    text = document.text()
    if output is None:
        click.echo(text, nl=False)
        return
    write_private(output, text)  # it holds a token
    click.echo(f"wrote {output} (node {name}, site {site}, hub {url})", err=True)
