"""One-block pages keyed by snapshot tokens (a window group's blocks, a state group's
snapshots: ``kvstore.groups``) moved between device memory and the daemon, a kernel launch for
a whole batch: the daemon's device pool where it lends one, host memory through ``put`` and
``get`` where it does not.

A batch is all or nothing on load: a window needs every block of its window, so one page
missing (evicted since the lookup) loads none and says so. Every page is its own one-block
prefix: each is reserved or acquired alone, and only the pages asked for are touched.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvstore.api import Medium
from kvstore.client.engine import (
    EVENTS_KEPT,
    LoadHandle,
    release_after,
    releaser,
    strided_rows,
)
from kvstore.client.staging import aligned
from kvstore.codecs.device import DeviceLayout, device_layout
from kvstore.errors import NoSlotTier
from kvstore.ipc import device_id, map_region
from kvstore.keys import Namespace, block_keys, snapshot_tokens, token_array

# (device page layout, page addresses, which of the batch each address is for)
Move = Callable[[DeviceLayout, torch.Tensor, list[int]], None]


@dataclass(frozen=True, slots=True)
class Gathered:
    """Pages copied out of device memory into host memory of their own (``gather``)."""

    kv: torch.Tensor  # [num_pages, *page shape] in the pages' dtype
    ready: object  # CUDA event: ``kv`` holds the pages once it passed (None: it does now)
    taken: object  # CUDA event: the device memory was read once it passed (None: it was)


def snapshot_ids(ns: Namespace, tokens, blocks: Sequence[int]) -> list[np.ndarray]:
    """The token ids of each one-block page that stores block ``blocks[i]`` of the group
    namespace ``ns``'s prefix ``tokens`` (``keys.snapshot_tokens`` of its chain key there)."""
    if not blocks:
        return []
    bt = ns.spec.block_tokens
    chain = block_keys(ns, token_array(tokens)[:(max(blocks) + 1) * bt])
    return [snapshot_tokens(chain[b], bt) for b in blocks]


class SnapshotPages:
    """One-block pages of a group's namespace, moved by a caller's kernel (see the module
    docstring). ``device``: where the caller's tensors live."""

    def __init__(self, client, device: torch.device) -> None:
        self.client = client
        self.device = device
        self._device_id = device_id(device)
        self._device_ok: bool | None = None  # does the daemon lend device slots? (asked once)
        self._events: collections.deque[object] = collections.deque(maxlen=EVENTS_KEPT)
        self._releasing = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="kvstore-release")
        weakref.finalize(self, self._releasing.shutdown, False)

    def close(self) -> None:
        self._releasing.shutdown(wait=True)

    def _cuda(self) -> bool:
        return self.device.type == "cuda"

    def _event(self, stream, interprocess: bool = False):
        if not self._cuda():
            return None
        event = torch.cuda.Event(interprocess=interprocess)
        event.record(stream or torch.cuda.current_stream(self.device))
        return event

    def _addresses(self, blocks, pools: list | None = None) -> torch.Tensor:
        """Each block's address in the pools it names (mapped once each; appended to
        ``pools``)."""
        mapped = [map_region(region, self.device) for region in blocks.regions]
        if pools is not None:
            pools += mapped
        bases = np.array([pool.base for pool in mapped], dtype=np.int64)
        return torch.from_numpy(bases[blocks.region_index.astype(np.intp)]
                                + blocks.offsets.astype(np.int64))

    # --- save -------------------------------------------------------------------------------

    def save(self, ns: Namespace, pages: list[np.ndarray], write: Move, stream=None) -> int:
        """Store each page ``pages[i]`` (its token ids) that is not stored yet, ``write``
        filling the slots; returns how many were newly stored."""
        if not pages:
            return 0
        if self._device_ok is not False:
            try:
                return self._save_device(ns, pages, write, stream)
            except NoSlotTier:
                self._device_ok = False
        return self._save_host(ns, pages, write, stream)

    def _save_device(self, ns: Namespace, pages: list[np.ndarray], write: Move, stream) -> int:
        held = []
        try:
            for toks in pages:
                held.append(self.client.reserve(ns, toks, medium=Medium.DEVICE,
                                                device=self._device_id))
                self._device_ok = True
            todo = [i for i, res in enumerate(held) if len(res.blocks)]
            handle = b""
            if todo:
                dev = device_layout(held[todo[0]].codec, ns.spec)
                pools: list = []
                addrs = torch.cat([self._addresses(held[i].blocks, pools) for i in todo])
                write(dev, addrs, todo)
                if any(pool.keep == "ipc" for pool in pools):  # the daemon is another process
                    event = self._event(stream, interprocess=True)
                    handle = event.ipc_handle()
                    self._events.append(event)  # alive until the daemon surely opened it
                elif self._cuda():  # the daemon is this process: wait here
                    self._event(stream).synchronize()
            stored = 0
            while held:
                res = held.pop(0)
                stored += bool(self.client.commit(res.reservation_id, handle))
            return stored
        except BaseException:
            for res in held:
                self.client.abort(res.reservation_id)
            raise

    def _on(self, stream):
        """``stream`` current while staging buffers are made and filled: they belong to the
        stream whose kernels use them."""
        if self._cuda():
            return torch.cuda.stream(stream or torch.cuda.current_stream(self.device))
        return contextlib.nullcontext()

    def _save_host(self, ns: Namespace, pages: list[np.ndarray], write: Move, stream) -> int:
        got = self.gather(ns, len(pages), write, stream)
        if got.ready is not None:
            got.ready.synchronize()
        stored = 0
        for toks, kv in zip(pages, got.kv):
            stored += bool(self.client.put(ns, toks, kv))
        return stored

    def gather(self, ns: Namespace, num_pages: int, write: Move, stream=None) -> Gathered:
        """``num_pages`` raw pages of ``ns``, ``write`` filling them on ``stream``, copied into
        host memory of their own (pinned, for a CUDA device). Launched without waiting, so a
        put of each can go on later, on another thread."""
        dev = device_layout("raw", ns.spec)
        section = dev.sections[0]
        with self._on(stream):  # the staging buffer belongs to the stream that fills it
            staging = aligned(num_pages * dev.nbytes, self.device)
            write(dev, strided_rows(staging.data_ptr(), dev.nbytes, num_pages),
                  list(range(num_pages)))
            taken = self._event(stream)
            rows = staging.view(num_pages, dev.nbytes)[:, :section.nbytes]
            if self._cuda():
                host = torch.empty(rows.shape, dtype=torch.uint8, pin_memory=True)
                host.copy_(rows, non_blocking=True)
            else:
                host = rows.clone()
            ready = self._event(stream)
        return Gathered(host.view(dev.dtype).view(num_pages, *section.shape), ready, taken)

    # --- load -------------------------------------------------------------------------------

    def load(self, ns: Namespace, pages: list[np.ndarray], read: Move, stream=None,
             matched_tokens: int = 0) -> LoadHandle:
        """Read every page ``pages[i]`` with ``read``, or none if one is not stored; the
        handle says ``matched_tokens`` when all were."""
        if not pages:
            return LoadHandle(0, [], None)
        if self._device_ok is not False:
            try:
                return self._load_device(ns, pages, read, stream, matched_tokens)
            except NoSlotTier:
                self._device_ok = False
        return self._load_host(ns, pages, read, stream, matched_tokens)

    def _load_device(self, ns: Namespace, pages: list[np.ndarray], read: Move, stream,
                     matched_tokens: int) -> LoadHandle:
        releases, leases = [], []
        try:
            for toks in pages:
                lease = self.client.acquire(ns, toks, medium=Medium.DEVICE,
                                            device=self._device_id)
                self._device_ok = True
                releases.append(releaser(self.client, lease))
                if not len(lease.blocks):
                    break  # one page missing: the batch is no hit
                leases.append(lease)
            if len(leases) < len(pages):
                for release in releases:
                    release()
                return LoadHandle(0, [], None)
            dev = device_layout(leases[0].codec, ns.spec)
            addrs = torch.cat([self._addresses(lease.blocks) for lease in leases])
            read(dev, addrs, list(range(len(pages))))
        except BaseException:
            for release in releases:
                release()
            raise
        event = self._event(stream)

        def release_all() -> None:
            for release in releases:
                release()

        self._releasing.submit(release_after, event, release_all)
        return LoadHandle(matched_tokens, [event], None, "device pool")

    def _load_host(self, ns: Namespace, pages: list[np.ndarray], read: Move, stream,
                   matched_tokens: int) -> LoadHandle:
        got = []
        for toks in pages:
            kv = self.client.get(ns, toks)
            if kv is None:
                return LoadHandle(0, [], None)
            got.append(kv)
        dev = device_layout("raw", ns.spec)
        section = dev.sections[0]
        with self._on(stream):
            staging = aligned(len(pages) * dev.nbytes, self.device)
            view = staging.view(len(pages), dev.nbytes)[:, :section.nbytes]
            view.copy_(torch.stack([kv.reshape(-1).view(torch.uint8) for kv in got]),
                       non_blocking=True)
            read(dev, strided_rows(staging.data_ptr(), dev.nbytes, len(pages)),
                 list(range(len(pages))))
            event = self._event(stream)
        return LoadHandle(matched_tokens, [event], lambda: staging, "stream")
