"""The process side of launched servers: each runs in its own process group (vLLM forks an
engine-core process and workers), so stopping it is one SIGTERM to the group, then SIGKILL for
whatever is left; servers still running when the tuner exits (normally, by Ctrl-C, or by
SIGTERM/SIGHUP) are stopped the same way, and when the tuner is SIGKILLed the kernel sends the
server SIGTERM (Linux parent-death signal).
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import threading
import time
from types import FrameType
from typing import Any

_LIVE: set[Any] = set()  # launchers (anything with stop()) whose server may be running
_LIVE_LOCK = threading.Lock()
_HANDLERS_INSTALLED = False


# SIGKILL of the tuner runs no handler at all. On Linux the server then gets SIGTERM from the kernel
# (PR_SET_PDEATHSIG) and shuts its engine core down as on any SIGTERM. The death signal follows the
# *thread* that started the server, so it is set only for servers started from the main thread.
_PR_SET_PDEATHSIG = 1
try:
    import ctypes

    _prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here: the child must not look it up
except (OSError, AttributeError):  # not Linux / no glibc: no death signal, handlers still cover the rest
    _prctl = None


def death_signal(parent: int):
    """A preexec_fn giving the server SIGTERM when the tuner dies (None where unsupported)."""
    if _prctl is None or threading.current_thread() is not threading.main_thread():
        return None

    def arm() -> None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the tuner died before the signal was armed
            os._exit(1)

    return arm


def stop_process_group(proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """SIGTERM the process group led by `proc`, wait up to timeout_s for all of it, then SIGKILL."""
    pgid = proc.pid  # start_new_session=True: the server leads its own group
    for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if proc.poll() is not None and not _group_alive(pgid):
                return
            time.sleep(0.1)
    proc.poll()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:  # the group exists but a member is not ours to signal
        return True


def track(launcher: Any) -> None:
    """Stop `launcher` with the others when the tuner exits (until `untrack`)."""
    with _LIVE_LOCK:
        _LIVE.add(launcher)


def untrack(launcher: Any) -> None:
    with _LIVE_LOCK:
        _LIVE.discard(launcher)


def stop_all() -> None:
    """Stop every server a Launcher of this process started (atexit and signal handlers call it)."""
    with _LIVE_LOCK:
        live = list(_LIVE)
    for launcher in live:
        launcher.stop()


def _on_signal(signum: int, frame: FrameType | None) -> None:
    stop_all()
    # Then die of the same signal, as the process would have without us.
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def install_handlers() -> None:
    """Ctrl-C raises KeyboardInterrupt, which unwinds into `close()` and atexit; SIGTERM and SIGHUP
    would kill the tuner without either, so they get a handler (main thread, default handler only)."""
    global _HANDLERS_INSTALLED
    if _HANDLERS_INSTALLED:
        return
    _HANDLERS_INSTALLED = True
    atexit.register(stop_all)
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) is signal.SIG_DFL:
                signal.signal(sig, _on_signal)
