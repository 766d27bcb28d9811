"""vLLM's ZMQ KV-event wire: a PUB socket and a replay ROUTER socket, served by one thread.

The wire is vLLM's ``ZmqEventPublisher`` (``vllm/distributed/kv_events.py``), so a router that
subscribes to a vLLM engine subscribes to kvstore unchanged:

- PUB: each batch is one multipart message ``[topic, seq, payload]``: ``seq`` an 8-byte
  big-endian counter from 0, ``payload`` the msgpack of a ``KVEventBatch``;
- replay (ROUTER, optional): a request ``[start_seq]`` (8 bytes big-endian; a REQ socket adds
  the empty delimiter, a DEALER sends it) is answered with ``[seq, payload]`` for every batch
  still buffered from ``start_seq`` on, then ``[-1 as 8 signed bytes, b""]``.

Nothing here can hold the daemon up: the event loop hands payloads over through a bounded
queue (full: the batch is dropped and counted), PUB drops messages for a subscriber past its
high-water mark rather than wait for it, and the ROUTER drops replies to a peer that does not
read them. The sockets are used by the publisher thread only, after ``start`` made them.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from typing import Any

from kvstore.config import EventsConfig
from kvstore.errors import ConfigError

_log = logging.getLogger("kvstore.server.events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # vLLM's end-of-replay marker
POLL_S = 0.05  # how often the thread looks at the replay socket while no batch comes
REPLAY_REQUEST_MAX_BYTES = 64  # a replay request is 8 bytes; libzmq drops anything larger


def binds(endpoint: str, mode: str) -> bool:
    """Whether the PUB socket binds ``endpoint`` (else it connects): ``mode`` "bind" or
    "connect", or "auto": vLLM's rule, bind a wildcard, ipc:// or inproc:// endpoint."""
    if mode != "auto":
        return mode == "bind"
    return ("*" in endpoint or "::" in endpoint
            or endpoint.startswith(("ipc://", "inproc://")))


def _zmq() -> Any:
    try:
        import zmq
    except ImportError:
        raise ConfigError("events.zmq_endpoint needs pyzmq and msgspec: pip install "
                          "'kvstore[events]' (or set events.zmq_endpoint = \"\" for the gRPC "
                          "stream alone)") from None
    return zmq


class ZmqPublisher:
    """Publishes encoded batches with sequence numbers and answers replay requests.

    Args:
        config: the ``[events]`` settings (endpoints, bounds).
        topic: the first frame of every published message.
    """

    def __init__(self, config: EventsConfig, topic: bytes) -> None:
        self._config = config
        self._topic = topic
        self._queue: queue.Queue[bytes] = queue.Queue(maxsize=config.send_queue_batches)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.replay_batches)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ctx: Any = None
        self._pub: Any = None
        self._replay: Any = None
        self.num_sent = 0  # batches sent on PUB
        self.num_dropped = 0  # batches dropped: the queue to the thread was full
        self.num_dropped_events = 0  # the events in those
        self.num_replays = 0  # replay requests answered

    def start(self) -> None:
        """Open the sockets (ConfigError if an endpoint cannot be used) and start the thread."""
        zmq = _zmq()
        config = self._config
        self._ctx = zmq.Context()
        try:
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.setsockopt(zmq.SNDHWM, config.zmq_hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            if binds(config.zmq_endpoint, config.zmq_mode):
                self._pub.bind(config.zmq_endpoint)
            else:
                self._pub.connect(config.zmq_endpoint)
            if config.replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.setsockopt(zmq.MAXMSGSIZE, REPLAY_REQUEST_MAX_BYTES)
                self._replay.setsockopt(zmq.SNDHWM, config.zmq_hwm)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ConfigError(f"events: cannot open {config.zmq_endpoint!r} / "
                              f"{config.replay_endpoint!r}: {exc}") from None
        self._thread = threading.Thread(target=self._run, name="kvstore-events", daemon=True)
        self._thread.start()

    def offer(self, payload: bytes, num_events: int) -> bool:
        """Queue one encoded batch for the thread; False (counted) when the queue is full."""
        try:
            self._queue.put_nowait(payload)
        except queue.Full:
            self.num_dropped += 1
            self.num_dropped_events += num_events
            return False
        return True

    def close(self) -> None:
        """Stop the thread (it sends what is queued first, for at most a poll) and close."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        self._close_sockets()

    @property
    def pub_endpoint(self) -> str:
        """The PUB socket's address as bound (a tcp port 0 resolved), or as configured."""
        if self._pub is None:
            return self._config.zmq_endpoint
        endpoint = self._pub.getsockopt_string(_zmq().LAST_ENDPOINT)
        return endpoint or self._config.zmq_endpoint

    @property
    def replay_address(self) -> str:
        """The replay socket's bound address ("" without one)."""
        if self._replay is None:
            return ""
        return self._replay.getsockopt_string(_zmq().LAST_ENDPOINT)

    # ------------------------------------------------------------------------ the thread

    def _run(self) -> None:
        zmq = _zmq()
        seq = 0
        while True:
            if self._replay is not None:
                try:
                    while self._replay.poll(0):
                        self._serve_replay(zmq)
                except zmq.ZMQError as exc:
                    _log.warning("events: replay socket failed: %s", exc)
            try:
                payload = self._queue.get(timeout=POLL_S)
            except queue.Empty:
                if self._stop.is_set():
                    return
                continue
            seq_bytes = seq.to_bytes(8, "big")
            try:
                self._pub.send_multipart((self._topic, seq_bytes, payload), flags=zmq.NOBLOCK)
                self.num_sent += 1
            except zmq.Again:  # nobody to send to yet (a connecting PUB): as PUB drops it
                pass
            except zmq.ZMQError as exc:
                _log.warning("events: publishing batch %d failed: %s", seq, exc)
            # Buffered and numbered whether or not a subscriber got it: a replay fills gaps.
            self._buffer.append((seq, payload))
            seq += 1

    def _serve_replay(self, zmq: Any) -> None:
        frames = self._replay.recv_multipart(flags=zmq.NOBLOCK)
        if len(frames) != 3 or len(frames[2]) != 8:
            _log.debug("events: ignored a malformed replay request (%d frames)", len(frames))
            return
        identity, start = frames[0], int.from_bytes(frames[2], "big")
        self.num_replays += 1
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload),
                                            flags=zmq.NOBLOCK)
        self._replay.send_multipart((identity, b"", END_SEQ, b""), flags=zmq.NOBLOCK)

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._replay = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
