"""Whether a launched server is up, and why not: the port check before a start, the /health probe,
and the server's own error line picked out of its log (what `EngineStartError` reports).
"""

from __future__ import annotations

import re
import socket
import urllib.error
import urllib.request

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


def healthy(base_url: str, timeout_s: float = 2.0) -> bool:
    """True when GET base_url/health answers 200."""
    # No proxies: the server is on this machine, whatever http_proxy says.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(base_url + "/health", timeout=timeout_s) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False
