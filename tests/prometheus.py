"""A real Prometheus (and promtool) reading a hub's metrics, its alert windows scaled so
that a test can wait for them."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from typing import TYPE_CHECKING

import yaml

from tests.conftest import free_port

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence
    from pathlib import Path


def promtool() -> str:
    found = shutil.which("promtool")
    assert found, "promtool is missing: run `just setup-system` (Debian's prometheus package)"
    return found


SCALE = 1 / 60  # 1h -> 60 s, 5m -> 5 s
WINDOW = "1m/5s"  # the first page pair, scaled


@contextlib.contextmanager
def prometheus(
    tmp_path: Path, hub_port: int, token: str, rules: str, appliances: Sequence[int] = ()
) -> Iterator[str]:
    """Prometheus on 127.0.0.1 scraping the hub (and `appliances`, by port: their
    /metrics) every second, evaluating `rules` every second; its base URL. Stopped, with
    its process group, on the way out."""
    (tmp_path / "kvl-hub.rules.yml").write_text(rules)
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(tmp_path / "kvl-hub.rules.yml")],
        "scrape_configs": [
            {
                "job_name": "kvl-hub",
                "metrics_path": "/metrics",
                "authorization": {"type": "Bearer", "credentials": token},
                "static_configs": [{"targets": [f"127.0.0.1:{hub_port}"]}],
            },
            *(
                [
                    {
                        "job_name": "kvl-appliance",
                        "metrics_path": "/metrics",
                        "static_configs": [{"targets": [f"127.0.0.1:{p}" for p in appliances]}],
                    }
                ]
                if appliances
                else []
            ),
        ],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = (tmp_path / "prometheus.log").open("wb")
    process = subprocess.Popen(
        [
            prometheus_binary(),
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group, stopped whole
    )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(30)
        log.close()


def prometheus_binary() -> str:
    found = shutil.which("prometheus")
    assert found, "prometheus is missing: run `just setup-system` (Debian's prometheus package)"
    return found
