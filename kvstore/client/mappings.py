"""Zero-copy pages: a client on the daemon's host reads and writes them in its tenant's arena.

Reads: Acquire, map, check, decode, Release. Stored pages lie in published memory, regions the
daemon sealed against every writer but itself (``F_SEAL_FUTURE_WRITE``) after it verified each
page there: a client maps them read-only (no other mapping is possible) and reads their pages
without hashing them again; it drops its mapping of a region the daemon gave back (its header
says so) at its next read, so no client keeps that memory alive. Writes: Reserve, encode straight into the slots,
Commit; Abort if the write fails or is interrupted. Neither streams tensor bytes through the
socket. A client maps only its own tenant's arena: it gets the arena's descriptor from the
daemon's descriptor socket (``kvstore.rpc.descriptors``, named by Health) after the daemon checked
its token, once per region, and keeps it. ``zero_copy=None`` (the default) picks this for
``unix://`` addresses whenever the daemon hands this client a descriptor, and streams while it
does not, asking again at most every ``PROBE_RETRY_S`` (a daemon still starting, a descriptor
socket that did not answer, an arena that could not be mapped); ``True`` insists on it (errors
if impossible), ``False`` always streams.

Copies between tensors and the arena run in numpy (one thread, the GIL released), not torch:
a torch copy runs on the caller's OpenMP team, whose threads a busy engine host oversubscribes
(shared-memory gets and puts measured 2-4x slower with 2 torch threads than with 1 on the
2-core box), and a process-wide ``torch.set_num_threads`` cannot be scoped to one copy.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import math
import mmap
import os
import socket
import threading
import time
import warnings
import weakref
from collections.abc import Callable

import numpy as np
import torch

from kvstore import codecs
from kvstore.api import Lease, Medium, Reservation
from kvstore.codecs.base import (
    BLOB_MAGIC,
    Payload,
    as_array,
    blob_header_bytes,
    section_tensor,
    unpack_blob,
)
from kvstore.codecs.raw import RawCodec
from kvstore.copies import MIN_SPLIT_BYTES, copy_all, run_shared
from kvstore.errors import (
    CapacityError,
    CodecError,
    InvalidArgument,
    KVStoreError,
    LeaseNotFound,
    NotFound,
)
from kvstore.keys import Namespace
from kvstore.madvise import fresh_tensor
from kvstore.page import (
    F_SEAL_FUTURE_WRITE,
    PageMeta,
    decode_page,
    is_published,
    is_retired,
    page_bytes,
    trusted_payload,
    write_page,
)
from kvstore.rpc.descriptors import (
    EXCHANGE_TIMEOUT_S,
    MAX_MESSAGE_BYTES,
    encode_request,
    parse_reply,
)
from kvstore.socket_paths import check_socket_path

log = logging.getLogger("kvstore.client")

# An auto-mode client that found no arena asks again (Health plus a descriptor-socket probe,
# about a millisecond) at most this often: under 0.1% of a busy client's time, and a daemon
# that has just started is used within a second.
PROBE_RETRY_S = 1.0
_clock = time.monotonic  # what the retry interval is measured with (tests substitute it)
# A shared-memory put of more K/V than this reserves and commits it in pieces this big: a
# piece's staging slots and its published copies are both in the DRAM tier until its commit
# ends, so a whole prompt at once would need twice its size there.
PUT_PIECE_BYTES = 256 << 20


class ZeroCopy:
    """One client's zero-copy setting, what it found out about the daemon's arenas, and its
    mappings.

    A call's ``zero_copy`` argument overrides the client's ``setting``; with neither set (auto
    mode) the client probes the descriptor socket (:meth:`must_probe`), uses shared memory
    while that works, and streams while it does not, probing again at most every
    ``PROBE_RETRY_S``: a client never keeps the socket path because of one failed attempt.
    """

    def __init__(self, setting: bool | None, is_unix: bool, token: str | None = None) -> None:
        self.maps = ArenaMaps(token)
        self._setting = setting
        self._is_unix = is_unix
        # auto mode: does the daemon hand this client arenas? Unknown until probed; never over
        # TCP.
        self.arena_ok: bool | None = None if is_unix else False
        self._retry_at = 0.0  # auto mode: when a client without an arena may probe again
        self.num_probes = 0  # descriptor-socket probes made (auto mode and insisting calls)

    def _choice(self, requested: bool | None) -> bool | None:
        return self._setting if requested is None else requested

    def must_probe(self, requested: bool | None) -> bool:
        """Whether this call needs Health asked first: auto mode without a usable arena once
        the retry interval has passed, or zero-copy insisted on before the descriptor socket
        is known."""
        choice = self._choice(requested)
        if choice is None:
            return self._is_unix and not self.arena_ok and _clock() >= self._retry_at
        return choice and self.maps.channel is None

    def probed(self, is_usable: bool) -> None:
        """Record a probe's answer: without an arena, auto mode streams until the next probe."""
        self.num_probes += 1
        self._set_usable(is_usable)

    def mode(self, requested: bool | None) -> tuple[bool, bool]:
        """(use shared memory, fail rather than fall back) for one call."""
        choice = self._choice(requested)
        if choice is not None:
            return choice, choice
        return bool(self.arena_ok), False

    def put_failed(self, exc: OSError, strict: bool) -> None:
        """A zero-copy put could not use the arena: raise if the call insisted on it, else
        stream until the next probe."""
        if strict:
            raise InvalidArgument(f"zero-copy put needs the DRAM arena: {exc}") from exc
        self._set_usable(False)

    def get_failed(self, exc: OSError | LeaseNotFound, strict: bool) -> None:
        """A zero-copy get failed: raise if the call insisted on it, else stream this get, and
        the later ones until the next probe when the arena cannot be mapped (an OSError, not
        LeaseNotFound)."""
        if strict:
            raise InvalidArgument(f"zero-copy get failed: {exc}") from exc
        if isinstance(exc, OSError):
            self._set_usable(False)

    def _set_usable(self, is_usable: bool) -> None:
        self.arena_ok = is_usable
        if not is_usable:
            self._retry_at = _clock() + PROBE_RETRY_S


def fetch_region_fd(channel: str, region: str, token: str | None,
                    timeout_s: float = EXCHANGE_TIMEOUT_S) -> int | None:
    """The descriptor of ``region`` from the daemon's descriptor socket ``channel`` (None for a
    probe, ``region=""``); the caller owns it. Raises the daemon's refusal (PermissionDenied,
    Unauthenticated, NotFound, ...) or OSError when the socket does not answer; ConfigError
    where ``channel`` is not in a directory this client trusts (``check_socket_path``)."""
    check_socket_path(channel)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        sock.connect(channel)
        sock.sendall(encode_request(region, token))
        data, fds = b"", []
        try:
            while not data.endswith(b"\n") and len(data) < MAX_MESSAGE_BYTES:
                chunk, got, _, _ = socket.recv_fds(sock, MAX_MESSAGE_BYTES - len(data), 1,
                                                   socket.MSG_CMSG_CLOEXEC)
                fds += got
                if not chunk:
                    raise ConnectionError(f"descriptor socket {channel} closed before replying")
                data += chunk
            parse_reply(data)
            if region and len(fds) != 1:
                raise ConnectionError(f"descriptor socket {channel} sent {len(fds)} descriptors")
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
    return fds[0] if region else None


class ArenaMaps:
    """mmaps of the regions this client's tenant may map, one descriptor per region.

    A region's descriptor is fetched from the daemon's descriptor socket (``channel``, learnt
    from Health) the first time a lease or reservation names the region, then kept: pages of
    leases are read through a read-only mapping of it, reservations written through a
    read-write one. A region of published memory (sealed against future writes, opening with
    the published header) holds pages the daemon verified: ``is_trusted`` says so, and
    ``drop_retired`` forgets the ones the daemon gave back. Thread-safe: the async client reads
    and writes pages from worker threads.
    """

    def __init__(self, token: str | None = None, channel: str | None = None) -> None:
        self.channel = channel  # the daemon's descriptor socket; None: Health not asked yet
        self._token = token
        self._fds: dict[str, int] = {}
        self._maps: dict[tuple[str, bool], mmap.mmap] = {}
        self._published: dict[str, mmap.mmap] = {}  # published regions' read-only mappings
        self._unmap_listeners: list[weakref.WeakMethod] = []
        self._lock = threading.Lock()

    def on_unmap(self, listener: Callable[[int, int], None]) -> None:
        """Have ``listener(address, nbytes)`` (a bound method, held weakly) called before any
        mapping is closed, so what registered it (cudaHostRegister) can unregister it first."""
        with self._lock:
            if not any(ref() == listener for ref in self._unmap_listeners):
                self._unmap_listeners.append(weakref.WeakMethod(listener))

    @property
    def regions(self) -> list[str]:
        """The regions this client holds a descriptor of."""
        with self._lock:
            return list(self._fds)

    def _fd(self, region: str) -> int:
        fd = self._fds.get(region)
        if fd is None:
            if not self.channel:
                raise ConnectionError("the daemon names no descriptor socket (no host arena, "
                                      "or Health not asked yet)")
            fd = fetch_region_fd(self.channel, region, self._token)
            self._fds[region] = fd
        return fd

    def _map(self, region: str, end: int, writable: bool) -> mmap.mmap:
        current = self._maps.get((region, writable))
        if current is not None and len(current) >= end:
            return current
        if current is None:
            self._drop_retired()  # a new region: the daemon may have given older ones back
        fd = self._fd(region)
        size = os.fstat(fd).st_size
        if size < end:
            raise InvalidArgument(f"arena {region} is {size} bytes; a slot ends at {end}")
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        mapped = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=prot)
        if current is not None:
            self._unmap(current)
        self._maps[(region, writable)] = mapped
        sealed = fcntl.fcntl(fd, fcntl.F_GET_SEALS) & F_SEAL_FUTURE_WRITE
        if not writable and sealed and is_published(mapped):
            self._published[region] = mapped
        return mapped

    def usable(self, channel: str) -> bool:
        """Whether the daemon answers on its descriptor socket ``channel`` and accepts this
        client's token there (a probe: no descriptor is sent)."""
        self.channel = channel
        if not channel:
            return False
        try:
            fetch_region_fd(channel, "", self._token)
        except (OSError, KVStoreError):
            return False
        return True

    def view(self, region: str, offset: int, length: int, writable: bool = False) -> memoryview:
        with self._lock:
            mapped = self._map(region, offset + length, writable)
            return memoryview(mapped)[offset : offset + length]

    def is_trusted(self, region: str) -> bool:
        """Whether ``region`` (mapped by ``view``) is published memory: its pages were verified
        by the daemon and nobody can change them."""
        return region in self._published

    def payload(self, region: str, offset: int, length: int, key: bytes) -> memoryview:
        """The verified payload of the page of ``key`` at ``offset`` in ``region``: checked
        against its page checksum, unless the region is published memory (the daemon checked
        it, nobody can change it since: only its header is parsed, ``trusted_payload``)."""
        view = self.view(region, offset, length)
        if self.is_trusted(region):
            return trusted_payload(view, key)
        return decode_page(view, expected_key=key).payload

    def drop_retired(self) -> int:
        """Close the mappings and descriptors of published regions the daemon gave back;
        return how many went. Cheap (one byte read per published region mapped)."""
        with self._lock:
            return self._drop_retired()

    def regions_retired(self) -> None:
        """What a client does when its session says the daemon gave back regions: drop them
        now. Called by what reads the session's stream, which must go on: a failure (an unmap
        listener's) is logged, and the next call that maps a new region tries again."""
        try:
            self.drop_retired()
        except Exception:  # logged: the stream must still be read
            log.warning("could not drop the regions the daemon gave back", exc_info=True)

    def _drop_retired(self) -> int:
        gone = [region for region, mapped in self._published.items() if is_retired(mapped)]
        for region in gone:
            del self._published[region]
            for writable in (False, True):
                mapped = self._maps.pop((region, writable), None)
                if mapped is not None:
                    self._unmap(mapped)
            fd = self._fds.pop(region, None)
            if fd is not None:
                os.close(fd)
        return len(gone)

    def _unmap(self, mapped: mmap.mmap) -> None:
        listeners = [ref() for ref in self._unmap_listeners]
        if any(listeners) and len(mapped):
            probe = np.frombuffer(mapped, dtype=np.uint8, count=1)
            address = int(probe.ctypes.data)
            del probe
            for listener in filter(None, listeners):
                listener(address, len(mapped))
        # BufferError: a caller still holds a view; the mapping goes when the last one does.
        with contextlib.suppress(BufferError):
            mapped.close()

    def close(self) -> None:
        with self._lock:
            for mapped in self._maps.values():
                self._unmap(mapped)
            self._maps.clear()
            self._published.clear()
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


def _check_host(medium: Medium) -> None:
    if medium is not Medium.HOST:
        raise InvalidArgument(f"a {medium.value} slot cannot be mapped through the host arena")


def check_get_out(ns: Namespace, num_tokens: int, out: torch.Tensor | None) -> None:
    """InvalidArgument unless ``out`` (a get's caller-owned result buffer; None: a fresh
    tensor per get) can hold the K/V of every full block of ``num_tokens`` tokens
    (``KVSpec.check_out``)."""
    if out is not None:
        ns.spec.check_out(out, num_tokens)


def check_in_time(lease: Lease) -> None:
    """LeaseNotFound if ``lease`` had expired by now: its pins may have lapsed while its pages
    were read, so what was read may be another block's and must not be used.

    Deadlines are the daemon's ``time.time()``, and a client reading the arena shares its host
    (and so its clock): a read that ends before the deadline read pinned pages. This is what
    lets a client send the Release after the caller has its data.
    """
    if time.time() >= lease.deadline:
        raise LeaseNotFound(f"lease {lease.lease_id} expired while its pages were read")


def read_lease(maps: ArenaMaps, ns: Namespace, lease: Lease,
               out: torch.Tensor | None = None, copy_threads: int = 1) -> torch.Tensor | None:
    """The K/V of a lease's pinned pages, each verified once (``ArenaMaps.payload``: its page
    checksum against its key, or none in published memory) and then decoded without checking
    the blob checksum inside it again.

    Args:
        out: where to write them (checked by ``check_get_out``); the result is then its first
            ``matched_tokens`` tokens, a view of it. None: a fresh tensor (``fresh_tensor``).
        copy_threads: threads the raw pages' copies share (``kvstore.copies.copy_all``).
    """
    maps.drop_retired()
    if not lease.blocks:
        return None
    spec = ns.spec
    bt = spec.block_tokens
    num_tokens = len(lease.blocks) * bt
    if out is None:
        out = fresh_tensor(spec.shape(num_tokens), spec.torch_dtype)
    else:
        check_get_out(ns, num_tokens, out)
        out = out[:, :, :num_tokens]
    # Per page a header parse and a numpy copy (kvstore's own threads, whatever the caller's
    # torch thread settings), no torch view: on the 2-core box the page's meta JSON and torch
    # views cost 80 us a 2 MiB page beside a 220-270 us copy (2026-12-01).
    dst = as_array(out)
    block_shape = spec.shape(bt)
    copies = []
    for i, loc in enumerate(lease.blocks):
        _check_host(loc.medium)
        payload = maps.payload(loc.region, loc.offset, loc.length, loc.key)
        section = _raw_section(payload, block_shape, spec.torch_dtype)
        if section is None:
            codecs.decode(payload, out=out[:, :, i * bt : (i + 1) * bt], verify=False)
        else:
            src = np.frombuffer(section, dtype=dst.dtype).reshape(block_shape)
            copies.append((dst[:, :, i * bt : (i + 1) * bt], src))
    copy_all(copies, copy_threads)
    return out


def fill_out(kv: torch.Tensor | None, out: torch.Tensor | None, copy_threads: int = 1
             ) -> torch.Tensor | None:
    """``kv`` (a get's result that did not come through the arena) as the caller asked for it:
    copied into the front of ``out`` (a view of those tokens returned), or as it is."""
    if kv is None or out is None:
        return kv
    front = out[:, :, : kv.shape[2]]
    copy_all([(as_array(front), as_array(kv))], copy_threads)
    return front


@functools.lru_cache(maxsize=64)
def _raw_head(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[bytes, int]:
    """The blob header of every raw page of ``shape`` ``dtype`` K/V, and its K/V bytes."""
    nbytes = math.prod(shape) * dtype.itemsize
    return blob_header_bytes(RawCodec.codec_id, dtype, shape, b"", (nbytes,)), nbytes


def _raw_section(payload: memoryview, shape: tuple[int, ...], dtype: torch.dtype
                 ) -> memoryview | None:
    """The K/V bytes of a verified raw page's payload in place (C order); None for other
    codecs. CodecError if it holds another shape or dtype than expected."""
    head, nbytes = _raw_head(shape, dtype)
    start = len(head)
    # The namespace's own raw pages, the usual case: one compare of the header's bytes.
    if len(payload) == start + nbytes + 8 and bytes(payload[:start]) == head:
        return payload[start : start + nbytes]
    if bytes(payload[:4]) != BLOB_MAGIC or len(payload) < 6 or payload[5] != RawCodec.codec_id:
        return None
    parts = unpack_blob(payload, verify=False)  # the page checksum covered the blob
    if parts.dtype != dtype or parts.shape != shape:
        raise CodecError(f"page holds {parts.dtype} {parts.shape}, the namespace expects "
                         f"{dtype} {shape}")
    return parts.sections[0]


BlockVisitor = Callable[[int, torch.Tensor], None]  # (block index, its K/V [L, 2, bt, H, D])


def visit_lease(maps: ArenaMaps, ns: Namespace, lease: Lease, visit: BlockVisitor,
                first_block: int = 0) -> int:
    """Hand each of a lease's pages from block ``first_block`` on to ``visit``, in order, each
    verified (checksum, key) first.

    The K/V handed over is ``[L, 2, block_tokens, H, D]`` and valid only during the call: for a
    raw page a read-only view of the page in the arena (a visitor copying it out moves each
    byte once), for other codecs a scratch tensor the page was decoded into.

    Returns:
        The number of blocks the lease holds (visited or not).
    """
    maps.drop_retired()
    spec = ns.spec
    shape, dtype = spec.shape(spec.block_tokens), spec.torch_dtype
    scratch: torch.Tensor | None = None
    for i in range(first_block, len(lease.blocks)):
        loc = lease.blocks[i]
        _check_host(loc.medium)
        payload = maps.payload(loc.region, loc.offset, loc.length, loc.key)
        section = _raw_section(payload, shape, dtype)
        if section is not None:
            with warnings.catch_warnings():
                # The lease's pages are mapped read-only; the visitor only reads the view.
                warnings.filterwarnings("ignore", message="The given buffer is not writable")
                kv = section_tensor(section, dtype, shape)
        else:
            scratch = scratch if scratch is not None else torch.empty(shape, dtype=dtype)
            kv = codecs.decode(payload, out=scratch, verify=False)
        visit(i, kv)
    return len(lease.blocks)


def must_abort(exc: BaseException, committing: bool) -> bool:
    """Whether a zero-copy put that raised ``exc`` still holds its reservation and must Abort
    it: always while the slots are being written; during Commit only when the caller was
    interrupted (KeyboardInterrupt, cancellation), since a Commit the daemon answered has
    already published or freed the slots."""
    return not committing or not isinstance(exc, Exception)


def put_pieces(ns: Namespace, num_tokens: int, first_block: int = 0) -> list[int]:
    """Where the pieces of a shared-memory put of ``num_tokens`` end, in tokens (each piece
    is reserved as the prompt up to its end; ``PUT_PIECE_BYTES`` of K/V at most a piece). The
    last ends with the prompt, a partial block included, as a put of one piece would."""
    bt = ns.spec.block_tokens
    per_piece = max(1, PUT_PIECE_BYTES // ns.spec.block_bytes)
    ends = range(first_block + per_piece, num_tokens // bt, per_piece)
    return [end * bt for end in ends] + [num_tokens]


def write_reservation(maps: ArenaMaps, ns: Namespace, kv: torch.Tensor,
                      reservation: Reservation, first_block: int = 0,
                      copy_threads: int = 1) -> None:
    """Encode each reserved block of ``kv`` with the reservation's codec straight into its
    slot: the page header and meta in front, the blob behind them, in one pass that copies
    (or quantises) and hashes (``kvstore.page.write_page``); with no hashing where the
    reservation says its commit seals the pages (``Reservation.sealed``). ``kv`` starts at block
    ``first_block``: NotFound if the reservation holds a block before it (a prefix block the
    caller counted on being stored). Pages of ``MIN_SPLIT_BYTES`` or more in all are written
    by up to ``copy_threads`` threads, each a run of them."""
    codec = codecs.get(reservation.codec)
    bt = ns.spec.block_tokens
    kv = kv.detach().cpu()
    missing = [g.block_index for g in reservation.blocks if g.block_index < first_block]
    if missing:
        raise NotFound(f"block {missing[0]} of the prefix is not stored; the blocks before "
                       f"block {first_block} must be stored before more are added to them")
    pages = []
    for grant in reservation.blocks:
        _check_host(grant.medium)
        start = (grant.block_index - first_block) * bt
        block = kv[:, :, start : start + bt]
        meta = PageMeta.for_block(ns, grant.key, grant.parent, grant.block_index, codec)
        payload = codec.prepare(block)
        # Aligned: the daemon's NaN/Inf check of the section, and copies of it, run faster.
        length = page_bytes(payload, meta)
        if length > grant.capacity_bytes:
            raise CapacityError(f"page of {length} bytes exceeds its "
                                f"{grant.capacity_bytes}-byte slot")
        pages.append((maps.view(grant.region, grant.offset, length, writable=True), meta,
                      payload))
    total = sum(payload.nbytes for _, _, payload in pages)
    num_shares = min(copy_threads, len(pages)) if total >= MIN_SPLIT_BYTES else 1
    run_shared([functools.partial(_write_pages, pages[i * len(pages) // num_shares :
                                                      (i + 1) * len(pages) // num_shares],
                                  not reservation.sealed)
                for i in range(num_shares)])


def _write_pages(pages: list[tuple[memoryview, PageMeta, Payload]], sums: bool) -> None:
    for view, meta, payload in pages:
        write_page(view, meta, payload, aligned=True, sums=sums)
