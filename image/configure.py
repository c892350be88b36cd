"""`kvl image`: the provisioning file of an appliance image, written without mounting it.

The image (`just image`, see image/build.py) is a raw GPT disk: an EFI system partition
(FAT), root file systems for slots A and B, and a data partition. On first boot the
appliance reads `kovenlab.json` from the EFI system partition and enrolls with its hub, or,
on a site without a hub, takes the bootstrap admin key the file holds the hash of.
`kvl image configure` puts that file there: the GPT is read here, and the FAT file system
at the partition's offset is written by mtools (`mcopy -i IMAGE@@OFFSET`), so no loop
device, mount or root is needed.

The partition layout is defined here, where the build and the configuration both read it.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import tempfile
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import click
from pydantic import ValidationError

from shared import protocol
from shared.files import write_private
from shared.keys import ENROLLMENT_TOKEN, parse_prefix
from shared.provisioning import BOOTSTRAP_ACCOUNT, BootstrapKey, Provisioning, ProvisioningError
from shared.site_network import SiteNetwork

if TYPE_CHECKING:
    from collections.abc import Sequence

SECTOR = 512
PROVISIONING_FILE = "kovenlab.json"

# GPT partition types (the Discoverable Partitions Specification's).
ESP_TYPE = uuid.UUID("c12a7328-f81f-11d2-ba4b-00a0c93ec93b")
ROOT_X86_64_TYPE = uuid.UUID("4f68bce3-e8cd-4db1-96e7-fbcaf984b709")
LINUX_DATA_TYPE = uuid.UUID("0fc63daf-8483-4772-8e79-3d69d8477de4")

# Partition names (GPT labels), which /etc/fstab and the boot entries use.
ESP_LABEL = "kvl-esp"
ROOT_A_LABEL = "kvl-root-a"
ROOT_B_LABEL = "kvl-root-b"
DATA_LABEL = "kvl-data"

_GPT_SIGNATURE = b"EFI PART"
_HEADER = struct.Struct("<8sIIIIQQQQ16sQIII")
_ENTRY = struct.Struct("<16s16sQQQ72s")
_MAX_ENTRIES = 1024


class ImageError(Exception):
    """The file is not an appliance image, or its provisioning file could not be written;
    the message says which, and what to do."""


@dataclass(frozen=True)
class Partition:
    number: int  # 1-based, as the kernel counts
    type: uuid.UUID
    uuid: uuid.UUID
    name: str
    first_lba: int
    last_lba: int

    @property
    def offset(self) -> int:
        return self.first_lba * SECTOR

    @property
    def size(self) -> int:
        return (self.last_lba - self.first_lba + 1) * SECTOR


def partitions(image: Path) -> list[Partition]:
    """The partitions of a GPT disk image (512-byte sectors), checked against its CRCs."""
    try:
        with image.open("rb") as f:
            f.seek(SECTOR)
            header = f.read(_HEADER.size)
            size = os.fstat(f.fileno()).st_size
            if len(header) < _HEADER.size or header[:8] != _GPT_SIGNATURE:
                raise ImageError(f"{image} is not a GPT disk image (no GPT header at sector 1)")
            (
                _,
                _revision,
                header_size,
                header_crc,
                _,
                _current,
                _backup,
                _first_usable,
                _last_usable,
                _disk_guid,
                entries_lba,
                count,
                entry_size,
                entries_crc,
            ) = _HEADER.unpack(header)
            if not (_HEADER.size <= header_size <= SECTOR):
                raise ImageError(f"{image}: the GPT header is damaged (size {header_size})")
            f.seek(SECTOR)
            whole = bytearray(f.read(header_size))
            whole[16:20] = bytes(4)  # the CRC is computed with its own field zeroed
            if zlib.crc32(whole) != header_crc:
                raise ImageError(f"{image}: the GPT header is damaged (its CRC does not match)")
            if not (0 < count <= _MAX_ENTRIES and entry_size >= _ENTRY.size):
                raise ImageError(f"{image}: the GPT header is damaged ({count} entries)")
            f.seek(entries_lba * SECTOR)
            table = f.read(count * entry_size)
    except OSError as err:
        raise ImageError(f"cannot read {image}: {err.strerror or err}") from err
    if zlib.crc32(table) != entries_crc:
        raise ImageError(f"{image}: the GPT partition table is damaged (its CRC does not match)")
    found: list[Partition] = []
    for index in range(count):
        raw = table[index * entry_size : index * entry_size + _ENTRY.size]
        kind, unique, first, last, _attributes, name = _ENTRY.unpack(raw)
        if kind == bytes(16):
            continue
        part = Partition(
            number=index + 1,
            type=uuid.UUID(bytes_le=kind),
            uuid=uuid.UUID(bytes_le=unique),
            name=name.decode("utf-16-le", errors="replace").rstrip("\x00"),
            first_lba=first,
            last_lba=last,
        )
        if last < first or part.offset + part.size > size:
            raise ImageError(
                f"{image}: partition {part.number} ends past the end of the file "
                "(a truncated image? build it again with `just image`)"
            )
        found.append(part)
    return found


def esp(image: Path) -> Partition:
    """The image's EFI system partition, where the provisioning file goes."""
    for part in partitions(image):
        if part.type == ESP_TYPE:
            return part
    raise ImageError(f"{image} has no EFI system partition: not an appliance image")


def _mtools(
    tool: str, image: Path, part: Partition, *args: str
) -> subprocess.CompletedProcess[str]:
    executable = shutil.which(tool)
    if executable is None:
        raise ImageError(
            f"`{tool}` (mtools) is not installed: run `just setup-image`, or install mtools"
        )
    if "@@" in str(image):
        raise ImageError(f"{image}: mtools cannot open a path containing '@@'; rename the file")
    return subprocess.run(  # noqa: S603 - the image path and fixed arguments
        [executable, "-i", f"{image}@@{part.offset}", *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
        # The partition holds a FAT file system, not a floppy: skip mtools' geometry checks.
        env={**os.environ, "MTOOLS_SKIP_CHECK": "1"},
    )


def _names(image: Path, part: Partition) -> list[str]:
    """The file names in the root folder of the EFI system partition."""
    listing = _mtools("mdir", image, part, "-b", "::/")
    if listing.returncode != 0:
        raise ImageError(
            f"{image}: the EFI system partition holds no FAT file system that mtools can read "
            f"({listing.stderr.strip() or listing.stdout.strip()})"
        )
    return [line.removeprefix("::/") for line in listing.stdout.split()]


def read_provisioning(image: Path) -> Provisioning | None:
    """The provisioning file in the image, or None when it has none."""
    part = esp(image)
    # FAT compares names without case, and so does the appliance's first boot.
    if PROVISIONING_FILE not in (name.lower() for name in _names(image, part)):
        return None
    read = _mtools("mtype", image, part, f"::/{PROVISIONING_FILE}")
    if read.returncode != 0:
        raise ImageError(f"{image}: cannot read {PROVISIONING_FILE}: {read.stderr.strip()}")
    try:
        return Provisioning.model_validate_json(read.stdout)
    except ValidationError as err:
        raise ImageError(
            f"{image}: its {PROVISIONING_FILE} is not valid; write it again with "
            "`kvl image configure`"
        ) from err


def configure(image: Path, document: Provisioning) -> Partition:
    """Write `kovenlab.json` onto the image's EFI system partition (replacing one that is
    there), read it back, and return the partition it went to."""
    part = esp(image)
    _names(image, part)  # a FAT file system is there, or a clear error
    with tempfile.TemporaryDirectory(prefix="kvl-image-") as folder:
        source = Path(folder) / PROVISIONING_FILE
        write_private(source, document.text())
        # -o and -D o: replace the file of that name, never ask.
        copy = _mtools(
            "mcopy", image, part, "-o", "-D", "o", str(source), f"::/{PROVISIONING_FILE}"
        )
    if copy.returncode != 0:
        raise ImageError(f"{image}: cannot write {PROVISIONING_FILE}: {copy.stderr.strip()}")
    if read_provisioning(image) != document:
        raise ImageError(f"{image}: {PROVISIONING_FILE} did not read back as it was written")
    return part


def check_hub_url(url: str) -> str:
    """`https://HOST[:PORT]`, the hub's API, or ValueError saying what is wrong."""
    try:
        parts = urlsplit(url)
        port = parts.port  # raises ValueError for a port that is not one
    except ValueError as err:
        raise ValueError(f"{url!r} is not a URL ({err})") from err
    if parts.scheme != "https":
        raise ValueError(f"{url!r} is not https://HOST[:PORT]: the hub only speaks HTTPS")
    if not parts.hostname:
        raise ValueError(f"{url!r} names no host")
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username:
        raise ValueError(f"{url!r}: give the hub's address alone, https://HOST[:PORT]")
    if port == 0:
        raise ValueError(f"{url!r}: port 0 is not a port")
    return url.rstrip("/")


def check_token(token: str) -> str:
    if parse_prefix(token, ENROLLMENT_TOKEN) is None:
        raise ValueError(
            "not an enrollment token (kvle_…); make one with `kvl hub tokens create` "
            "or `kvl hub provision`"
        )
    return token


def provisioning_from(
    hub_url: str, token: str, fingerprint: str, name: str, labels: dict[str, str]
) -> Provisioning:
    """A provisioning file from its parts, every one checked; ValueError names each
    problem."""
    problems: list[str] = []
    # The hub enrolls only a name that is one DNS label: said here, not at first boot.
    checks = (("--hub", check_hub_url, hub_url), ("--token", check_token, token),
              ("--name", protocol.node_name, name))  # fmt: skip
    for what, check, value in checks:
        try:
            check(value)
        except ValueError as err:
            problems.append(f"{what}: {err}")
    try:
        document = Provisioning(
            hub_url=hub_url.rstrip("/"),
            token=token,
            hub_fingerprint=fingerprint,
            name=name,
            labels=labels,
        )
    except ValidationError as err:
        flags = {"hub_url": "--hub", "hub_fingerprint": "--fingerprint", "labels": "--label"}
        for error in err.errors():
            field = str(error["loc"][0]) if error["loc"] else ""
            if field in ("hub_url", "token"):
                continue  # reported above, in plainer words
            problems.append(f"{flags.get(field, '--' + field)}: {error['msg']}")
    if problems:
        raise ValueError("; ".join(problems))
    return document


def provisioning_without_hub(name: str, account: str) -> tuple[Provisioning, str]:
    """A provisioning file for a site without a hub, with a new bootstrap admin key: (the
    file, which holds the key's hash alone; the key, to be shown once). ValueError names
    each problem."""
    try:
        key, plaintext = BootstrapKey.generate(account)
    except ValidationError as err:
        raise ValueError(f"--admin-account: {err.errors()[0]['msg']}") from err
    try:
        document = Provisioning(name=name, bootstrap_key=key)
    except ValidationError as err:
        raise ValueError(
            "; ".join(
                f"--{'.'.join(map(str, e['loc'])) or 'name'}: {e['msg']}" for e in err.errors()
            )
        ) from err
    return document, plaintext


_NETWORK_FIELDS = {
    "--address": "addresses", "--gateway": "gateways", "--dns": "dns",
    "--https-proxy": "https_proxy", "--no-proxy": "no_proxy",
}  # fmt: skip


def with_network(document: Provisioning, flags: dict[str, object]) -> Provisioning:
    """`document` with the site's network the flags give (none given: as it is); a wrong
    value is a usage error naming its flag."""
    given = {
        _NETWORK_FIELDS[flag]: list(value) if isinstance(value, tuple) else value
        for flag, value in flags.items()
        if value not in (None, ())
    }
    if not given:
        return document
    try:
        network = SiteNetwork.model_validate(given)
    except ValidationError as err:
        named = {field: flag for flag, field in _NETWORK_FIELDS.items()}
        problems = "; ".join(
            f"{named.get(str(e['loc'][0]), '--address') if e['loc'] else '--address'}: {e['msg']}"
            for e in err.errors()
        )
        raise click.UsageError(problems) from err
    return document.model_copy(update={"network": network})


def _labels(pairs: Sequence[str]) -> dict[str, str]:
    labels: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{pair!r} is not KEY=VALUE", param_hint="--label")
        labels[key] = value
    return labels


@click.group("image")
def image() -> None:
    """The appliance image (`just image` builds it): its provisioning file."""


_IMAGE = click.Path(path_type=Path, dir_okay=False, exists=True)


@image.command("configure")
@click.argument("image_file", metavar="IMAGE", type=_IMAGE)
@click.option(
    "--provisioning",
    type=click.Path(path_type=Path, dir_okay=False, exists=True),
    default=None,
    help="A kovenlab.json from `kvl hub provision`, instead of the options below.",
)
@click.option("--hub", "hub_url", default=None, help="The hub's API: https://HOST[:PORT].")
@click.option(
    "--token",
    envvar="KVL_ENROLLMENT_TOKEN",
    default=None,
    help="An enrollment token, kvle_… (also $KVL_ENROLLMENT_TOKEN, kept off the command line).",
)
@click.option(
    "--fingerprint",
    default=None,
    help="The fingerprint of the hub's certificate (sha256:…; `kvl hub serve` prints it).",
)
@click.option("--name", default=None, help="The node's name; also its host name.")
@click.option("--label", "labels", multiple=True, help="A node label, KEY=VALUE (repeatable).")
@click.option(
    "--no-hub",
    is_flag=True,
    help="A site without a hub: make a bootstrap admin key, print it once on stdout, and "
    "write only its hash.",
)
@click.option(
    "--admin-account",
    default=None,
    help=f"With --no-hub: the bootstrap key's account (default {BOOTSTRAP_ACCOUNT}).",
)
@click.option(
    "--address",
    "addresses",
    multiple=True,
    help="A static address with its prefix, 198.18.7.20/24 or 2001:db8::20/64 (repeatable); "
    "none: DHCP.",
)
@click.option("--gateway", "gateways", multiple=True, help="The default gateway, one per family.")
@click.option("--dns", multiple=True, help="A DNS server, in place of DHCP's (repeatable).")
@click.option("--https-proxy", default=None, help="The site's proxy: http://HOST:PORT.")
@click.option("--no-proxy", multiple=True, help="A host the proxy does not serve (repeatable).")
def configure_command(
    image_file: Path,
    *,
    provisioning: Path | None,
    hub_url: str | None,
    token: str | None,
    fingerprint: str | None,
    name: str | None,
    labels: tuple[str, ...],
    no_hub: bool,
    admin_account: str | None,
    addresses: tuple[str, ...],
    gateways: tuple[str, ...],
    dns: tuple[str, ...],
    https_proxy: str | None,
    no_proxy: tuple[str, ...],
) -> None:
    """Write the provisioning file (kovenlab.json) into IMAGE, without mounting it: on first
    boot the appliance enrolls with the hub it names, or (--no-hub) takes the bootstrap
    admin key printed here, once."""
    hub_flags = {"--hub": hub_url, "--token": token, "--fingerprint": fingerprint}
    network_flags: dict[str, object] = {
        "--address": addresses, "--gateway": gateways, "--dns": dns,
        "--https-proxy": https_proxy, "--no-proxy": no_proxy,
    }  # fmt: skip
    plaintext: str | None = None
    if provisioning is not None:
        others = {**hub_flags, "--name": name, "--label": labels, "--no-hub": no_hub}
        _alone(
            "--provisioning comes alone, without",
            {**others, "--admin-account": admin_account, **network_flags},
        )
        document = _from_file(provisioning)
    elif no_hub:
        _alone("--no-hub names no hub: leave out", {**hub_flags, "--label": labels})
        if not name:
            raise click.UsageError("missing --name")
        try:
            document, plaintext = provisioning_without_hub(name, admin_account or BOOTSTRAP_ACCOUNT)
        except ValueError as err:
            raise click.UsageError(str(err)) from err
    else:
        _alone(
            "without --no-hub, there is no bootstrap key: leave out",
            {"--admin-account": admin_account},
        )
        if not (hub_url and token and fingerprint and name):
            given = {**hub_flags, "--name": name}
            missing = ", ".join(flag for flag, value in given.items() if not value)
            raise click.UsageError(
                f"missing {missing} (or give a whole file with --provisioning, or make a "
                "site without a hub with --no-hub)"
            )
        try:
            document = provisioning_from(hub_url, token, fingerprint, name, _labels(labels))
        except ValueError as err:
            raise click.UsageError(str(err)) from err
    document = with_network(document, network_flags)
    try:
        part = configure(image_file, document)
    except ImageError as err:
        raise click.ClickException(str(err)) from err
    hub, key = document.hub, document.bootstrap_key
    then = f"hub {hub.url}" if hub is not None else "no hub"
    if key is not None:
        then += f", bootstrap admin key {key.prefix} of account {key.account}"
    click.echo(
        f"{image_file}: {PROVISIONING_FILE} written to the EFI system partition "
        f"(partition {part.number}): node {document.name}, {then}",
        err=True,
    )
    if plaintext is not None:
        # Only once the image holds its hash: a key printed for a file never written
        # would open nothing. It is in no file: this is the one chance to keep it.
        click.echo("the bootstrap admin key, shown once (keep it: it is in no file):", err=True)
        click.echo(plaintext)


def _alone(why: str, flags: dict[str, object]) -> None:
    """A usage error naming the flags given (a value, a flag set, a label) that `why` says
    do not belong."""
    mixed = [flag for flag, value in flags.items() if value not in (None, False, ())]
    if mixed:
        raise click.UsageError(f"{why} {', '.join(mixed)}")


def _from_file(path: Path) -> Provisioning:
    """A whole provisioning file, checked as the parts are (a hub's URL and token)."""
    try:
        document = Provisioning.load(path)
        if (hub := document.hub) is not None:
            check_hub_url(hub.url)
            check_token(hub.token)
    except (ProvisioningError, ValueError) as err:
        raise click.BadParameter(str(err), param_hint="--provisioning") from err
    return document


@image.command("show")
@click.argument("image_file", metavar="IMAGE", type=_IMAGE)
@click.option("--json", "as_json", is_flag=True, help="Print it as JSON (the token shortened).")
def show_command(image_file: Path, as_json: bool) -> None:
    """Show the partitions of IMAGE and the provisioning file in it (its token shortened)."""
    try:
        parts = partitions(image_file)
        document = read_provisioning(image_file)
    except ImageError as err:
        raise click.ClickException(str(err)) from err
    shown = None
    if document is not None:
        shown = document.model_dump(exclude_none=True)
        if document.token is not None:
            shown["token"] = document.token[:13] + "…"
        if document.bootstrap_key is not None:
            # A hash is no secret to fear, but only the prefix says which key it is.
            shown["bootstrap_key"] = (
                f"{document.bootstrap_key.prefix} (account {document.bootstrap_key.account})"
            )
    if as_json:
        import json  # noqa: PLC0415

        table = [
            {"number": p.number, "name": p.name, "offset": p.offset, "size": p.size} for p in parts
        ]
        click.echo(json.dumps({"partitions": table, "provisioning": shown}))
        return
    for p in parts:
        click.echo(f"{p.number}  {p.name:<12} {p.size / 2**20:10.0f} MiB at {p.offset}")
    if shown is None:
        click.echo(f"no {PROVISIONING_FILE}: the appliance serves its LAN alone")
    else:
        for key, value in shown.items():
            click.echo(f"{key:<16} {value}")
