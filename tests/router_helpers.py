"""Test helpers for the router: real `tokenloom serve` worker processes, the router (or a fake worker app)
in a background thread, and reading Prometheus text."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import uvicorn
from fastapi import FastAPI, Request  # Request at module level: FastAPI resolves annotations here
from prometheus_client.parser import text_string_to_metric_families

from tokenloom.netutil import free_port, wait_until_healthy
from tokenloom.router.app import build_router_app
from tokenloom.router.config import RouterConfig

WORKER_FLAGS = ("--dtype", "float32", "--kv-cache-memory", "16MiB", "--max-model-len", "2048",
                # One thread each: three workers on a small machine would otherwise fight over its cores.
                "--num-threads", "1")


def long_tiny_model(folder: Path) -> Path:
    """The tests' tiny random Llama with room for 2,048 positions (streams long enough to be killed midway)."""
    from conftest import make_tiny_model

    return make_tiny_model(folder, max_position_embeddings=2048)


class WorkerProcess:
    """`tokenloom serve` on a tiny model, as a child process that a test may kill -9 and start again."""

    def __init__(self, model_dir: Path, log_dir: Path, port: int | None = None) -> None:
        self.model_dir = model_dir
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"worker-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> "WorkerProcess":
        with self.log_path.open("ab") as log:  # a file, not a pipe: a full pipe would block the worker
            self.proc = subprocess.Popen([sys.executable, "-m", "tokenloom.cli", "serve", "--model", str(self.model_dir),
                                          "--port", str(self.port), "--served-model-name", "tiny", *WORKER_FLAGS],
                                         stdout=log, stderr=log)
        return self

    def wait(self, timeout: float = 120.0) -> None:
        proc = self.proc
        try:
            wait_until_healthy(self.url, timeout=timeout, alive=lambda: proc is not None and proc.poll() is None)
        except TimeoutError as e:
            raise TimeoutError(f"{e}; its log ends: {self.log_path.read_text()[-2000:]}") from e

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()


class ThreadServer:
    """An ASGI app under uvicorn on a free loopback port, in a daemon thread."""

    def __init__(self, app: FastAPI, ready_path: str = "/health", host: str = "127.0.0.1", port: int | None = None) -> None:
        self.app = app
        self.port = port or free_port()
        self.url = f"http://{host}:{self.port}"
        self._server = uvicorn.Server(uvicorn.Config(app, host=host, port=self.port, log_level="warning",
                                                    loop="asyncio", http="h11"))  # as serve/server.py
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        wait_until_healthy(self.url, timeout=30, path=ready_path)

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(15)


def start_router(workers: list[str], ready_path: str = "/health", **options: object) -> ThreadServer:
    """The router in front of `workers`, up once `ready_path` answers 200 (/health: a worker is healthy)."""
    config = RouterConfig(workers=tuple(workers), **{"health_interval": 0.2, **options})  # type: ignore[arg-type]
    return ThreadServer(build_router_app(config), ready_path)


def samples(text: str) -> dict[str, float]:
    """Prometheus text as {name{sorted labels}: value}."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


def router_metrics(router: ThreadServer) -> dict[str, float]:
    return samples(httpx.get(router.url + "/metrics").text)


class FakeWorker:
    """A stand-in worker whose answers a test sets: ok (JSON, or SSE / NDJSON when asked to stream), full
    (429), dead (503), bad (400), block (waits for `release`), break (streams two events, then drops the
    connection), hang (streams one event, then waits for `release`), step (streams one event, waits for
    `release`, streams the rest)."""

    def __init__(self, name: str, mode: str = "ok", host: str = "127.0.0.1", port: int | None = None) -> None:
        import asyncio
        import json

        from fastapi.responses import JSONResponse, StreamingResponse

        self.name = name
        self.mode = mode
        self.hits = 0
        self.seen_headers: list[dict[str, str]] = []
        self.release = threading.Event()
        self.released_by_test = False
        app = FastAPI()

        @app.get("/health")
        async def health() -> JSONResponse:
            return JSONResponse({"status": "ok"})

        async def wait_release() -> None:
            self.released_by_test = await asyncio.to_thread(self.release.wait, 60)

        async def answer(request: Request) -> object:
            self.hits += 1
            self.seen_headers.append(dict(request.headers))
            body = json.loads(await request.body() or b"{}")
            ollama = request.url.path.startswith("/api/")
            if self.mode == "full":
                msg = {"error": "queue full"} if ollama else {"error": {"message": "queue full", "type": "rate_limit_exceeded"}}
                return JSONResponse(msg, status_code=429, headers={"Retry-After": "7"})
            if self.mode == "dead":
                return JSONResponse({"error": {"message": "engine dead"}}, status_code=503)
            if self.mode == "bad":
                return JSONResponse({"error": {"message": "max_tokens: bad", "param": "max_tokens"}}, status_code=400)
            if self.mode == "block":
                await wait_release()
            if not body.get("stream", ollama):
                return JSONResponse({"worker": self.name})

            def event(i: int) -> bytes:
                obj = {"worker": self.name, "i": i}
                return (json.dumps(obj) + "\n").encode() if ollama else f"data: {json.dumps(obj)}\n\n".encode()

            async def events() -> object:
                yield event(0)
                if self.mode in ("hang", "step"):
                    await wait_release()
                yield event(1)
                if self.mode == "break":
                    raise RuntimeError("worker died mid-stream")  # uvicorn drops the connection
                yield event(2)
                if not ollama:
                    yield b"data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="application/x-ndjson" if ollama else "text/event-stream")

        for path in ("/v1/completions", "/v1/chat/completions", "/api/generate", "/api/chat"):
            app.add_api_route(path, answer, methods=["POST"])
        self.server = ThreadServer(app, host=host, port=port)
        self.url = self.server.url

    def close(self) -> None:
        self.release.set()
        self.server.close()
