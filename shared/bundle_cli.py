"""`kvl bundle`: site bundles (shared/site_bundle.py) made on any connected machine, for a
site without a hub (or behind a narrow link), and checked before they travel."""

from __future__ import annotations

import datetime
import json
import tempfile
from pathlib import Path

import click

from shared import site_bundle


@click.group("bundle")
def bundle() -> None:
    """Site bundles: models, a release, packages and settings in one signed file."""


def _named(value: str, what: str) -> tuple[str, Path]:
    """`NAME=FILE` (a model's `name@version`, a release's version)."""
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise click.BadParameter(f"give {what}=FILE, not {value!r}")
    file = Path(path)
    if not file.is_file():
        raise click.BadParameter(f"{file} is not a file")
    return name, file


@bundle.command("create")
@click.argument("out", type=click.Path(path_type=Path, dir_okay=False))
@click.option(
    "--model",
    "models",
    multiple=True,
    metavar="NAME@VERSION=FILE",
    help="A GGUF model file, registered under that name and version (repeat).",
)
@click.option(
    "--release",
    metavar="VERSION=FILE",
    help="An image release (a RAUC bundle of `just image`), installed to the other slot.",
)
@click.option(
    "--package",
    "packages",
    multiple=True,
    type=click.Path(path_type=Path, dir_okay=False, exists=True),
    help="A content package's archive (`GET /v1/packages/ID/archive`; repeat).",
)
@click.option(
    "--settings",
    "settings_file",
    type=click.Path(path_type=Path, dir_okay=False, exists=True),
    help="A settings overlay: the node settings a hub would set (JSON).",
)
@click.option(
    "--signing-cert",
    required=True,
    envvar="KVL_IMAGE_SIGNING_CERT",
    type=click.Path(path_type=Path, dir_okay=False, exists=True),
    help="The release signer's certificate (PEM), issued by a CA of the nodes' keyring.",
)
@click.option(
    "--signing-key",
    required=True,
    envvar="KVL_IMAGE_SIGNING_KEY",
    type=click.Path(path_type=Path, dir_okay=False, exists=True),
    help="Its private key (PEM).",
)
@click.option("--note", default="", help="What the bundle is for, shown as it is imported.")
def create(
    *,
    out: Path,
    models: tuple[str, ...],
    release: str | None,
    packages: tuple[Path, ...],
    settings_file: Path | None,
    signing_cert: Path,
    signing_key: Path,
    note: str,
) -> None:
    """Pack models, a release, packages and settings into the signed bundle OUT (a node
    imports it through `POST /v1/admin/bundles`)."""
    sources = [site_bundle.Source("package", path) for path in packages]
    for value in models:
        ref, file = _named(value, "NAME@VERSION")
        name, _, version = ref.partition("@")
        sources.append(site_bundle.Source("model", file, name, version or None))
    if release is not None:
        version, file = _named(release, "VERSION")
        sources.append(site_bundle.Source("release", file, version=version))
    if settings_file is not None:
        sources.append(site_bundle.Source("settings", settings_file))
    if not sources:
        raise click.UsageError("name at least one part: --model, --release, --package, --settings")
    try:
        made = site_bundle.create(
            out, sources, certificate=signing_cert.read_bytes(), key=signing_key.read_bytes(),
            note=note,
        )  # fmt: skip
    except site_bundle.BundleError as err:
        raise click.ClickException(str(err)) from err
    click.echo(f"made {out}: {len(made.parts)} part(s), {made.size} bytes")


@bundle.command("verify")
@click.argument("file", type=click.Path(path_type=Path, dir_okay=False, exists=True))
@click.option(
    "--keyring",
    required=True,
    type=click.Path(path_type=Path, dir_okay=False, exists=True),
    help="The CA certificates (PEM) the nodes trust: the image's RAUC keyring.",
)
def verify(*, file: Path, keyring: Path) -> None:
    """Check FILE as a node will (signature, every part's digest) and list its parts."""
    with tempfile.TemporaryDirectory(prefix=".kvl-bundle-") as staging:
        try:
            verified = site_bundle.read(file, Path(staging), keyring.read_bytes())
        except site_bundle.BundleError as err:
            raise click.ClickException(str(err)) from err
    manifest = verified.manifest
    made = datetime.datetime.fromtimestamp(manifest.created_at, datetime.UTC)
    click.echo(
        f"signed by {verified.signer}, made {made:%Y-%m-%d %H:%M} UTC by kvl "
        f"{manifest.kvl_version}{': ' + manifest.note if manifest.note else ''}"
    )
    for part in manifest.parts:
        named = f"{part.name}@{part.version}" if part.kind == "model" else part.version or ""
        click.echo(
            json.dumps(
                {"kind": part.kind, "name": named, "bytes": part.size, "sha256": part.sha256}
            )
        )
