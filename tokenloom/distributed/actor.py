"""The Ray actor behind one worker: a `tokenloom serve` process on a free port of the node Ray placed it on.

The actor process owns the server process (which gets the parent-death signal, so it never outlives its
actor) and dies with it: when the server exits without stop() having been asked, the actor exits too
(os._exit), which Ray sees as a crash and answers by starting the actor again (max_restarts), on a new
port of whatever node has room. So kill -9 of either process ends in a fresh worker, no operator needed;
the supervisor sees the new URL and the router takes the old one out and the new one in.

Plain class here; the supervisor wraps it with ray.remote(...) and its resources (no Ray at import time).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass

import httpx

from tokenloom.netutil import free_port
from tokenloom.router.cluster import pdeathsig_preexec
from tokenloom.secrets_file import SecretFiles

log = logging.getLogger("tokenloom.distributed")

# The actor's own exit status when its server died under it (any non-zero status is a crash to Ray).
_SERVER_DIED = 3


@dataclass(frozen=True)
class WorkerInfo:
    url: str
    pid: int  # the `tokenloom serve` process
    actor_pid: int
    node_id: str
    ready: bool  # the server answered /health with 200 just now (the model is loaded and warmed up)


class ServeWorker:
    """One `tokenloom serve --host H --port P <serve_argv>` child, on this actor's node."""

    def __init__(self, serve_argv: list[str], bind_host: str | None, health_timeout: float,
                 api_key: str | None = None, role: str = "both", kv_secret: str | None = None) -> None:
        """`role`: `serve --role` (split prefill/decode: a decode worker's KV receiver binds the address
        other nodes reach it at); `kv_secret` signs the KV transfers between them (through a private file)."""
        import ray  # in the actor process: Ray is there, as it made it

        node_ip = ray.util.get_node_ip_address()
        self.node_id = ray.get_runtime_context().get_node_id()
        self.bind_host = bind_host or node_ip
        # A wildcard bind is advertised by the node's address (the one other nodes reach it at).
        advertised = node_ip if self.bind_host in ("0.0.0.0", "::", "") else self.bind_host
        self.port = free_port()
        self.url = f"http://{advertised}:{self.port}"
        self.health_timeout = health_timeout
        self._stopping = threading.Event()
        # The API key reaches the server through a private file on this node, not its command line.
        self._secrets = SecretFiles()
        key = ["--api-key-file", self._secrets.write("api-key", api_key)] if api_key is not None else []
        if role != "both":
            key += ["--role", role, *(["--kv-host", advertised] if role == "decode" else [])]
        if kv_secret is not None:
            key += ["--kv-secret-file", self._secrets.write("kv-secret", kv_secret)]
        self._cmd = [sys.executable, "-m", "tokenloom.cli", "serve", "--host", self.bind_host, "--port",
                     str(self.port), *serve_argv, *key]
        self._started = threading.Event()
        self._spawn_error: OSError | None = None
        self.proc: subprocess.Popen[bytes]  # set by _run before _started (or _spawn_error is)
        # The parent-death signal follows the thread that forked, not the process: the child is started
        # by a thread of its own that lives exactly as long as the child (it waits on it).
        threading.Thread(target=self._run, name="tokenloom-serve", daemon=True).start()
        self._started.wait()
        if self._spawn_error is not None:
            raise self._spawn_error

    def _run(self) -> None:
        preexec = pdeathsig_preexec()
        try:
            self.proc = subprocess.Popen(self._cmd, preexec_fn=preexec, start_new_session=preexec is not None)
        except OSError as e:
            self._spawn_error = e
            return
        finally:
            self._started.set()
        code = self.proc.wait()
        self._secrets.close()  # read at start-up; a restarted actor writes it anew
        if not self._stopping.is_set():
            log.error("worker %s (pid %d) exited with %d; ending the actor so that Ray restarts it",
                      self.url, self.proc.pid, code)
            os._exit(_SERVER_DIED)

    def info(self) -> WorkerInfo:
        ready = False
        if self.proc.poll() is None:
            try:
                ready = httpx.get(self.url + "/health", timeout=self.health_timeout).status_code == 200
            except httpx.HTTPError:
                ready = False
        if ready:
            self._secrets.close()  # the server read its key before it listened
        return WorkerInfo(self.url, self.proc.pid, os.getpid(), self.node_id, ready)

    def stop(self, graceful_timeout: float) -> int:
        """SIGTERM the server (it drains its streams for up to `graceful_timeout` s), SIGKILL after; its status."""
        self._stopping.set()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(graceful_timeout + 5.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()
