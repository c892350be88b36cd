"""A throwaway PostgreSQL cluster from Debian's server binaries, for the tests and the
benchmarks: `initdb` in a temporary directory, the server listening only on a unix socket
in that directory (no TCP), trust authentication, a database per user of it.

`initdb` refuses to run as root, so as root the cluster belongs to the `postgres` user and
its programs run through `runuser`; as anyone else, as that user.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterator

# Where Debian's postgresql-NN packages put the server programs (not on PATH).
DEBIAN_SERVERS = Path("/usr/lib/postgresql")
MISSING = (
    "PostgreSQL's server is not installed (initdb and pg_ctl from Debian's `postgresql` "
    "package); run `just setup-system`"
)


def server_bin() -> Path | None:
    """The newest installed server's bin directory, or None."""
    found = sorted(
        (p for p in DEBIAN_SERVERS.glob("*/bin") if (p / "initdb").exists()),
        key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0,
    )
    if found:
        return found[-1]
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


class Cluster:
    """A running cluster; `url(database)` for each database made with `create()`."""

    def __init__(self, bin_dir: Path, root: Path, *, durable: bool) -> None:
        self.bin = bin_dir
        self.root = root
        self.data = root / "data"
        self._as_postgres = os.geteuid() == 0
        self._durable = durable

    def _run(self, *args: str | Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        command = [str(a) for a in args]
        if self._as_postgres:
            command = ["runuser", "-u", "postgres", "--", *command]
        return subprocess.run(
            command, capture_output=True, text=True, check=True, timeout=timeout, cwd=self.root
        )

    def start(self) -> None:
        if self._as_postgres:
            user = pwd.getpwnam("postgres")
            os.chown(self.root, user.pw_uid, user.pw_gid)
        self.root.chmod(0o755)  # the tests' user reaches the socket
        self._run(
            self.bin / "initdb", "-D", self.data, "-A", "trust", "-U", "postgres",
            "-E", "UTF8", "--locale", "C", "--no-sync",
        )  # fmt: skip
        options = [
            "listen_addresses=''",
            f"unix_socket_directories='{self.root}'",
            "max_connections=200",
        ]
        if not self._durable:
            # A test cluster: speed over surviving a power cut.
            options += ["fsync=off", "synchronous_commit=off", "full_page_writes=off"]
        with (self.data / "postgresql.conf").open("a") as conf:
            conf.write("\n".join(options) + "\n")
        self._run(
            self.bin / "pg_ctl", "-D", self.data, "-l", self.root / "server.log",
            "-w", "-t", "60", "start",
        )  # fmt: skip

    def stop(self) -> None:
        with contextlib.suppress(subprocess.SubprocessError):
            self._run(self.bin / "pg_ctl", "-D", self.data, "-m", "immediate", "-w", "stop")

    def url(self, database: str) -> str:
        return f"postgresql://postgres@/{database}?host={self.root}"

    def create(self, name: str | None = None) -> str:
        """A new, empty database; its URL."""
        import psycopg  # noqa: PLC0415

        name = name or f"kvl_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(self.url("postgres"), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}" TEMPLATE template0')
        return self.url(name)

    def log(self) -> str:
        path = self.root / "server.log"
        return path.read_text() if path.exists() else ""


@contextlib.contextmanager
def cluster(*, durable: bool = False) -> Iterator[Cluster]:
    """A started cluster, stopped and removed after. RuntimeError(MISSING) without the
    server binaries."""
    bin_dir = server_bin()
    if bin_dir is None:
        raise RuntimeError(MISSING)
    # Not under pytest's tmp_path: its folders are 0700 and the postgres user must enter.
    root = Path(tempfile.mkdtemp(prefix="kvl-pg-"))
    running = Cluster(bin_dir, root, durable=durable)
    try:
        running.start()
        yield running
    finally:
        running.stop()
        # The server's files belong to `postgres`; root removes them all the same.
        for _ in range(3):
            try:
                shutil.rmtree(root)
                break
            except OSError:
                time.sleep(0.2)
