"""Helpers for starting local servers: a free TCP port, waiting until a server answers its health check,
and stopping a server's process group.

Used by `tokenloom cluster` (router/cluster.py) for its worker processes, and by the tests and
benchmark scripts that start servers of their own.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable

import httpx


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (for servers started by tests and scripts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_ports(n: int, exclude: set[int] | frozenset[int] = frozenset()) -> list[int]:
    """`n` distinct free ports, none of them in `exclude` (a port already chosen but not yet bound, e.g. the
    router's own when `cluster` picks its workers' ports: the OS can hand the same free port out twice)."""
    out: list[int] = []
    while len(out) < n:
        port = free_port()
        if port not in exclude and port not in out:
            out.append(port)
    return out


def wait_until_healthy(base_url: str, timeout: float = 120.0, path: str = "/health",
                       alive: Callable[[], bool] | None = None) -> None:
    """Poll `GET path` until it answers 200; raise TimeoutError if it has not within `timeout` s, or at
    once when `alive` (e.g. "the server process still runs") turns false."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if alive is not None and not alive():
            raise TimeoutError(f"{base_url}: the server exited before it came up")
        try:
            if httpx.get(base_url + path, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{base_url} did not become healthy within {timeout:.0f} s")


def stop_process_group(proc: subprocess.Popen[bytes], timeout: float = 60.0, sig: int = signal.SIGTERM) -> None:
    """`sig` to the process group `proc` leads (started with start_new_session), then SIGKILL to the group
    if it has not exited within `timeout` s. Nothing when it has already exited."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, sig)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
