"""A real PostgreSQL server for the tests (Debian's `postgresql` package): initdb + pg_ctl in a
temporary folder on a free loopback port, trust authentication. Root may not run postgres, so as
root the server runs as the `postgres` user the package creates."""
from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from testing.ports import free_port


def _bin(name: str) -> str:
    found = shutil.which(name) or next(iter(sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)),
                                       None)
    if not found:
        raise RuntimeError(f"{name} not found: install Debian's postgresql package (make syspkgs)")
    return found


class PgServer:
    """Lives in its own folder under the system temp dir: pytest's tmp_path is private to root,
    and the postgres user must reach the data directory."""

    def __init__(self):
        self.root = Path(tempfile.mkdtemp(prefix="keel-pg-"))
        self.data = self.root / "data"
        self.port = free_port()
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"
        self._as_root = os.geteuid() == 0

    def _run(self, argv: list[str], **kw) -> subprocess.CompletedProcess:
        if self._as_root:
            argv = ["runuser", "-u", "postgres", "--"] + argv
        return subprocess.run(argv, check=True, capture_output=True, **kw)

    def init(self) -> "PgServer":
        if self._as_root:
            shutil.chown(self.root, "postgres", "postgres")
            os.chmod(self.root, 0o700)
        self._run([_bin("initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8"])
        return self

    def start(self) -> None:
        opts = f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.root} -c fsync=off"
        self._run([_bin("pg_ctl"), "-D", str(self.data), "-l", str(self.root / "log"), "-o", opts, "-w", "start"])

    def kill(self) -> None:
        """SIGKILL the postmaster (a crash, not a shutdown); its backends exit with it."""
        pid = int((self.data / "postmaster.pid").read_text().split()[0])
        os.kill(pid, 9)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        # backends notice the dead postmaster and exit; wait until the port is free for a restart
        time.sleep(0.5)

    def stop(self) -> None:
        try:
            self._run([_bin("pg_ctl"), "-D", str(self.data), "-m", "immediate", "stop"])
        except subprocess.CalledProcessError:
            pass  # already dead (a test killed it)
        shutil.rmtree(self.root, ignore_errors=True)
