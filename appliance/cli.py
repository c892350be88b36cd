"""`kvl appliance …`: serve, keys, accounts, models, discover, config."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import socket
import ssl
import time
from pathlib import Path
from typing import Any

import click
import yaml

from appliance.settings import EXAMPLE_HEADER, ApplianceSettings
from appliance.state.store import ConflictError, NotFoundError, Store
from shared.classes import ServiceClass
from shared.cli import (
    common_options,
    config_errors_exit,
    opened_archive,
    opening_options,
    passphrase_from,
    sealing_options,
    settings_from,
)
from shared.config import example_yaml

log = logging.getLogger(__name__)


def _settings(config_file: Path | None, data_dir: Path | None, **server: Any) -> ApplianceSettings:
    return settings_from(ApplianceSettings, config_file, data_dir, **server)


def _store(settings: ApplianceSettings) -> Store:
    return Store(settings.db_path)


@click.group("appliance")
def appliance() -> None:
    """The appliance: the LAN API, its keys and models."""


@appliance.command()
@common_options
@click.option("--host", default=None, help="Listen address (overrides server.host).")
@click.option("--port", type=int, default=None, help="Listen port (overrides server.port).")
@config_errors_exit
def serve(
    config_file: Path | None, data_dir: Path | None, host: str | None, port: int | None
) -> None:
    """Serve the OpenAI-compatible LAN API."""
    from appliance.app import create_app  # noqa: PLC0415 - keep the other commands light
    from appliance.gateway import server  # noqa: PLC0415

    settings = _settings(config_file, data_dir, host=host, port=port)
    logging.basicConfig(
        level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # Every scheduled heartbeat and sync would be two INFO lines: only its problems.
    logging.getLogger("apscheduler").setLevel(logging.WARNING)
    from appliance.gateway.appkeys import CERTIFICATE  # noqa: PLC0415

    _apply_pending_restore(settings)
    app = create_app(settings)
    ssl_context = None
    certificate = app[CERTIFICATE]
    if settings.server.tls_cert_file is not None and settings.server.tls_key_file is not None:
        ssl_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ssl_context.load_cert_chain(settings.server.tls_cert_file, settings.server.tls_key_file)
    elif settings.fleet.lan_tls and certificate.present:
        # The hub's certificate for this node, served as it is renewed.
        ssl_context = certificate.server(require_client=False).outer
    scheme = "https" if ssl_context else "http"
    server.run(
        app,
        settings.server.host,
        settings.server.port,
        ssl_context,
        on_started=lambda: click.echo(
            f"kvl appliance: serving {scheme}://{settings.server.host}:{settings.server.port}/v1 "
            f"(data in {settings.data_dir})",
            err=True,
        ),
    )


def _apply_pending_restore(settings: ApplianceSettings) -> None:
    """A restore the admin API staged, applied before the appliance serves again."""
    from appliance import backup as appliance_backup  # noqa: PLC0415
    from shared.backup_archive import BackupError  # noqa: PLC0415

    try:
        restored = appliance_backup.apply_pending(settings)
    except BackupError as err:  # the data directory is as it was: serve it
        log.warning("the staged restore was refused, nothing changed: %s", err)
        return
    if restored is not None:
        made = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(restored.manifest.created_at))
        log.warning(
            "restored the backup made at %s; what the data directory held is in %s",
            made, restored.set_aside,
        )  # fmt: skip


@appliance.command("config")
@common_options
@click.option("--example", is_flag=True, help="Print the commented example config instead.")
@config_errors_exit
def show_config(config_file: Path | None, data_dir: Path | None, example: bool) -> None:
    """Validate the configuration and print the effective settings."""
    if example:
        click.echo(example_yaml(ApplianceSettings, EXAMPLE_HEADER), nl=False)
        return
    settings = _settings(config_file, data_dir)
    click.echo(yaml.safe_dump(settings.model_dump(mode="json"), sort_keys=False), nl=False)


@appliance.group()
def keys() -> None:
    """API keys of accounts (only a hash is stored)."""


@keys.command("create")
@common_options
@click.option("--account", required=True, help="Account name; created if new.")
@click.option(
    "--class",
    "service_class",
    type=click.Choice([c.value for c in ServiceClass]),
    default=None,
    help="Service class of the account (default S1 for a new account).",
)
@click.option("--admin", is_flag=True, help="The key may also use the /v1/admin routes.")
@config_errors_exit
def keys_create(
    config_file: Path | None,
    data_dir: Path | None,
    account: str,
    service_class: str | None,
    admin: bool,
) -> None:
    """Create a key; it is printed once, alone on stdout."""
    store = _store(_settings(config_file, data_dir))
    try:
        cls = ServiceClass(service_class) if service_class else None
        new = store.create_key(account, cls, admin=admin)
    except ConflictError as err:  # a disabled account
        raise click.ClickException(str(err)) from err
    finally:
        store.close()
    click.echo(new.plaintext)


@keys.command("list")
@common_options
@click.option("--account", default=None, help="Only this account's keys.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON lines.")
@config_errors_exit
def keys_list(
    config_file: Path | None, data_dir: Path | None, account: str | None, as_json: bool
) -> None:
    """List keys (prefix, account, class, state)."""
    store = _store(_settings(config_file, data_dir))
    try:
        rows = store.list_keys(account)
    finally:
        store.close()
    for key in rows:
        if as_json:
            click.echo(
                json.dumps(
                    {
                        "prefix": key.prefix,
                        "account": key.account.name,
                        "class": key.account.service_class.value,
                        "admin": key.admin,
                        "created_at": key.created_at,
                        "revoked_at": key.revoked_at,
                    }
                )
            )
        else:
            state = f"revoked {key.revoked_at}" if key.revoked else "active"
            scope = "admin" if key.admin else "user"
            click.echo(
                f"{key.prefix}  {key.account.name:<20} {key.account.service_class.value}  "
                f"{scope:<5}  {state}"
            )


@keys.command("revoke")
@common_options
@click.argument("key")
@config_errors_exit
def keys_revoke(config_file: Path | None, data_dir: Path | None, key: str) -> None:
    """Revoke a key, given by its prefix or in full."""
    from shared.keys import parse_prefix  # noqa: PLC0415

    prefix = parse_prefix(key) or key
    store = _store(_settings(config_file, data_dir))
    try:
        revoked = store.revoke_key(prefix)
    except (NotFoundError, ConflictError) as err:
        raise click.ClickException(str(err)) from err
    finally:
        store.close()
    click.echo(f"revoked {revoked.prefix} of {revoked.account.name}", err=True)


@appliance.group()
def accounts() -> None:
    """Accounts: their webhook signing secrets."""


@accounts.command("webhook-secret")
@common_options
@click.option("--account", required=True, help="Account name.")
@click.option(
    "--rotate",
    is_flag=True,
    help="Replace the secret; the old one still signs for `jobs.webhook_secret_grace_s`.",
)
@config_errors_exit
def accounts_webhook_secret(
    config_file: Path | None, data_dir: Path | None, account: str, rotate: bool
) -> None:
    """Print the secret that signs the account's job webhooks (made if it has none)."""
    from appliance.state.jobs import JobStore  # noqa: PLC0415

    settings = _settings(config_file, data_dir)
    store = _store(settings)
    try:
        secret = JobStore(store.db).webhook_secret(
            account, rotate=rotate, grace_s=settings.jobs.webhook_secret_grace_s
        )
    except NotFoundError as err:
        raise click.ClickException(str(err)) from err
    finally:
        store.close()
    click.echo(secret)
    if rotate:
        grace = settings.jobs.webhook_secret_grace_s
        click.echo(
            f"rotated; deliveries are signed with the previous secret too for {grace:.0f} s",
            err=True,
        )


@appliance.group()
def models() -> None:
    """Model files: the embedded ones and GGUF files registered by path."""


@models.command("list")
@common_options
@click.option("--json", "as_json", is_flag=True, help="Print JSON lines.")
@config_errors_exit
def models_list(config_file: Path | None, data_dir: Path | None, as_json: bool) -> None:
    """List registered models (the embedded ones are copied in on first use)."""
    from appliance.serving.catalog import EMBEDDED, ModelFileError, ensure_embedded  # noqa: PLC0415

    settings = _settings(config_file, data_dir)
    store = _store(settings)
    try:
        for name in EMBEDDED:
            try:
                ensure_embedded(store, settings.models_dir, name)
            except ModelFileError as err:  # the others still list
                click.echo(f"not registered: {err}", err=True)
        records = store.list_models()
    finally:
        store.close()
    for r in records:
        if as_json:
            click.echo(json.dumps({**r.__dict__, "ref": r.ref}))
        else:
            # `*` served at start (model.default), `c` the chat default (model.chat_default)
            served = "*" if settings.model.default in (r.ref, r.name) else " "
            if served == " " and settings.model.chat_default in (r.ref, r.name):
                served = "c"
            click.echo(
                f"{served} {r.ref:<32} {r.format:<5} {r.quantization or '-':<8} "
                f"{r.size_bytes / 2**20:8.1f} MiB  {r.sha256[:12]}  {r.path}"
            )


@models.command("add")
@common_options
@click.argument("path", type=click.Path(path_type=Path, exists=True, dir_okay=False))
@click.option("--name", required=True, help="Model name clients will use.")
@click.option("--version", "version", required=True, help="Version, e.g. 1.0 or a date.")
@config_errors_exit
def models_add(
    config_file: Path | None, data_dir: Path | None, path: Path, name: str, version: str
) -> None:
    """Register a GGUF file, or a model script, by path (sha256 recorded; checked at every
    load)."""
    from appliance.serving.catalog import ModelFileError, register_file  # noqa: PLC0415

    if "@" in name or "@" in version:
        raise click.BadParameter("names and versions cannot contain '@'")
    store = _store(_settings(config_file, data_dir))
    try:
        record = register_file(store, path, name, version)
    except (ModelFileError, ConflictError) as err:
        raise click.ClickException(str(err)) from err
    finally:
        store.close()
    kind = "a scripted model" if record.format == "script" else record.quantization
    click.echo(
        f"registered {record.ref} ({kind or 'unknown quantization'}, sha256 {record.sha256})"
    )


@appliance.command()
@common_options
@click.option("--timeout", type=float, default=3.0, show_default=True, help="Seconds to listen.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON lines.")
@config_errors_exit
def discover(
    config_file: Path | None, data_dir: Path | None, timeout: float, as_json: bool
) -> None:
    """List appliances announcing themselves on the LAN."""
    from appliance.discovery.mdns import discover as browse  # noqa: PLC0415

    settings = _settings(config_file, data_dir)
    for found in browse(timeout, settings.discovery.interfaces):
        if as_json:
            click.echo(json.dumps({**found.__dict__, "url": found.url}))
        else:
            click.echo(f"{found.name:<24} {found.url:<32} node {found.node_id}  v{found.version}")


@appliance.command()
@common_options
@click.option(
    "--provisioning",
    "provisioning_file",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="kovenlab.json (default: fleet.provisioning_file).",
)
@config_errors_exit
def enroll(config_file: Path | None, data_dir: Path | None, provisioning_file: Path | None) -> None:
    """Enroll with the fleet's hub now (`serve` also does it on start)."""
    import asyncio  # noqa: PLC0415

    from appliance.fleet.client import HubError, HubRefusedError  # noqa: PLC0415
    from appliance.fleet.identity import FleetFiles  # noqa: PLC0415
    from appliance.fleet.link import enroll as enroll_node  # noqa: PLC0415
    from shared.provisioning import Provisioning, ProvisioningError  # noqa: PLC0415

    settings = _settings(config_file, data_dir)
    path = provisioning_file or settings.fleet.provisioning_file
    if path is None:
        raise click.UsageError(
            "no provisioning file: pass --provisioning or set fleet.provisioning_file"
        )
    try:
        identity = asyncio.run(enroll_node(FleetFiles(settings.fleet_dir), Provisioning.load(path)))
    except (ProvisioningError, HubRefusedError, HubError) as err:
        raise click.ClickException(str(err)) from err
    click.echo(
        f"enrolled: {identity.name} ({identity.node_id}) at site {identity.site}, "
        f"overlay {identity.overlay_address}; hub {identity.hub_url}"
    )


def _tunnel_state(settings: ApplianceSettings, overlay_address: str | None) -> str:
    if not settings.fleet.tunnel:
        return "off (fleet.tunnel: false)"
    name = _interface_holding(overlay_address) or settings.fleet.interface
    state = Path("/sys/class/net") / name / "operstate"
    if not state.parent.exists():
        return f"down ({name} does not exist)"
    return f"up ({name})"


def _interface_holding(address: str | None) -> str | None:
    """The interface that holds the node's overlay address: the tunnel the running
    appliance brought up, whatever `fleet.interface` this command's own settings say (the
    serving process may have had another, from its environment or its config file)."""
    if address is None:
        return None
    import psutil  # noqa: PLC0415

    try:
        wanted = ipaddress.ip_address(address)
    except ValueError:
        return None
    for name, addresses in psutil.net_if_addrs().items():
        for found in addresses:
            if found.family not in {socket.AF_INET, socket.AF_INET6}:
                continue
            with contextlib.suppress(ValueError):
                if ipaddress.ip_address(found.address.partition("%")[0]) == wanted:
                    return name
    return None


@appliance.command()
@common_options
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@config_errors_exit
def status(config_file: Path | None, data_dir: Path | None, as_json: bool) -> None:
    """The fleet link: enrolled? tunnel? last heartbeat and sync? outbox lag? The image's
    version and its last update."""
    import time  # noqa: PLC0415

    from appliance.fleet.identity import FleetFiles  # noqa: PLC0415
    from appliance.fleet.release import image_version  # noqa: PLC0415

    settings = _settings(config_file, data_dir)
    identity = FleetFiles(settings.fleet_dir).identity()
    store = _store(settings)
    try:
        heartbeat, sync = store.meta("last_heartbeat_at"), store.meta("last_sync_at")
        lag = store.outbox_lag()
        update = _update_summary(store.meta("image_update"))
    finally:
        store.close()
    now = time.time()

    def ago(at: str | None) -> str | None:
        return None if at is None else f"{now - float(at):.0f} s ago"

    report = {
        "enrolled": identity is not None,
        "node_id": identity.node_id if identity else None,
        "name": identity.name if identity else None,
        "site": identity.site if identity else None,
        "overlay_address": identity.overlay_address if identity else None,
        "hub": identity.hub_url if identity else None,
        "tunnel": _tunnel_state(settings, identity.overlay_address if identity else None),
        "last_heartbeat": ago(heartbeat),
        "last_sync": ago(sync),
        "outbox_lag": lag,
        "outbox_alarm": lag >= settings.fleet.outbox_alarm_events,
        # As flashed (os-release); a slot the updater installed says so in `update`.
        "image": image_version(settings.update.os_release),
        "update": update,
    }
    if as_json:
        click.echo(json.dumps(report))
        return
    for key, value in report.items():
        click.echo(f"{key + ':':<17} {'-' if value is None else value}")


def _update_summary(raw: str | None) -> str | None:
    """The last image update as the updater keeps it: `VERSION: STATE (error)`."""
    if not raw:
        return None
    try:
        record = json.loads(raw)
        summary = f"{record['target']}: {record['state']}"
    except (ValueError, TypeError, KeyError):
        return None  # written by another version
    error = record.get("error")
    return f"{summary} ({error})" if error else summary


@appliance.command("backup")
@common_options
@click.argument("out", type=click.Path(path_type=Path, dir_okay=False))
@click.option(
    "--no-packages",
    is_flag=True,
    help="Leave out the package cache (DATA/packages/): packages made here are then lost.",
)
@sealing_options
@config_errors_exit
def backup(
    *,
    config_file: Path | None,
    data_dir: Path | None,
    out: Path,
    no_packages: bool,
    recipients: tuple[str, ...],
    passphrase_file: Path | None,
) -> None:
    """Back the appliance up into the archive OUT (a tar; gzipped if OUT ends in .gz),
    while it serves: its database, its fleet identity and its package cache. OUT holds the
    node's keys: it is written mode 0600; keep it as safe as the appliance, or seal it."""
    from appliance import backup as appliance_backup  # noqa: PLC0415
    from shared import sealing  # noqa: PLC0415
    from shared.backup_archive import BackupError  # noqa: PLC0415

    settings = _settings(config_file, data_dir)
    try:
        seal = sealing.sealing_of(recipients, passphrase_from(passphrase_file))
        made = sealing.write_sealed(
            out,
            seal,
            lambda path: appliance_backup.backup(settings, path, packages=not no_packages),
        )
    except BackupError as err:
        raise click.ClickException(str(err)) from err
    manifest = made.manifest
    click.echo(
        f"backed up the appliance to {out}: its database (schema {manifest.migrations[-1]}, "
        f"outbox checkpoint {manifest.serials.get('sync_checkpoint', 0)}) and "
        f"{len(manifest.members) - 1} file(s), {manifest.size} bytes"
    )
    for name in made.left_out:
        click.echo(f"not in the backup: {settings.data_dir / name}", err=True)


@appliance.command("restore")
@common_options
@click.argument("archive", type=click.Path(path_type=Path, dir_okay=False, exists=True))
@click.option(
    "--force",
    is_flag=True,
    help="Restore into a data directory that is not empty: what it holds is moved aside "
    "first, into DATA/replaced-TIME/.",
)
@opening_options
@config_errors_exit
def restore(
    *,
    config_file: Path | None,
    data_dir: Path | None,
    archive: Path,
    force: bool,
    identity_files: tuple[Path, ...],
    passphrase_file: Path | None,
) -> None:
    """Restore an appliance's backup into this data directory, with no appliance serving
    from it (a sealed one opened with --identity or --passphrase-file). The archive is
    checked whole first. Events the hub may hold already are sent again (it stores each
    once); the live objectives start a new epoch."""
    import datetime  # noqa: PLC0415

    from appliance import backup as appliance_backup  # noqa: PLC0415
    from shared.backup_archive import BackupError  # noqa: PLC0415

    settings = _settings(config_file, data_dir)
    try:
        with opened_archive(archive, settings.data_dir, identity_files, passphrase_file) as plain:
            restored = appliance_backup.restore(settings, plain, force=force)
    except BackupError as err:
        raise click.ClickException(str(err)) from err
    taken = datetime.datetime.fromtimestamp(restored.manifest.created_at, datetime.UTC)
    click.echo(
        f"restored the appliance as it was at {taken:%Y-%m-%d %H:%M:%S} UTC into "
        f"{settings.data_dir}; objectives epoch {restored.epoch}"
    )
    if restored.set_aside is not None:
        click.echo(f"what was there before is in {restored.set_aside}")


@appliance.group()
def outbox() -> None:
    """The outbox: events recorded here for the fleet's hub."""


@outbox.command("resend")
@common_options
@click.option(
    "--since",
    required=True,
    type=click.DateTime(["%Y-%m-%dT%H:%M:%S", "%Y-%m-%d %H:%M:%S", "%Y-%m-%d"]),
    help="Send again every event recorded at this time (UTC) or later.",
)
@config_errors_exit
def outbox_resend(config_file: Path | None, data_dir: Path | None, since: Any) -> None:
    """Send the hub every event recorded since a time again, e.g. after the hub was
    restored from a backup older than that: the hub stores those it lacks and counts none
    twice. Run it with the appliance stopped."""
    import datetime  # noqa: PLC0415

    from appliance.state.dump import resend_since  # noqa: PLC0415
    from shared.backup_archive import BackupError, restoring  # noqa: PLC0415

    settings = _settings(config_file, data_dir)
    try:
        # While the link runs, an acknowledgement in flight would move the checkpoint
        # forward again, past events this moved it back before.
        with restoring(settings.data_dir, "an appliance", "resending"):
            store = _store(settings)
            try:
                lag = resend_since(store, since.replace(tzinfo=datetime.UTC))
            finally:
                store.close()
    except BackupError as err:
        raise click.ClickException(str(err)) from err
    click.echo(f"the outbox holds {lag} event(s) to send; the appliance sends them once started")
