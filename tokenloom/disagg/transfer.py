"""Moving KV blocks over TCP with ZeroMQ: a receiver thread on the decode worker, a sender call on the
prefill worker. The wire format is in `wire.py`.

The receiver binds a ROUTER socket; each transfer is verified on the receiver's own thread, then
written into the cache on the engine's loop thread (`AsyncLLMEngine.call_soon`), then acknowledged.
The sender uses a REQ socket per transfer with a deadline, so a dead decode worker costs a timeout,
never a hang.
"""

from __future__ import annotations

import logging
import threading

import zmq

from tokenloom.disagg.blocks import BlockRecord, KVLayout, KVTransferError, import_prefix
from tokenloom.disagg.wire import decode_reply, decode_request, encode_reply, encode_request
from tokenloom.engine.async_engine import AsyncLLMEngine

log = logging.getLogger("tokenloom.disagg")


class KVReceiver:
    def __init__(self, engine: AsyncLLMEngine, host: str, port: int, import_timeout: float = 30.0) -> None:
        """Bind tcp://host:port (port 0: a free port, see `address`)."""
        self.engine = engine
        self.import_timeout = import_timeout
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if port == 0:
            port = self._sock.bind_to_random_port(f"tcp://{host}")
        else:
            self._sock.bind(f"tcp://{host}:{port}")
        self.address = f"tcp://{host}:{port}"
        self.num_transfers = 0
        self.num_rejected = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="tokenloom-kv-receiver", daemon=True)

    def start(self) -> "KVReceiver":
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5.0)

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(200):
                    continue
                ident, empty, *frames = self._sock.recv_multipart()
                self._sock.send_multipart([ident, empty, self._handle(frames)])
        finally:
            self._sock.close(0)

    def _handle(self, frames: list[bytes]) -> bytes:
        try:
            layout, records = decode_request(frames)
            fut = self.engine.call_soon(lambda e: import_prefix(e, layout, records))
            written, present = fut.result(self.import_timeout)
        except Exception as e:  # noqa: BLE001 - any failure is the sender's answer, not our death
            self.num_rejected += 1
            log.warning("rejected a KV transfer: %s", e)
            return encode_reply(False, error=str(e))
        self.num_transfers += 1
        return encode_reply(True, written=written, present=present)


def send_blocks(address: str, layout: KVLayout, records: list[BlockRecord], timeout: float = 30.0) -> dict[str, int]:
    """Ship `records` to the receiver at `address`; returns its reply ({"written", "present"})."""
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(address)
        sock.send_multipart(encode_request(layout, records), copy=False)
        if not sock.poll(int(timeout * 1000)):
            raise KVTransferError(f"no answer from the decode worker at {address} within {timeout:.0f}s")
        reply = decode_reply(sock.recv())
    except zmq.ZMQError as e:
        raise KVTransferError(f"KV transfer to {address} failed: {e}") from e
    finally:
        sock.close(0)
    return {"written": int(reply["written"]), "present": int(reply["present"])}
