"""A throwaway PostgreSQL server for tests and benchmarks: initdb + pg_ctl in a temporary directory,
listening on 127.0.0.1 on a free port, stopped (and its data removed) at the end.

PostgreSQL refuses to run as root, so under root the data directory belongs to the `postgres`
user (Debian's package creates it) and the server binaries run through `runuser`.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from helpers import free_port

USER = "spectune"
DB = "spectune"
PASSWORD = "s3cret-test-pw"  # a test server's password; given to clients only through PGPASSWORD


def bin_dir() -> Path | None:
    """Directory holding initdb/pg_ctl (Debian: /usr/lib/postgresql/<major>/bin), None if not installed."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"), key=lambda p: int(p.split("/")[4]))
    if found:
        return Path(found[-1]).parent
    exe = shutil.which("pg_ctl")
    return Path(exe).resolve().parent if exe else None


@dataclass(frozen=True)
class Server:
    port: int
    data: Path

    @property
    def url(self) -> str:
        """SQLAlchemy URL without the password (clients read PGPASSWORD)."""
        return f"postgresql://{USER}@127.0.0.1:{self.port}/{DB}"

    @property
    def log(self) -> Path:
        return self.data.parent / "log"

    @property
    def env(self) -> dict[str, str]:
        return {"PGPASSWORD": PASSWORD}


def _runner() -> tuple[list[str], int | None, int | None]:
    """Command prefix to run the server binaries, and the uid/gid owning its files."""
    if os.geteuid() != 0:
        return [], None, None
    pw = pwd.getpwnam("postgres")
    return ["runuser", "-u", "postgres", "--"], pw.pw_uid, pw.pw_gid


@contextmanager
def postgres_server(settings: dict[str, str] | None = None) -> Iterator[Server]:
    """Start a fresh server (user `spectune` with a password, database `spectune`); stop it on exit.
    `settings`: extra server parameters, e.g. {"log_statement": "all"} (the log is `Server.log`)."""
    bins = bin_dir()
    if bins is None:
        raise RuntimeError("PostgreSQL is not installed: `make postgres` (part of `make test`) installs "
                           "Debian's postgresql package")
    prefix, uid, gid = _runner()
    root = Path(tempfile.mkdtemp(prefix="spectune-pg-"))
    data, pwfile = root / "data", root / "pw"
    pwfile.write_text(PASSWORD + "\n")
    if uid is not None:
        os.chown(root, uid, gid)
        os.chown(pwfile, uid, gid)
    os.chmod(root, 0o700)
    port = free_port()
    run = lambda *cmd: subprocess.run([*prefix, *cmd], check=True, capture_output=True, text=True)  # noqa: E731
    try:
        run(str(bins / "initdb"), "-D", str(data), "-U", USER, "--pwfile", str(pwfile), "-A", "scram-sha-256",
            "-E", "UTF8", "--no-sync")
        # fsync off: a test database need not survive a power cut, and it makes every commit cheap.
        opts = f"-h 127.0.0.1 -p {port} -k {root} -c fsync=off -c max_connections=100"
        opts += "".join(f" -c {k}={v}" for k, v in (settings or {}).items())
        run(str(bins / "pg_ctl"), "-D", str(data), "-o", opts, "-l", str(root / "log"), "-w", "-t", "60", "start")
        env = {**os.environ, "PGPASSWORD": PASSWORD}
        subprocess.run([str(bins / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", USER, DB],
                       check=True, capture_output=True, env=env)
        yield Server(port=port, data=data)
    finally:
        if (data / "postmaster.pid").exists():
            subprocess.run([*prefix, str(bins / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop"],
                           capture_output=True)
        shutil.rmtree(root, ignore_errors=True)
