"""Moving KV blocks over TCP with ZeroMQ: a receiver thread on the decode worker, a sender call on the
prefill worker. The wire format is in `wire.py`.

The receiver binds a ROUTER socket; each transfer is verified on the receiver's own thread, then
written into the cache on the engine's loop thread (`AsyncLLMEngine.call_soon`), then acknowledged.
The sender uses a REQ socket per transfer with a deadline, so a dead decode worker costs a timeout,
never a hang.

Security (see also `wire.py`): with a shared secret (`serve --kv-secret`, else the --api-key), every
message carries an HMAC-SHA256 over all its frames, checked with hmac.compare_digest before anything in
it is parsed or written; a peer without the secret is told only "unauthorized". A receiver without a
secret accepts anyone who reaches its port, so it refuses to bind anything but a loopback address (and
warns even then: any local user can write into the prefix cache). ZMQ_MAXMSGSIZE caps each frame at what
the layout needs (a block's bytes, or the header of the longest prompt the engine takes): a bigger frame
disconnects the peer before it is allocated.
"""

from __future__ import annotations

import ipaddress
import logging
import threading

import zmq

from tokenloom.disagg.blocks import BlockRecord, KVLayout, KVTransferError, import_prefix
from tokenloom.disagg.wire import (KVUnauthorized, decode_reply, decode_request, encode_reply, encode_request,
                                   secret_bytes, sign, verify)
from tokenloom.errors import ConfigError
from tokenloom.engine.async_engine import AsyncLLMEngine

log = logging.getLogger("tokenloom.disagg")


HEADER_SLACK = 64 * 1024  # bytes of header beyond the per-block entries (the layout, JSON punctuation)
HEADER_BYTES_PER_TOKEN = 24  # a token id in the header's JSON, generously
HEADER_BYTES_PER_BLOCK = 512  # a block's hashes, SHA-256, byte count and keys, generously


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # another name, or a wildcard ("*", "0.0.0.0" is an address and not loopback)


def max_frame_bytes(layout: KVLayout, max_blocks: int) -> int:
    """The largest frame a legitimate transfer of at most `max_blocks` blocks has: a block's bytes or the header."""
    header = HEADER_SLACK + max_blocks * (HEADER_BYTES_PER_BLOCK + layout.block_size * HEADER_BYTES_PER_TOKEN)
    return max(layout.block_nbytes, header)


class KVReceiver:
    def __init__(self, engine: AsyncLLMEngine, host: str, port: int, import_timeout: float = 30.0,
                 secret: str | bytes | None = None, max_frame: int | None = None) -> None:
        """Bind tcp://host:port (port 0: a free port, see `address`). `secret`: the HMAC key every transfer
        must be signed with; without one only a loopback `host` is allowed (ConfigError otherwise).
        `max_frame`: the largest frame accepted (default: from the engine's KV layout and max_model_len)."""
        self.engine = engine
        self.import_timeout = import_timeout
        self.secret = secret_bytes(secret)
        if self.secret is None:
            if not is_loopback(host):
                raise ConfigError(f"the KV receiver would accept KV blocks from anyone who reaches {host}: give "
                                  "--kv-secret (or --api-key), or bind it to loopback (--kv-host 127.0.0.1)")
            log.warning("KV receiver on %s without a secret (--kv-secret): any local process can write into "
                        "this worker's prefix cache", host)
        core = engine.engine
        layout = KVLayout.of(core)  # shapes only: safe before the first step
        self.max_blocks = -(-int(core.max_model_len) // layout.block_size)
        self.max_frame = max_frame if max_frame is not None else max_frame_bytes(layout, self.max_blocks)
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # A bigger frame disconnects its peer while it arrives: it is never allocated whole.
        self._sock.setsockopt(zmq.MAXMSGSIZE, self.max_frame)
        if port == 0:
            port = self._sock.bind_to_random_port(f"tcp://{host}")
        else:
            self._sock.bind(f"tcp://{host}:{port}")
        self.address = f"tcp://{host}:{port}"
        self.num_transfers = 0
        self.num_rejected = 0
        self.num_unauthorized = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="tokenloom-kv-receiver", daemon=True)

    def start(self) -> "KVReceiver":
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive() or self._thread.ident is not None:
            self._thread.join(5.0)
        else:  # never started: the socket is ours to close
            self._sock.close(0)

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(200):
                    continue
                try:
                    parts = self._sock.recv_multipart()
                    if len(parts) < 2 or parts[1] != b"":  # not a REQ peer: nobody to answer
                        self.num_rejected += 1
                        continue
                    self._sock.send_multipart([parts[0], b"", self._handle(parts[2:])])
                except zmq.ZMQError as e:  # a peer gone mid-reply: the next one is served all the same
                    log.warning("KV receiver: %s", e)
        finally:
            self._sock.close(0)

    def _handle(self, frames: list[bytes]) -> bytes:
        try:
            # magic, header, one frame per block, the HMAC: more frames than the longest prompt needs is refused
            # before the HMAC is computed over them.
            if len(frames) > self.max_blocks + 3:
                raise KVUnauthorized() if self.secret is not None else KVTransferError("too many frames")
            frames = verify(frames, self.secret)
        except KVTransferError as e:
            self.num_rejected += 1
            self.num_unauthorized += 1
            log.warning("refused a KV transfer: %s", e)
            return encode_reply(False, error=str(e))
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


def send_blocks(address: str, layout: KVLayout, records: list[BlockRecord], timeout: float = 30.0,
                secret: str | bytes | None = None) -> dict[str, int]:
    """Ship `records` to the receiver at `address`, signed with `secret` (the receiver's); returns its reply
    ({"written", "present"})."""
    frames = sign(encode_request(layout, records), secret_bytes(secret))
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(address)
        sock.send_multipart(frames, copy=False)
        if not sock.poll(int(timeout * 1000)):
            raise KVTransferError(f"no answer from the decode worker at {address} within {timeout:.0f}s")
        reply = decode_reply(sock.recv())
    except zmq.ZMQError as e:
        raise KVTransferError(f"KV transfer to {address} failed: {e}") from e
    finally:
        sock.close(0)
    return {"written": int(reply["written"]), "present": int(reply["present"])}
