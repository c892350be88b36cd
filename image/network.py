"""The node's network agent, as root: the site's settings (`shared/site_network.py`) made
into systemd-networkd's files, and a change from the admin API tried before it is kept.

- `boot` (kovenlab-network.service, before systemd-networkd): the setting in force written
  to /run/systemd/network, which networkd reads first; at the first boot, or when a new
  provisioning file is on the EFI system partition, its `network` becomes the setting in
  force. A trial the node restarted in is rolled back: the change had not been confirmed.
- `apply` (kovenlab-network-apply.service, started by kovenlab-network.path when the
  appliance leaves a request): the new setting is written and networkd reloads it; it is
  kept only if the operator confirms it over the new setting within the request's bound
  (`POST /v1/admin/network/confirm`), else the last working one comes back.

The site's proxy is the appliance's (its calls out): the agent writes it, with the rest, to
`proxy.env`, which kovenlab-appliance.service reads, and restarts the appliance when a
confirmed change moved it. Everything the appliance leaves is read as untrusted: bounded in
size, checked by the same model, and a wrong request is refused with the reason in the
state, changing nothing.

It runs with the appliance's own Python (`/opt/kovenlab/venv`), as firstboot.py does.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import ValidationError

from shared.provisioning import Provisioning, ProvisioningError
from shared.site_network import (
    REQUEST_MAX_BYTES,
    WIRED,
    Attempt,
    Paths,
    Request,
    SiteNetwork,
    State,
)

if TYPE_CHECKING:
    from collections.abc import Callable

log = logging.getLogger("kovenlab-network")

NETWORK_FILE = "10-kovenlab-site.network"  # before the image's 80-kovenlab-wired.network
PROVISIONING_FILE = "kovenlab.json"
POLL_S = 0.5


def _reload() -> None:
    subprocess.run(["/usr/bin/networkctl", "reload"], check=True, capture_output=True, timeout=60)


def _restart_appliance() -> None:
    subprocess.run(
        ["/usr/bin/systemctl", "try-restart", "--no-block", "kovenlab-appliance.service"],
        check=True,
        capture_output=True,
        timeout=60,
    )


def _now() -> datetime:
    return datetime.now(UTC)


@dataclass(frozen=True)
class Layout:
    """Where the image keeps things, and how the agent acts (the tests point it at temporary
    folders and record the reloads)."""

    esp: Path = Path("/boot/efi")
    data: Path = Path("/var/lib/kovenlab")
    run: Path = Path("/run/systemd/network")
    reload: Callable[[], None] = _reload
    restart_appliance: Callable[[], None] = _restart_appliance
    clock: Callable[[], datetime] = _now
    sleep: Callable[[float], None] = field(default=time.sleep)

    @property
    def paths(self) -> Paths:
        return Paths(appliance=self.data / "appliance" / "network", agent=self.data / "network")

    @property
    def network_file(self) -> Path:
        return self.run / NETWORK_FILE

    @property
    def proxy_env(self) -> Path:
        """Read by kovenlab-appliance.service after appliance.env (`EnvironmentFile=`)."""
        return self.paths.agent / "proxy.env"


def render(network: SiteNetwork) -> str | None:
    """The networkd file for `network`; None where the image's own (DHCP on every wired
    port) is the same thing."""
    if not network.addresses and not network.dns and network.interfaces == WIRED:
        return None
    families = {a.version for a in network.addresses}
    dhcp4, dhcp6 = 4 not in families, 6 not in families
    dhcp = {(True, True): "yes", (True, False): "ipv4", (False, True): "ipv6"}.get(
        (dhcp4, dhcp6), "no"
    )
    lines = [
        "# The site's network (kovenlab-network, from the provisioning file or the admin",
        "# API); written again at every boot.",
        "[Match]",
        f"Name={network.interfaces}",
        "",
        "[Network]",
        f"DHCP={dhcp}",
        "LinkLocalAddressing=ipv6",
        f"IPv6AcceptRA={'yes' if dhcp6 else 'no'}",
        *(f"Address={a}" for a in network.addresses),
        *(f"Gateway={g}" for g in network.gateways),
        *(f"DNS={d}" for d in network.dns),
    ]
    if network.dns:  # the site's servers, not the ones DHCP or a router advertises
        lines += ["", "[DHCPv4]", "UseDNS=no", "", "[DHCPv6]", "UseDNS=no"]
        lines += ["", "[IPv6AcceptRA]", "UseDNS=no"]
    return "\n".join(lines) + "\n"


def proxy_environment(network: SiteNetwork) -> str:
    """The appliance's proxy settings (`fleet.https_proxy`, `fleet.no_proxy`), for systemd's
    EnvironmentFile: single-quoted, which systemd takes as it is."""
    if network.https_proxy is None:
        return ""
    return (
        f"KVL_FLEET__HTTPS_PROXY='{network.https_proxy}'\n"
        f"KVL_FLEET__NO_PROXY='{json.dumps(network.no_proxy)}'\n"
    )


def _write(path: Path, text: str, mode: int = 0o644) -> None:
    """Replace a small file whole, so a power cut leaves the old one or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    with partial.open("w") as out:
        out.write(text)
        out.flush()
        os.fsync(out.fileno())
    partial.chmod(mode)
    partial.replace(path)


def _install(layout: Layout, network: SiteNetwork) -> None:
    """`network`'s files in place (networkd's, the appliance's proxy), not yet reloaded."""
    text = render(network)
    if text is None:
        layout.network_file.unlink(missing_ok=True)
    else:
        _write(layout.network_file, text)
    _write(layout.proxy_env, proxy_environment(network))


def _provisioned(layout: Layout) -> tuple[SiteNetwork, str] | None:
    """The network of the provisioning file on the EFI system partition, with the file's
    digest; None when there is none, or it is not valid (the first boot says why)."""
    source = layout.esp / PROVISIONING_FILE
    try:
        if source.stat().st_size > REQUEST_MAX_BYTES:
            return None
        data = source.read_bytes()
        document = Provisioning.load(source)
    except (OSError, ProvisioningError):
        return None
    return document.network or SiteNetwork(), hashlib.sha256(data).hexdigest()


def boot(layout: Layout) -> State:
    """The setting in force, in networkd's folder before it starts; the state written."""
    paths = layout.paths
    state = State.read(paths.state) or State()
    trial = _read_trial(paths)
    if trial is not None:
        # The node restarted while a change was on trial: it was never confirmed.
        state.last = trial.model_copy(
            update={
                "outcome": "rolled_back",
                "ended_at": layout.clock(),
                "reason": "the node restarted before the change was confirmed",
            }
        )
        paths.trial.unlink(missing_ok=True)
    provisioned = _provisioned(layout)
    if provisioned is not None and provisioned[1] != state.provisioned:
        state.applied, state.provisioned = provisioned
        state.source = f"the provisioning file ({PROVISIONING_FILE}, sha256 {provisioned[1][:12]})"
    _install(layout, state.applied)
    _write(paths.state, state.text())
    return state


def _read_trial(paths: Paths) -> Attempt | None:
    try:
        return Attempt.model_validate_json(paths.trial.read_bytes())
    except FileNotFoundError:
        return None
    except ValidationError:  # pragma: no cover - only the agent writes it, whole
        return None


def _take_request(paths: Paths) -> Request | str:
    """The appliance's request, removed; or why it cannot be taken."""
    path = paths.request
    try:
        # The appliance's folder: a link is not followed, and only a plain file is read (a
        # pipe would hold the agent).
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return "no request"
    except OSError as err:
        path.unlink(missing_ok=True)
        return f"the request cannot be read: {err.strerror}"
    try:
        with os.fdopen(fd, "rb") as file:
            if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
                return "the request is not a plain file"
            data = file.read(REQUEST_MAX_BYTES + 1)
    finally:
        path.unlink(missing_ok=True)
    if len(data) > REQUEST_MAX_BYTES:
        return f"the request is larger than {REQUEST_MAX_BYTES} bytes"
    try:
        return Request.model_validate_json(data)
    except ValidationError as err:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '(request)'}: {e['msg']}" for e in err.errors()
        )
        return f"not a network request: {problems}"[:2000]


def apply(layout: Layout) -> State:
    """Try the appliance's request: in force until its bound, kept if confirmed."""
    paths = layout.paths
    state = State.read(paths.state) or State()
    started = layout.clock()
    request = _take_request(paths)
    if isinstance(request, str):
        if request != "no request":
            state.last = Attempt(
                id="refused", outcome="refused", started_at=started, ended_at=started,
                reason=request,
            )  # fmt: skip
            _write(paths.state, state.text())
        return state
    deadline = started + timedelta(seconds=request.confirm_within_s)
    attempt = Attempt(
        id=request.id,
        outcome="trying",
        network=request.network,
        started_at=started,
        deadline=deadline,
        asked_by=request.asked_by,
    )
    # The trial first: a restart from here on rolls back at boot.
    _write(paths.trial, attempt.model_dump_json())
    state.last = attempt
    _write(paths.state, state.text())
    previous = state.applied
    confirmation = paths.confirmation(request.id)
    confirmation.unlink(missing_ok=True)
    try:
        _install(layout, request.network)
        layout.reload()
    except (OSError, subprocess.SubprocessError) as err:
        return _roll_back(layout, state, previous, attempt, f"networkd refused it: {err}")
    log.info("trying network %s until %s", request.id, deadline.isoformat())
    while layout.clock() < deadline:
        if confirmation.exists():
            confirmation.unlink(missing_ok=True)
            moved = (previous.https_proxy, previous.no_proxy) != (
                request.network.https_proxy,
                request.network.no_proxy,
            )
            state.applied = request.network
            state.source = f"the admin API (change {request.id})"
            state.last = attempt.model_copy(
                update={"outcome": "applied", "ended_at": layout.clock()}
            )
            _write(paths.state, state.text())
            paths.trial.unlink(missing_ok=True)
            log.info("network %s confirmed: kept", request.id)
            if moved:
                layout.restart_appliance()
            return state
        layout.sleep(POLL_S)
    bound = request.confirm_within_s
    return _roll_back(
        layout, state, previous, attempt, f"not confirmed within {bound} s over the new setting"
    )


def _roll_back(
    layout: Layout, state: State, previous: SiteNetwork, attempt: Attempt, reason: str
) -> State:
    log.warning("network %s rolled back: %s", attempt.id, reason)
    _install(layout, previous)
    try:
        layout.reload()
    except (OSError, subprocess.SubprocessError) as err:  # the boot will install it again
        log.error("reloading the previous network failed: %s", err)  # noqa: TRY400
    state.applied = previous
    state.last = attempt.model_copy(
        update={"outcome": "rolled_back", "ended_at": layout.clock(), "reason": reason}
    )
    _write(layout.paths.state, state.text())
    layout.paths.trial.unlink(missing_ok=True)
    return state


def main(argv: list[str] | None = None, layout: Layout | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="kovenlab-network: %(message)s")
    args = sys.argv[1:] if argv is None else argv
    layout = layout or Layout()
    if args == ["boot"]:
        state = boot(layout)
        log.info("in force: %s (from %s)", _summary(state.applied), state.source)
        return 0
    if args == ["apply"]:
        apply(layout)
        return 0
    log.error("usage: network.py boot|apply")
    return 2


def _summary(network: SiteNetwork) -> str:
    if not network.addresses:
        return f"DHCP on {network.interfaces}"
    return ", ".join(str(a) for a in network.addresses) + f" on {network.interfaces}"


if __name__ == "__main__":
    sys.exit(main())
