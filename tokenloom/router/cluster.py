"""Local worker processes for `tokenloom cluster`: N `tokenloom serve` children on given or free ports.

The cluster supervises them: a worker that dies (kill -9, a crash, the OOM killer) is reaped and started
again on the same port, after a back-off that doubles from `restart_backoff` up to `max_backoff` seconds
(and starts over once a worker has stayed up `stable_after` seconds). The router's /health checks take
it out while it is down and let it back in once it answers. On Linux every worker also gets the
parent-death signal (SIGTERM), so that workers end with the cluster process even when it is killed -9,
and a session of their own, so that a terminal's Ctrl-C reaches only the cluster (which then stops them).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence

from tokenloom.netutil import wait_until_healthy
from tokenloom.errors import NoHealthyWorker

log = logging.getLogger("tokenloom.router")

_PR_SET_PDEATHSIG = 1


def pdeathsig_preexec() -> Callable[[], None] | None:
    """A preexec_fn that asks the kernel for SIGTERM when the parent dies (Linux only; None elsewhere).

    Everything it needs is looked up here, in the parent: between fork and exec the child may only make
    the system calls. The signal comes when the *thread* that forked exits, so workers are started from
    the main thread or from the supervisor thread, which lives as long as the workers."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()
    term = int(signal.SIGTERM)

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, term, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl: nobody will send the signal
            os.kill(os.getpid(), term)

    return preexec


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


class LocalWorkers:
    """Starts `tokenloom serve --host HOST --port P <serve_argv> <own_argv[i]>` once per port (`cluster`
    picks free ones with netutil.free_ports; `own_argv[i]`: worker i's own flags, such as its --role);
    supervise() restarts the ones that die; stop() ends them all (and the supervision)."""

    def __init__(self, ports: Sequence[int], host: str, serve_argv: Sequence[str],
                 own_argv: Sequence[Sequence[str]] | None = None, restart_backoff: float = 1.0,
                 max_backoff: float = 30.0, stable_after: float = 60.0, poll_interval: float = 0.2) -> None:
        self.ports = list(ports)
        self.host = host
        self.serve_argv = list(serve_argv)
        self.own_argv = [list(a) for a in own_argv] if own_argv is not None else [[] for _ in self.ports]
        self.procs: list[subprocess.Popen[bytes]] = []
        self.restart_backoff = restart_backoff
        self.max_backoff = max_backoff
        self.stable_after = stable_after
        self.poll_interval = poll_interval
        self.restarts = [0 for _ in self.ports]  # how many times each worker was started again
        self._started_at: list[float] = []
        self._backoff = [restart_backoff for _ in self.ports]
        self._restart_at: list[float | None] = [None for _ in self.ports]
        self._lock = threading.Lock()  # procs, and stopping, between the supervisor and stop()
        self._stopping = threading.Event()
        self._supervisor: threading.Thread | None = None
        self._preexec = pdeathsig_preexec()

    @property
    def urls(self) -> list[str]:
        # A wildcard bind is reached over loopback from the router beside it.
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return [f"http://{host}:{p}" for p in self.ports]

    @property
    def pids(self) -> list[int]:
        with self._lock:
            return [p.pid for p in self.procs]

    def command(self, i: int) -> list[str]:
        return [sys.executable, "-m", "tokenloom.cli", "serve", "--host", self.host, "--port", str(self.ports[i]),
                *self.serve_argv, *self.own_argv[i]]

    def _spawn(self, i: int) -> subprocess.Popen[bytes]:
        cmd = self.command(i)
        log.info("starting worker: %s", " ".join(_redact(cmd)))
        # Where the parent-death signal ends the workers with the cluster, they also get a session of their
        # own: Ctrl-C in a terminal (SIGINT to the whole foreground group) then reaches only the cluster,
        # which drains the router and then stops the workers, instead of the workers exiting under the
        # router's in-flight streams (and being restarted by the supervisor).
        return subprocess.Popen(cmd, preexec_fn=self._preexec, start_new_session=self._preexec is not None)

    def launch(self) -> None:
        """Start every worker process (call from the main thread: see pdeathsig_preexec)."""
        for i in range(len(self.ports)):
            self.procs.append(self._spawn(i))
            self._started_at.append(time.monotonic())

    def start(self, timeout: float) -> None:
        """Start every worker at once (they load their models in parallel) and wait until all are healthy."""
        self.launch()
        for proc, url in zip(self.procs, self.urls):
            try:
                wait_until_healthy(url, timeout=timeout, alive=lambda p=proc: p.poll() is None)  # type: ignore[misc]
            except TimeoutError as e:
                self.stop(5.0)
                raise NoHealthyWorker(f"worker {url} did not start: {e}") from e

    def supervise(self) -> None:
        """Watch the workers from a thread of their own (it lives until stop()) and restart the dead ones."""
        if self._supervisor is not None:
            return
        self._supervisor = threading.Thread(target=self._supervise, name="tokenloom-worker-supervisor", daemon=True)
        self._supervisor.start()

    def _supervise(self) -> None:
        while not self._stopping.wait(self.poll_interval):
            try:
                self.check_once()
            except Exception:  # noqa: BLE001 - the supervisor must outlive any one failure (its children die with it)
                log.exception("worker supervisor: unexpected error")

    def check_once(self, now: float | None = None) -> None:
        """Reap the workers that died and start again those whose back-off has passed."""
        for i in range(len(self.procs)):
            with self._lock:
                if self._stopping.is_set():
                    return
                now = time.monotonic() if now is None else now
                proc = self.procs[i]
                if self._restart_at[i] is None:
                    code = proc.poll()
                    if code is None:
                        continue
                    up = now - self._started_at[i]
                    if up >= self.stable_after:
                        self._backoff[i] = self.restart_backoff
                    delay = self._backoff[i]
                    self._backoff[i] = min(delay * 2, self.max_backoff)
                    self._restart_at[i] = now + delay
                    log.warning("worker %s (pid %d) %s after %.1f s up; restarting it in %.1f s",
                                self.urls[i], proc.pid, describe_exit(code), up, delay)
                if now < self._restart_at[i]:  # type: ignore[operator]
                    continue
                try:
                    self.procs[i] = self._spawn(i)
                except OSError as e:
                    delay = self._backoff[i]
                    self._backoff[i] = min(delay * 2, self.max_backoff)
                    self._restart_at[i] = now + delay
                    log.error("worker %s could not be started again (%s); next try in %.1f s", self.urls[i], e, delay)
                    continue
                self._restart_at[i] = None
                self._started_at[i] = now
                self.restarts[i] += 1
                log.info("worker %s started again (pid %d, restart %d)", self.urls[i], self.procs[i].pid,
                         self.restarts[i])

    def stop(self, timeout: float) -> list[int | None]:
        """End the supervision (nothing is restarted from here on), SIGTERM every worker (they drain their
        streams), SIGKILL what is left after `timeout` s; exit codes."""
        with self._lock:
            self._stopping.set()
            procs = list(self.procs)
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        if self._supervisor is not None and self._supervisor is not threading.current_thread():
            # Its exit sends the parent-death signal (SIGTERM) to the workers it restarted: already sent.
            self._supervisor.join(5.0)
        codes: list[int | None] = []
        for proc in procs:
            try:
                codes.append(proc.wait(timeout))
            except subprocess.TimeoutExpired:
                proc.kill()
                codes.append(proc.wait())
        return codes


SECRET_FLAGS = ("--api-key", "--kv-secret")


def _redact(cmd: list[str]) -> list[str]:
    """The command with the values of secret flags replaced, for the log."""
    return ["***" if i and cmd[i - 1] in SECRET_FLAGS else a for i, a in enumerate(cmd)]
