"""Where a study lives: storage URLs, opening them, credentials and masking, the shared-storage
rule and the study-wide lock.

`search.storage`: None is an SQLite file `study.db` in the run directory; any SQLAlchemy URL
(`postgresql://...`) is used as is; `journal:PATH` is a journal file (PATH relative to the run
directory unless absolute), the storage to share between processes on NFS; `env` takes the whole
URL from SPECTUNE_STORAGE_URL.

Credentials never pass through the command line or config.yaml (the schema rejects passwords in
`search.storage`): PostgreSQL reads PGPASSWORD (or ~/.pgpass), or `search.storage=env` takes the
URL from the environment. URLs are masked wherever they are printed or stored.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import optuna

from tuner.schema.config import SearchConfig, UserError, storage_password_error

STORAGE_ENV = "SPECTUNE_STORAGE_URL"
DB_FILE = "study.db"


def resolve_storage(value: str) -> str:
    """The storage URL a `search.storage` value stands for: `env` reads SPECTUNE_STORAGE_URL."""
    if value != "env":
        return value
    url = os.environ.get(STORAGE_ENV, "").strip()
    if not url:
        raise UserError(f"search.storage=env: the environment variable {STORAGE_ENV} is not set "
                        "(it holds the storage URL, e.g. from a Kubernetes Secret)")
    return url


def storage_url(search: SearchConfig, run_dir: Path) -> str:
    """The storage of a study as one resolved URL (recorded, masked, in best.yaml's provenance)."""
    if search.storage is None:
        return f"sqlite:///{(run_dir / DB_FILE).resolve()}"
    if search.storage.startswith("journal:"):
        path = Path(search.storage[len("journal:"):])
        return f"journal:{path if path.is_absolute() else (run_dir / path).resolve()}"
    return resolve_storage(search.storage)


def reject_password(value: str) -> None:
    """UserError when a storage given on the command line holds a password (the schema's rule)."""
    error = storage_password_error(value)
    if error:
        raise UserError(error)


def mask_url(url: str) -> str:
    """The URL with its password replaced by ***, for logs, best.yaml and reports."""
    if "://" not in url:
        return url
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # not an SQLAlchemy URL: mask everything between '//' and '@'
        head, _, rest = url.partition("://")
        return f"{head}://***@{rest.rpartition('@')[2]}" if "@" in rest else url


JOURNAL_LOCK_GRACE_S = 3  # Optuna's smallest stale-lock period without a warning


def open_storage(url: str) -> optuna.storages.BaseStorage:
    """An Optuna storage for a `storage_url` string; one line naming the cause when it cannot open."""
    try:
        if url.startswith("journal:"):
            from optuna.storages.journal import JournalFileBackend, JournalFileSymlinkLock

            path = Path(url[len("journal:"):])
            path.parent.mkdir(parents=True, exist_ok=True)
            # A worker killed while appending leaves Optuna's lock behind; with its default 30 s stale
            # period every other worker's heartbeat would stall that long, and a sweep would then fail
            # their live trials. An append holds the lock for milliseconds, so a few seconds is safe.
            lock = JournalFileSymlinkLock(str(path), grace_period=JOURNAL_LOCK_GRACE_S)
            return optuna.storages.JournalStorage(JournalFileBackend(str(path), lock_obj=lock))
        if url.startswith("sqlite:///"):
            Path(url[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
        return optuna.storages.RDBStorage(url)
    except Exception as exc:  # SQLAlchemy raises many types (bad URL, missing driver, refused connection)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(
            f"search.storage={mask_url(url)!r} cannot be opened ({first}); allowed: null (SQLite in the run dir), "
            f"an SQLAlchemy URL, journal:PATH, env ({STORAGE_ENV})"
        ) from None


def study_names(url: str) -> list[str]:
    """The studies a storage holds."""
    return optuna.study.get_all_study_names(open_storage(url))


def is_shared(url: str) -> bool:
    """Whether several processes may work on one study in this storage."""
    return url.startswith(("journal:", "postgresql"))


def check_shared(url: str, what: str) -> None:
    """UserError unless `url` is a storage for parallel workers (PostgreSQL or a journal file)."""
    if not is_shared(url):
        raise UserError(f"{what} needs a storage shared by processes: search.storage=postgresql://USER@HOST/DB "
                        f"(password from PGPASSWORD), search.storage=env ({STORAGE_ENV}) or "
                        f"search.storage=journal:PATH; got {mask_url(url)!r} (SQLite is for one process only)")


@contextmanager
def study_lock(storage: optuna.storages.BaseStorage, url: str, study_name: str) -> Iterator[None]:
    """Mutual exclusion across workers (processes and machines) for one study."""
    if url.startswith("journal:"):
        lock_path = url[len("journal:"):] + ".spectune-lock"
        with open(lock_path, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
        return
    from sqlalchemy import text

    # A transaction-scoped advisory lock: released by the commit, also when the worker dies.
    key = int.from_bytes(hashlib.sha256(f"spectune:{study_name}".encode()).digest()[:8], "big", signed=True)
    with storage.engine.begin() as conn:  # type: ignore[attr-defined]
        conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": key})
        yield
