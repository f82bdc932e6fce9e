"""A stand-in for `vllm serve` / `python -m sglang.launch_server` in the launcher's fast tests.

FAKE_MODE chooses the behaviour: ok (serves /health), fail (prints a traceback and exits 1),
oom (dies of SIGKILL), hang (never listens), stubborn (serves /health and ignores SIGTERM).
A listening server starts after FAKE_STARTUP_S seconds (default 0.3) and also streams OpenAI chat
completions of max_tokens "x" tokens, FAKE_TOKEN_S seconds each (twice as fast when started with
--speculative-config), so the tuner can measure it; with FAKE_REQUESTS set, each completion request
appends its server's pid to that file (one JSON line), so tests can tell which server served what.
In every mode it first spawns a child in its process group, the way vLLM forks its engine core,
and records its argv, its pid and the child's pid in FAKE_RECORD (one JSON line per start), so
tests can check that the launcher stops the whole group. FAKE_CHILD=0 skips the child (a test
that restarts servers often: where PID 1 reaps orphans late, each stop would wait for that).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def _arg(name: str, default: str) -> str:
    argv = sys.argv
    return argv[argv.index(name) + 1] if name in argv else default


class _Health(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def do_POST(self) -> None:  # noqa: N802: a streaming OpenAI chat completion of max_tokens tokens
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if self.path != "/v1/chat/completions":
            self.send_response(404)
            self.end_headers()
            return
        per_token = float(os.environ.get("FAKE_TOKEN_S", "0.005"))
        per_token /= 2 if "--speculative-config" in sys.argv else 1
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        n = int(body.get("max_tokens", 16))
        if os.environ.get("FAKE_REQUESTS"):
            with open(os.environ["FAKE_REQUESTS"], "a") as f:
                f.write(json.dumps({"pid": os.getpid()}) + "\n")
        for _ in range(n):
            time.sleep(per_token)
            chunk = {"choices": [{"index": 0, "delta": {"content": "x"}}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        usage = {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}}
        self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        self.wfile.flush()

    def log_message(self, *args: object) -> None:
        pass


def main() -> None:
    mode = os.environ.get("FAKE_MODE", "ok")
    if mode == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = (subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
             if os.environ.get("FAKE_CHILD", "1") == "1" else None)

    def kill_child() -> None:
        if child is not None:
            child.kill()
            child.wait()  # reaped here: an orphaned zombie waits for PID 1, which may reap late
    if mode != "stubborn":  # like vLLM: SIGTERM shuts the engine core down, then the server
        def shutdown(signum: int, frame: object) -> None:
            kill_child()
            os._exit(0)

        signal.signal(signal.SIGTERM, shutdown)
    with open(os.environ["FAKE_RECORD"], "a") as f:
        f.write(json.dumps({"argv": sys.argv[1:], "pid": os.getpid(), "child": child.pid if child else None,
                            "env": {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "VLLM_CPU_KVCACHE_SPACE")}}) + "\n")
    print("INFO starting fake engine", flush=True)
    if mode == "fail":
        print("Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n    boom()\n"
              "ValueError: speculative config rejected: num_speculative_tokens must be > 0\n"
              "RuntimeError: Engine core initialization failed. See root cause above.", flush=True)
        kill_child()
        sys.exit(1)
    if mode == "oom":  # what the kernel's OOM killer does
        kill_child()
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "hang":
        time.sleep(600)
        return
    time.sleep(float(os.environ.get("FAKE_STARTUP_S", "0.3")))  # a start-up that takes a while
    server = ThreadingHTTPServer((_arg("--host", "127.0.0.1"), int(_arg("--port", "8000"))), _Health)
    server.serve_forever()


if __name__ == "__main__":
    main()
