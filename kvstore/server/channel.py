"""Call channels: small unary calls in frames on a long-lived data connection, beside gRPC
(the wire format is in ``kvstore.rpc.framing``).

A client asks ``OpenChannel`` for a ticket (authenticated and bound to its caller and
transport like a data ticket, ``server/transfers.py``) and presents it in a data connection's
hello; that connection then carries the calls of ``CHANNEL_METHODS`` for as long as the client
keeps it. Each frame runs the same handler core as its gRPC method (``service.py``) behind the
same edge the interceptors give a gRPC call (:class:`ChannelCalls`): the caller's rate limit,
metrics per method, exceptions to the status and trailers the client reads back. A channel is
tied to the client's session (``Hold``), named when it was opened: what is granted on it is
given back when the client process goes away, as for its gRPC calls.

What a hostile client can make a channel hold is bounded: a request frame's body by
``max_frame_bytes`` (a larger one is answered with an error naming the limit and the channel
closed), ``MAX_FRAMES_IN_FLIGHT`` calls at once (the daemon reads no further frame until one is
answered), the bodies of a tenant's frames in flight on all its channels together by a
``FrameBudget`` (a body that does not fit waits, unread, until earlier calls of that tenant
were answered: a tenant flooding its channels slows only itself), a frame begun must arrive
whole within ``server.stream_idle_timeout_s``, and replies not read are bounded per channel and
per tenant, and must be read within it (``server/slow_readers.py``); a frame naming no method
closes the channel. Each channel is its own task: a silent or half-sent one never
blocks the loop or another channel.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message

from kvstore.config import TracingConfig
from kvstore.errors import InvalidArgument, KVStoreError, Unavailable
from kvstore.rpc import kvstore_pb2 as pb
from kvstore.rpc.framing import (
    FRAME,
    MAX_FRAMES_IN_FLIGHT,
    METADATA_FLAG,
    OPENED_ID,
    encode_frame,
    method_of,
    split_metadata,
)
from kvstore.rpc.status import status_for
from kvstore.server.auth import Caller
from kvstore.server.calls import note_tenant
from kvstore.server.limits import RateLimiter, peer_host
from kvstore.server.sessions import Session
from kvstore.server.slow_readers import ReplyQueue
from kvstore.server.tracing import CallTracer

_log = logging.getLogger("kvstore.server.channel")
_OK = 0
_MAX_DETAIL_CHARS = 200  # of an unexpected exception's text, as the gRPC edge keeps
_NOTEWORTHY = frozenset({grpc.StatusCode.DATA_LOSS, grpc.StatusCode.RESOURCE_EXHAUSTED,
                         grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED})
# A frame body longer than this is read in pieces of it, with a loop turn between them: a 4 MB
# Lookup (1M tokens) taken out of the stream's buffer in one copy held the loop 2-3 ms. A reply
# longer than this is serialized, framed and sent in turns of their own (4.7-8 ms together).
BODY_PIECE_BYTES = 256 << 10


@dataclass(slots=True)
class CallScope:
    """Who makes a call and over what: what a handler core needs beside its request.

    gRPC calls carry their ``context`` (its metadata names the session); a channel's calls
    carry the session the channel was opened under instead.
    """

    caller: Caller
    peer: str  # as gRPC names it: "unix:..." or "ipv4:host:port"
    context: Any = None  # the gRPC call's context; None on a call channel
    session: Session | None = None  # a channel's session (None: none, or named by metadata)


Core = Callable[[Any, CallScope], Awaitable[Message]]


class ChannelCalls:
    """The calls a channel's frames make: each method's handler core behind the edge the
    gRPC interceptors are for its gRPC twin (rate limit, metrics, exceptions to statuses).

    Args:
        cores: method name -> (request message class, handler core).
        limiter: the daemon's per-caller rate limit (None: off), shared with gRPC calls.
        observe: ``Metrics.observe``, called once per call with its method, code and time.
        is_draining: True once the daemon stops taking calls (gRPC refuses new ones then): a
            channel's new calls are refused too, with Unavailable.
        tracer: opens each call's record and span, as ``TracingInterceptor`` does for gRPC
            (None: records only).
    """

    def __init__(self, cores: dict[str, tuple[type[Message], Core]],
                 limiter: RateLimiter | None,
                 observe: Callable[..., None],
                 is_draining: Callable[[], bool] = lambda: False,
                 tracer: CallTracer | None = None) -> None:
        self._cores = cores
        self._limiter = limiter
        self._observe = observe
        self._is_draining = is_draining
        self._tracer = tracer or CallTracer(TracingConfig())
        self.num_calls = 0  # calls answered, since the daemon started
        self.most_in_flight = 0  # the most frames one channel ever had unanswered at once

    def __contains__(self, method: str) -> bool:
        return method in self._cores

    async def call(self, method: str, body: bytes, scope: CallScope,
                   has_metadata: bool = False) -> tuple[int, bytes]:
        """Run one call (``has_metadata``: its body starts with call metadata, see
        ``kvstore.rpc.framing``); ``(status code, body)`` of its reply frame."""
        metadata = ()
        if has_metadata:
            try:
                metadata, body = split_metadata(body)
            except InvalidArgument as exc:
                return error_reply(grpc.StatusCode.INVALID_ARGUMENT, exc)
        with self._tracer.call(method, metadata) as record:
            code, reply = await self._call(method, body, scope, record)
            record.attributes["rpc.grpc.status_code"] = code
            return code, reply

    async def _call(self, method: str, body: bytes, scope: CallScope, record
                    ) -> tuple[int, bytes]:
        start, code = time.perf_counter(), grpc.StatusCode.OK
        try:
            if self._is_draining():
                raise Unavailable(f"the daemon is shutting down: {method} was not run")
            if self._limiter is not None:
                caller = scope.caller
                self._limiter.check(f"tenant {caller.tenant}" if caller.tenant is not None
                                    else f"peer {peer_host(scope.peer)}")
            note_tenant(scope.caller.tenant)  # as a gRPC call's scope notes it
            request_cls, core = self._cores[method]
            try:
                request = request_cls.FromString(body)
            except DecodeError as exc:  # the text names the message type, never the bytes
                raise InvalidArgument(f"request does not parse: {exc}") from None
            response = await core(request, scope)
            if response.ByteSize() > BODY_PIECE_BYTES:  # built in the turn before: each
                await asyncio.sleep(0)  # copy of a 4 MB reply takes a turn of its own
            return _OK, response.SerializeToString()
        except KVStoreError as exc:
            code = status_for(exc)
            _log.log(logging.WARNING if code in _NOTEWORTHY else logging.DEBUG,
                     "%s failed on a call channel: %s", method, exc,
                     extra={"rpc": method, "code": code.name, "error": type(exc).__name__})
            return error_reply(code, exc)
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        except Exception as exc:  # noqa: BLE001 - this is the edge; nothing escapes
            code = grpc.StatusCode.INTERNAL
            _log.error("%s raised unexpectedly", method, exc_info=exc, extra={"rpc": method})
            return code.value[0], pb.CallError(
                details=f"internal error in {method}: {type(exc).__name__}: "
                        f"{str(exc)[:_MAX_DETAIL_CHARS]}").SerializeToString()
        finally:
            self.num_calls += 1
            self._observe(method, code, time.perf_counter() - start, record)


def error_reply(code: grpc.StatusCode, exc: KVStoreError) -> tuple[int, bytes]:
    """The reply frame's status and body for a call that raised ``exc``."""
    error = pb.CallError(details=str(exc) or type(exc).__name__, error=type(exc).__name__,
                         retry_after_s=getattr(exc, "retry_after_s", 0.0) or 0.0)
    return code.value[0], error.SerializeToString()


async def serve_channel(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                        calls: ChannelCalls, scope: CallScope, max_frame_bytes: int,
                        idle_s: float, budget: FrameBudget, replies: ReplyQueue) -> None:
    """Answer the frames of one open channel until the client closes it or breaks a bound;
    returns once the calls in flight have ended. ``budget``: the caller's tenant's, shared by
    its channels; ``replies``: this channel's, on ``writer``. The caller closes ``writer``."""
    slots = _InFlight(MAX_FRAMES_IN_FLIGHT)
    running: set[asyncio.Task] = set()
    writer.write(encode_frame(_OK, OPENED_ID, b""))
    try:
        while True:
            await slots.acquire()  # at the bound: read no further frame until one is answered
            frame = await _next_frame(reader, writer, max_frame_bytes, idle_s, budget)
            if frame is None:
                return
            method, request_id, body, has_metadata = frame
            task = asyncio.get_running_loop().create_task(
                _answer(writer, calls, scope, (method, request_id, body, has_metadata), slots,
                        budget, replies))
            running.add(task)
            task.add_done_callback(running.discard)
            calls.most_in_flight = max(calls.most_in_flight, slots.count)
    finally:
        # Calls already running finish (a grant they make is then noted in the session)
        # before the channel goes; their replies go nowhere once the connection is closed.
        if running:
            await asyncio.gather(*running, return_exceptions=True)
        replies.close()


class FrameBudget:
    """Bytes of request bodies one tenant's channels may hold in flight together: a body is
    read only once it fits (one alone always fits), and its bytes come back when its call was
    answered."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.used = 0
        self._freed = asyncio.Event()

    async def take(self, num_bytes: int) -> None:
        while self.used and self.used + num_bytes > self.max_bytes:
            self._freed.clear()
            await self._freed.wait()
        self.used += num_bytes

    def give(self, num_bytes: int) -> None:
        self.used -= num_bytes
        self._freed.set()


class _InFlight:
    """The frames of one channel read and not yet answered, at most ``limit``."""

    def __init__(self, limit: int) -> None:
        self._slots = asyncio.Semaphore(limit)
        self.count = 0

    async def acquire(self) -> None:
        await self._slots.acquire()
        self.count += 1

    def release(self) -> None:
        self.count -= 1
        self._slots.release()


async def _next_frame(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      max_frame_bytes: int, idle_s: float, budget: FrameBudget
                      ) -> tuple[str, int, bytes, bool] | None:
    """The next request frame's method, id, body and whether the body starts with call
    metadata, its bytes taken from ``budget``; None
    where the channel ends (the client closed it, or it broke a bound: answered with the error
    and logged)."""
    try:
        # between frames a channel may stay quiet for as long as its client likes
        first = await reader.read(1)
        if not first:
            return None
        async with asyncio.timeout(idle_s):  # a frame begun arrives whole, or the channel ends
            length, kind, request_id = FRAME.unpack(first + await reader.readexactly(
                FRAME.size - 1))
            method = method_of(kind)
            if method is None:
                raise InvalidArgument(f"a call channel frame names method byte {kind}, which "
                                      "names no method; the channel was closed")
            if length > max_frame_bytes:
                raise InvalidArgument(f"a call channel frame of {length} bytes exceeds the "
                                      f"{max_frame_bytes}-byte limit of one request "
                                      "(server.max_request_tokens); the channel was closed")
        await budget.take(length)  # unread until it fits: the tenant's earlier calls first
        try:
            async with asyncio.timeout(idle_s):
                return (method, request_id, await _read_body(reader, length),
                        bool(kind & METADATA_FLAG))
        except BaseException:
            budget.give(length)
            raise
    except InvalidArgument as exc:
        _log.warning("closed a call channel: %s", exc)
        code, body = error_reply(grpc.StatusCode.INVALID_ARGUMENT, exc)
        writer.write(encode_frame(code, request_id, body))
        with contextlib.suppress(OSError, TimeoutError):
            async with asyncio.timeout(idle_s):
                await writer.drain()
        return None
    except TimeoutError:
        _log.warning("closed a call channel: a frame did not arrive whole within %g s "
                     "(server.stream_idle_timeout_s)", idle_s)
        return None
    except (asyncio.IncompleteReadError, OSError):
        return None  # the client went mid-frame


async def _read_body(reader: asyncio.StreamReader, length: int) -> bytes | bytearray:
    """A frame body of ``length`` bytes, in pieces of ``BODY_PIECE_BYTES`` with a loop turn
    between them; IncompleteReadError where the stream ends first."""
    if length <= BODY_PIECE_BYTES:
        return await reader.readexactly(length)
    body = bytearray(length)
    view = memoryview(body)
    got = 0
    while got < length:
        piece = await reader.read(min(BODY_PIECE_BYTES, length - got))
        if not piece:
            raise asyncio.IncompleteReadError(bytes(view[:got]), length)
        view[got:got + len(piece)] = piece
        got += len(piece)
        if got < length:
            await asyncio.sleep(0)
    view.release()
    return body


async def _answer(writer: asyncio.StreamWriter, calls: ChannelCalls, scope: CallScope,
                  frame: tuple[str, int, bytes, bool], slots: _InFlight,
                  budget: FrameBudget, replies: ReplyQueue) -> None:
    method, request_id, body, has_metadata = frame
    try:
        try:
            code, reply = await calls.call(method, body, scope, has_metadata)
        finally:
            budget.give(len(body))
        if len(reply) > BODY_PIECE_BYTES:  # serialized in the turn before
            await asyncio.sleep(0)
        frame = encode_frame(code, request_id, reply)
        if len(frame) > BODY_PIECE_BYTES:  # and framed (a copy) in this one
            await asyncio.sleep(0)
        if not replies.send(frame) or not replies.unsent_bytes:
            return  # closed, or the socket took it all (a small reply, a reading client)
        # The slot stays taken while the client catches up, so a slow reader sends no more
        # frames; one that reads nothing is closed by its ReplyQueue, which ends this wait.
        with contextlib.suppress(OSError):
            await writer.drain()
    finally:
        slots.release()
