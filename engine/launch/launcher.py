"""Launch vLLM or SGLang as a subprocess for tuning trials: start, health-check, reuse, stop.

A `Launcher` owns at most one server. `ensure(spec)` returns the base URL of a healthy server
started with that SpecConfig's flags (built by `tuner.schema.flags`, the one mapping the manifests use
too); when the flags equal those of the running server it is reused, otherwise the old one is
stopped and a new one started. The launcher never measures: the shared load generator
(`engine.measure.runner.run_http`) plays the workload against the URL.

Each server runs in its own process group (vLLM forks an engine-core process and workers), so
stopping it is one SIGTERM to the group, then SIGKILL for whatever is left. Servers still running
when the tuner exits (normally, by Ctrl-C, or by SIGTERM/SIGHUP) are stopped the same way; when
the tuner is SIGKILLed the kernel sends the server SIGTERM (Linux parent-death signal).
A start that fails (bad flag, out of memory, busy port, health timeout) raises `EngineStartError`
carrying the server's own error line from its log; it never hangs.

This module holds the `Launcher`; the command line is built in engine.launch.command, the health
checks and error lines are in engine.launch.health, process groups and cleanup at exit in
engine.launch.process (their public names are re-exported here).
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from engine.heartbeat import still_working
from engine.launch.command import (PROJECT_ROOT, SETUP_HINT, Kind, engine_version, local_command, resolve_executable,
                                   server_command, server_env, settings_for)
from engine.launch.health import error_line, healthy, last_line, port_in_use
from engine.launch.process import death_signal, install_handlers, stop_all, stop_process_group, track, untrack
from tuner.schema.engine_command import ServerSettings
from tuner.schema.config import LaunchedEngineConfig, ModelConfig, SpecConfig

__all__ = ["PROJECT_ROOT", "SETUP_HINT", "EngineStartError", "Kind", "Launcher", "error_line", "healthy", "last_line",
           "model_ref", "port_in_use", "resolve_executable", "server_command", "server_env", "stop_all", "stop_process_group"]


class EngineStartError(RuntimeError):
    """The server did not become healthy. `str()` is one line ending with the server's own error."""

    def __init__(self, message: str, *, log_path: Path | None = None, returncode: int | None = None) -> None:
        super().__init__(message)
        self.log_path = log_path
        self.returncode = returncode


def model_ref(model: ModelConfig, cache_dir: str | None = None) -> str:
    """What a launched server loads for `model`: its local HF checkpoint when it has one (the
    converted SmolLM2 here, a random test model saved once), else its HF id."""
    if model.local_path or model.gguf or model.random_init:
        from engine.models.target import hf_checkpoint_dir  # torch: only when a checkpoint must be made

        return str(hf_checkpoint_dir(model, cache_dir))
    return model.hf_id


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
        settings: ServerSettings | None = None,
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
        # settings: the study's (tuner.schema.engine_command.server_settings, the manifests' too), else the pieces given
        self.settings = settings or settings_for(
            kind, ecfg, served_model_name=served_model_name, accelerator=accelerator, quantization=quantization,
            kv_cache_dtype=kv_cache_dtype, tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization)
        self.model = self.settings.served_names[0] if self.settings.served_names else model_ref
        self.accelerator = accelerator
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
        self.version: str | None = None  # the engine release that served (read at the first start)
        self._proc: subprocess.Popen | None = None
        self._key: tuple | None = None
        self._lock = threading.RLock()

    # -- what would run

    def command(self, spec: SpecConfig) -> list[str]:
        """The argv a server for `spec` runs with."""
        return local_command(self.kind, self.ecfg, self.settings, self.model_ref, spec)[0]

    def env(self, spec: SpecConfig | None = None) -> dict[str, str]:
        """The variables set on top of the inherited environment for a server of `spec`."""
        return local_command(self.kind, self.ecfg, self.settings, self.model_ref, spec or SpecConfig(method="off"))[1]

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
            return self.running and self._server_key(self.command(spec), self.env(spec)) == self._key

    def ensure(self, spec: SpecConfig) -> str:
        """A healthy server for `spec`: the running one when its flags are identical, else a new one."""
        with self._lock:
            cmd, env = local_command(self.kind, self.ecfg, self.settings, self.model_ref, spec)
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
        install_handlers()
        t0 = time.monotonic()
        with open(self.log_path, "wb") as log:
            log.write(("$ " + " ".join(cmd) + "\n").encode())
            log.flush()
            try:
                self._proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                              env=full_env, start_new_session=True,
                                              preexec_fn=death_signal(os.getpid()))
            except OSError as exc:  # not executable, bad interpreter line
                raise EngineStartError(f"{self.kind} could not be executed ({cmd[0]}): {exc}",
                                       log_path=self.log_path) from None
        track(self)
        try:
            with still_working(f"starting {self.kind} (log: {self.log_path})"):  # redirected output: a line per 30 s
                self._wait_healthy(t0)
        except BaseException:  # failed start, KeyboardInterrupt: never leave the server behind
            self.stop()
            raise
        self.startup_s = time.monotonic() - t0
        self.total_startup_s += self.startup_s
        if self.version is None:
            self.version = engine_version(self.kind, self.ecfg)
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
        return healthy(self.base_url)

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
            untrack(self)

    close = stop

    def __enter__(self) -> "Launcher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

