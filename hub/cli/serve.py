"""`kvl hub config` and `kvl hub serve`: the hub's settings, and the hub itself."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click
import yaml

from hub.cli.common import hub_settings
from hub.settings import EXAMPLE_HEADER, HubSettings
from shared.cli import common_options, config_errors_exit
from shared.config import example_yaml

if TYPE_CHECKING:
    from pathlib import Path


@click.command("config")
@common_options
@click.option("--example", is_flag=True, help="Print the commented example config instead.")
@config_errors_exit
def show_config(config_file: Path | None, data_dir: Path | None, example: bool) -> None:
    """Validate the hub configuration and print the effective settings."""
    if example:
        click.echo(example_yaml(HubSettings, EXAMPLE_HEADER), nl=False)
        return
    settings = hub_settings(config_file, data_dir)
    click.echo(yaml.safe_dump(settings.model_dump(mode="json"), sort_keys=False), nl=False)


@click.command("serve")
@common_options
@click.option("--host", default=None, help="Listen address (overrides server.host).")
@click.option("--port", type=int, default=None, help="Listen port (overrides server.port).")
@config_errors_exit
def serve(
    config_file: Path | None, data_dir: Path | None, host: str | None, port: int | None
) -> None:
    """Serve the hub API over HTTPS; prints the fingerprint of the hub's CA, which
    provisioning files pin."""
    import logging  # noqa: PLC0415

    from aiohttp import web  # noqa: PLC0415

    from hub.app import create_app, freeze_heap, freezing  # noqa: PLC0415
    from hub.appkeys import TLS  # noqa: PLC0415
    from hub.identity import overlay_address  # noqa: PLC0415

    settings = hub_settings(config_file, data_dir, host=host, port=port)
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("apscheduler").setLevel(logging.WARNING)
    app = create_app(settings)
    app.on_startup.append(freeze_heap)  # after the store and the tasks have started
    app.cleanup_ctx.append(freezing)
    hub_tls = app[TLS]
    click.echo(
        f"kvl hub: serving https://{settings.server.host}:{settings.server.port} "
        f"(CA {hub_tls.phase.signing.fingerprint}; data in {settings.data_dir})",
        err=True,
    )
    # Nodes reach the API through the tunnel too, at the hub's overlay address.
    hosts = [settings.server.host]
    if settings.overlay.interface is not None:
        hosts.append(str(overlay_address(settings).ip))
    web.run_app(
        app,
        host=hosts,
        port=settings.server.port,
        ssl_context=hub_tls.server.outer,  # its certificate and trust follow pki/
        print=None,
        access_log=None,
    )
