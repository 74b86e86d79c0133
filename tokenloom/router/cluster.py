"""Local worker processes for `tokenloom cluster`: N `tokenloom serve` children on given or free ports."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
from collections.abc import Sequence

from tokenloom.netutil import free_port, wait_until_healthy
from tokenloom.errors import NoHealthyWorker

log = logging.getLogger("tokenloom.router")


class LocalWorkers:
    """Starts `tokenloom serve --host HOST --port P <serve_argv> <own_argv[i]>` once per port (a free one
    where None; `own_argv[i]`: worker i's own flags, such as its --role); stop() ends them all."""

    def __init__(self, ports: Sequence[int | None], host: str, serve_argv: Sequence[str],
                 own_argv: Sequence[Sequence[str]] | None = None) -> None:
        self.ports = [p if p is not None else free_port() for p in ports]
        self.host = host
        self.serve_argv = list(serve_argv)
        self.own_argv = [list(a) for a in own_argv] if own_argv is not None else [[] for _ in self.ports]
        self.procs: list[subprocess.Popen[bytes]] = []

    @property
    def urls(self) -> list[str]:
        # A wildcard bind is reached over loopback from the router beside it.
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return [f"http://{host}:{p}" for p in self.ports]

    def start(self, timeout: float) -> None:
        """Start every worker at once (they load their models in parallel) and wait until all are healthy."""
        for port, own in zip(self.ports, self.own_argv, strict=True):
            cmd = [sys.executable, "-m", "tokenloom.cli", "serve", "--host", self.host, "--port", str(port),
                   *self.serve_argv, *own]
            log.info("starting worker: %s", " ".join(cmd))
            self.procs.append(subprocess.Popen(cmd))
        for proc, url in zip(self.procs, self.urls):
            try:
                wait_until_healthy(url, timeout=timeout, alive=lambda p=proc: p.poll() is None)  # type: ignore[misc]
            except TimeoutError as e:
                self.stop(5.0)
                raise NoHealthyWorker(f"worker {url} did not start: {e}") from e

    def stop(self, timeout: float) -> list[int | None]:
        """SIGTERM every worker (they drain their streams), SIGKILL what is left after `timeout` s; exit codes."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        codes: list[int | None] = []
        for proc in self.procs:
            try:
                codes.append(proc.wait(timeout))
            except subprocess.TimeoutExpired:
                proc.kill()
                codes.append(proc.wait())
        return codes
