"""Zero-copy pages: a client on the daemon's host reads and writes them in the DRAM arena file.

Reads: Acquire, mmap, verify, decode, Release. Writes: Reserve, encode, write into the slots,
Commit; Abort if the write fails or is interrupted. Neither streams tensor bytes through the
socket. ``zero_copy=None`` (the default) picks this automatically for ``unix://`` addresses
when this process can map the arena Health names (checked once per client), and otherwise
streams; ``True`` insists on it (errors if impossible), ``False`` always streams.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading

import torch

from kvstore import codecs
from kvstore.api import Lease, Medium, Reservation
from kvstore.errors import CapacityError, InvalidArgument, LeaseNotFound
from kvstore.keys import Namespace
from kvstore.page import PageMeta, decode_page, encode_page


class ZeroCopy:
    """One client's zero-copy setting, what it found out about the arena, and its mappings.

    A call's ``zero_copy`` argument overrides the client's ``setting``; with neither set (auto
    mode) the client probes the arena once (:meth:`must_probe`) and falls back to streaming
    when it cannot be opened.
    """

    def __init__(self, setting: bool | None, is_unix: bool) -> None:
        self.maps = ArenaMaps()
        self._setting = setting
        # auto mode: can this process map the arena? Unknown until probed; never over TCP.
        self.arena_ok: bool | None = None if is_unix else False

    def _choice(self, requested: bool | None) -> bool | None:
        return self._setting if requested is None else requested

    def must_probe(self, requested: bool | None) -> bool:
        """Whether this call needs ``arena_ok`` found out first (auto mode, not yet probed)."""
        return self._choice(requested) is None and self.arena_ok is None

    def mode(self, requested: bool | None) -> tuple[bool, bool]:
        """(use shared memory, fail rather than fall back) for one call."""
        choice = self._choice(requested)
        if choice is not None:
            return choice, choice
        return bool(self.arena_ok), False

    def put_failed(self, exc: OSError, strict: bool) -> None:
        """A zero-copy put could not use the arena: raise if the call insisted on it, else
        stream from now on."""
        if strict:
            raise InvalidArgument(f"zero-copy put needs the DRAM arena: {exc}") from exc
        self.arena_ok = False

    def get_failed(self, exc: OSError | LeaseNotFound, strict: bool) -> None:
        """A zero-copy get failed: raise if the call insisted on it, else stream this get, and
        the later ones too when the arena cannot be opened (an OSError, not LeaseNotFound)."""
        if strict:
            raise InvalidArgument(f"zero-copy get failed: {exc}") from exc
        if isinstance(exc, OSError):
            self.arena_ok = False


class ArenaMaps:
    """mmaps of the daemon's DRAM arena files, opened on first use and reused.

    An arena grows in chunks, so a slot past the mapped end remaps the file. Thread-safe: the
    async client reads and writes pages from worker threads.
    """

    def __init__(self) -> None:
        self._maps: dict[tuple[str, bool], mmap.mmap] = {}
        self._lock = threading.Lock()

    def _map(self, path: str, end: int, writable: bool) -> mmap.mmap:
        current = self._maps.get((path, writable))
        if current is not None and len(current) >= end:
            return current
        fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
        try:
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            mapped = mmap.mmap(fd, 0, flags=mmap.MAP_SHARED, prot=prot)
        finally:
            os.close(fd)
        if len(mapped) < end:
            mapped.close()
            raise InvalidArgument(f"arena {path} is {len(mapped)} bytes; a slot ends at {end}")
        if current is not None:
            self._close_map(current)
        self._maps[(path, writable)] = mapped
        return mapped

    def usable(self, path: str) -> bool:
        """Whether this process can map ``path`` for reading and writing."""
        if not path:
            return False
        try:
            with self._lock:
                self._map(path, 0, writable=True)
        except (OSError, ValueError):
            return False
        return True

    def view(self, path: str, offset: int, length: int, writable: bool = False) -> memoryview:
        with self._lock:
            mapped = self._map(path, offset + length, writable)
            return memoryview(mapped)[offset : offset + length]

    @staticmethod
    def _close_map(mapped: mmap.mmap) -> None:
        # BufferError: a caller still holds a view; the mapping goes when the last one does.
        with contextlib.suppress(BufferError):
            mapped.close()

    def close(self) -> None:
        with self._lock:
            for mapped in self._maps.values():
                self._close_map(mapped)
            self._maps.clear()


def _check_host(medium: Medium) -> None:
    if medium is not Medium.HOST:
        raise InvalidArgument(f"a {medium.value} slot cannot be mapped through the host arena")


def read_lease(maps: ArenaMaps, ns: Namespace, lease: Lease) -> torch.Tensor | None:
    """The K/V of a lease's pinned pages, each verified against its key."""
    if not lease.blocks:
        return None
    bt = ns.spec.block_tokens
    out = torch.empty(ns.spec.shape(len(lease.blocks) * bt), dtype=ns.spec.torch_dtype)
    for i, loc in enumerate(lease.blocks):
        _check_host(loc.medium)
        page = decode_page(maps.view(loc.region, loc.offset, loc.length),
                           expected_key=loc.key)
        codecs.decode(page.payload, out=out[:, :, i * bt : (i + 1) * bt])
    return out


def must_abort(exc: BaseException, committing: bool) -> bool:
    """Whether a zero-copy put that raised ``exc`` still holds its reservation and must Abort
    it: always while the slots are being written; during Commit only when the caller was
    interrupted (KeyboardInterrupt, cancellation), since a Commit the daemon answered has
    already published or freed the slots."""
    return not committing or not isinstance(exc, Exception)


def write_reservation(maps: ArenaMaps, ns: Namespace, kv: torch.Tensor,
                      reservation: Reservation) -> None:
    """Encode each reserved block of ``kv`` with the reservation's codec as a page and write it
    into its slot."""
    codec = codecs.get(reservation.codec)
    bt = ns.spec.block_tokens
    kv = kv.detach().cpu()
    for grant in reservation.blocks:
        _check_host(grant.medium)
        block = kv[:, :, grant.block_index * bt : (grant.block_index + 1) * bt].contiguous()
        meta = PageMeta(key=grant.key, namespace=ns.fingerprint, parent=grant.parent,
                        block_index=grant.block_index, tenant=ns.tenant, model_id=ns.model_id,
                        codec=codec.name, codec_id=codec.codec_id)
        page = encode_page(meta, codec.encode(block))
        if len(page) > grant.capacity_bytes:
            raise CapacityError(f"page of {len(page)} bytes exceeds its "
                                f"{grant.capacity_bytes}-byte slot")
        maps.view(grant.region, grant.offset, len(page), writable=True)[:] = page

