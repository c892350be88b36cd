"""The image's network agent (image/network.py) on temporary folders: the provisioning file's
network written for systemd-networkd at boot, a change from the appliance tried and kept
once confirmed, rolled back when it is not (or the node restarts meanwhile), and whatever
the appliance leaves that is not a request refused with nothing changed. The QEMU test
(tests/image/test_hubless_image.py) has networkd take these files."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from image.network import NETWORK_FILE, Layout, apply, boot, main, render
from shared.provisioning import BootstrapKey, Provisioning
from shared.site_network import Request, SiteNetwork, State

STATIC = {
    "addresses": ["198.18.7.20/24", "2001:db8:7::20/64"],
    "gateways": ["198.18.7.2", "2001:db8:7::1"],
    "dns": ["198.18.7.3"],
}


@dataclass
class Clock:
    """The agent's time, moved on by its own sleeps; `on_sleep` runs at each."""

    now: datetime = field(default_factory=lambda: datetime(2026, 12, 7, 9, 0, tzinfo=UTC))
    reloads: int = 0
    restarts: int = 0
    on_sleep: list[object] = field(default_factory=list)

    def clock(self) -> datetime:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)
        for action in self.on_sleep:
            action()  # type: ignore[operator]

    def reload(self) -> None:
        self.reloads += 1

    def restart(self) -> None:
        self.restarts += 1


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def layout(tmp_path: Path, clock: Clock) -> Layout:
    made = Layout(
        esp=tmp_path / "esp",
        data=tmp_path / "data",
        run=tmp_path / "run",
        reload=clock.reload,
        restart_appliance=clock.restart,
        clock=clock.clock,
        sleep=clock.sleep,
    )
    made.esp.mkdir()
    made.paths.appliance.mkdir(parents=True)
    return made


def provision(layout: Layout, network: dict[str, object] | None) -> None:
    key, _ = BootstrapKey.generate()
    document = Provisioning.model_validate(
        {"name": "lab-server", "bootstrap_key": key.model_dump(), "network": network}
    )
    (layout.esp / "kovenlab.json").write_text(document.text())


def ask(layout: Layout, network: dict[str, object], within_s: int = 60) -> Request:
    request = Request(
        id="net_1", network=SiteNetwork.model_validate(network), confirm_within_s=within_s
    )
    layout.paths.request.write_text(request.model_dump_json())
    return request


def test_a_static_address_renders_for_networkd_and_dhcp_needs_no_file() -> None:
    text = render(SiteNetwork.model_validate(STATIC))
    assert text is not None
    lines = text.splitlines()
    assert "Name=en* eth*" in lines
    assert "DHCP=no" in lines  # both families static
    assert "IPv6AcceptRA=no" in lines
    assert "Address=198.18.7.20/24" in lines
    assert "Address=2001:db8:7::20/64" in lines
    assert "Gateway=198.18.7.2" in lines
    assert "DNS=198.18.7.3" in lines
    assert lines.count("UseDNS=no") == 3  # the site's DNS, not DHCP's or a router's
    v4 = render(SiteNetwork.model_validate({"addresses": ["198.18.7.20/24"]}))
    assert v4 is not None
    assert "DHCP=ipv6" in v4.splitlines()
    assert "IPv6AcceptRA=yes" in v4.splitlines()
    assert render(SiteNetwork()) is None  # the image's own file: DHCP on every wired port
    assert render(SiteNetwork(https_proxy="http://198.18.7.2:3128")) is None


@pytest.mark.parametrize(
    ("network", "why"),
    [
        ({"addresses": ["198.18.7.0/24"]}, "network's own"),
        ({"addresses": ["127.0.0.2/8"]}, "cannot be a port's address"),
        ({"addresses": ["198.18.7.20/24", "198.18.7.20/25"]}, "given twice"),
        ({"addresses": ["198.18.7.20/24"], "gateways": ["198.18.9.1"]}, "none of the static"),
        ({"gateways": ["198.18.9.1"]}, "none of the static"),
        (
            {"addresses": ["198.18.7.20/24"], "gateways": ["198.18.7.1", "198.18.7.2"]},
            "one gateway",
        ),
        ({"addresses": ["198.18.7.300/24"]}, "valid"),
        ({"interfaces": "en*\nDHCP=yes"}, "pattern"),
        ({"dns": ["198.18.7.3"] * 5}, "at most 4"),
    ],
)
def test_a_wrong_network_is_refused_by_its_model(network: dict[str, object], why: str) -> None:
    with pytest.raises(ValueError, match=why):
        SiteNetwork.model_validate(network)


def test_the_first_boot_takes_the_provisioning_files_network(layout: Layout) -> None:
    provision(layout, {**STATIC, "https_proxy": "http://198.18.7.2:3128", "no_proxy": [".lan"]})

    state = boot(layout)

    assert [str(a) for a in state.applied.addresses] == STATIC["addresses"]
    assert "provisioning file" in state.source
    assert "Address=198.18.7.20/24" in (layout.run / NETWORK_FILE).read_text()
    assert layout.proxy_env.read_text() == (
        "KVL_FLEET__HTTPS_PROXY='http://198.18.7.2:3128'\nKVL_FLEET__NO_PROXY='[\".lan\"]'\n"
    )
    assert State.read(layout.paths.state) == state
    # The next boot writes the same again (the run folder is empty at every boot).
    (layout.run / NETWORK_FILE).unlink()
    assert boot(layout).applied == state.applied
    assert (layout.run / NETWORK_FILE).is_file()


def test_a_change_confirmed_in_time_is_kept(layout: Layout, clock: Clock) -> None:
    provision(layout, None)
    assert boot(layout).applied == SiteNetwork()
    assert not (layout.run / NETWORK_FILE).exists()
    request = ask(layout, {**STATIC, "https_proxy": "http://198.18.7.2:3128"})

    def confirm() -> None:
        # Over the new setting: the agent has it in networkd's folder, reloaded, on trial.
        assert clock.reloads == 1
        assert "Address=198.18.7.20/24" in (layout.run / NETWORK_FILE).read_text()
        seen = State.read(layout.paths.state)
        assert seen is not None
        assert seen.last is not None
        assert seen.last.outcome == "trying"
        layout.paths.confirmation(request.id).touch()

    clock.on_sleep.append(confirm)
    state = apply(layout)

    assert state.last is not None
    assert state.last.outcome == "applied", state.last
    assert state.applied == request.network
    assert "admin API" in state.source
    assert not layout.paths.request.exists()
    assert not layout.paths.trial.exists()
    assert not layout.paths.confirmation(request.id).exists()
    assert clock.restarts == 1  # the proxy moved: the appliance restarts to take it
    # A later boot keeps the confirmed change, not the provisioning file's network.
    assert boot(layout).applied == request.network


def test_a_change_not_confirmed_in_time_is_rolled_back(layout: Layout, clock: Clock) -> None:
    provision(layout, {"addresses": ["198.18.7.20/24"], "gateways": ["198.18.7.2"]})
    before = boot(layout).applied
    started = clock.now
    ask(layout, {"addresses": ["198.18.9.20/24"], "gateways": ["198.18.9.1"]}, within_s=30)

    state = apply(layout)

    assert state.last is not None
    assert state.last.outcome == "rolled_back"
    assert "not confirmed within 30 s" in (state.last.reason or "")
    assert clock.now - started >= timedelta(seconds=30)
    assert state.applied == before
    assert "Address=198.18.7.20/24" in (layout.run / NETWORK_FILE).read_text()
    assert clock.reloads == 2  # the change, then the way back
    assert clock.restarts == 0
    assert not layout.paths.trial.exists()


def test_a_restart_during_a_trial_rolls_it_back_at_boot(layout: Layout, clock: Clock) -> None:
    provision(layout, {"addresses": ["198.18.7.20/24"]})
    before = boot(layout).applied
    ask(layout, {"addresses": ["198.18.9.20/24"]})

    def power_cut() -> None:
        raise SystemExit  # the node goes down mid-trial

    clock.on_sleep.append(power_cut)
    with pytest.raises(SystemExit):
        apply(layout)
    assert layout.paths.trial.exists()

    state = boot(layout)
    assert state.applied == before
    assert state.last is not None
    assert state.last.outcome == "rolled_back"
    assert "restarted" in (state.last.reason or "")
    assert "Address=198.18.7.20/24" in (layout.run / NETWORK_FILE).read_text()


def test_a_new_provisioning_file_replaces_the_network(layout: Layout, clock: Clock) -> None:
    provision(layout, {"addresses": ["198.18.7.20/24"]})
    boot(layout)
    ask(layout, {"addresses": ["198.18.7.30/24"]})
    clock.on_sleep.append(lambda: layout.paths.confirmation("net_1").touch())
    assert apply(layout).applied.addresses[0].ip.exploded == "198.18.7.30"
    assert boot(layout).applied.addresses[0].ip.exploded == "198.18.7.30"  # same file: kept
    provision(layout, {"addresses": ["198.18.7.40/24"]})  # an operator's new file
    assert boot(layout).applied.addresses[0].ip.exploded == "198.18.7.40"


def test_what_is_not_a_request_is_refused_with_nothing_changed(
    layout: Layout, clock: Clock, tmp_path: Path
) -> None:
    provision(layout, {"addresses": ["198.18.7.20/24"]})
    before = boot(layout)
    secret = tmp_path / "secret"
    secret.write_text('{"id": "x"}')
    request = layout.paths.request
    hostile: list[tuple[object, str]] = [
        (lambda: request.symlink_to(secret), "cannot be read"),
        (lambda: os.mkfifo(request), "not a plain file"),
        (lambda: request.write_bytes(b"{" * (65 * 1024)), "larger than"),
        (lambda: request.write_text("not json"), "not a network request"),
        (
            lambda: request.write_text('{"id": "n", "network": {"addresses": ["1.2.3.0/24"]}}'),
            "network's own",
        ),
        (
            lambda: request.write_text('{"id": "n", "network": {}, "confirm_within_s": 1}'),
            "confirm_within_s",
        ),
    ]
    for make, why in hostile:
        make()  # type: ignore[operator]
        state = apply(layout)
        assert state.last is not None
        assert state.last.outcome == "refused", why
        assert why in (state.last.reason or ""), state.last.reason
        assert state.applied == before.applied
        assert not request.exists()
        assert not request.is_symlink()
    assert clock.reloads == 0
    assert secret.read_text() == '{"id": "x"}'


def test_the_command_line(layout: Layout, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "kovenlab-network")
    provision(layout, None)
    assert main(["boot"], layout) == 0
    assert "DHCP on en* eth*" in caplog.text
    assert main(["apply"], layout) == 0  # nothing asked: nothing done
    assert main(["nonsense"], replace(layout)) == 2
