"""The engine's GPU path: register a paged KV cache once, then save and load prefixes by the
engine's block ids, with kvstore's kernels reading and writing the cache in place.

With a daemon whose chain has a GPU tier (``kind = "hbm"``), pages move between the engine's
cache and the tenant's device pool, mapped once through CUDA IPC (``kvstore.ipc``): a save
reserves pool slots, runs the encode kernel on the engine's stream and commits with an
interprocess event the daemon waits on before it reads the slots; a load pins the prefix in the
pool (the daemon promotes it from DRAM, SSD or the shared tier first) and decodes it into the
engine's pages in one launch, or one launch per layer so layer i can run while later layers
still land. Without a GPU tier, a load leases the pages in the tenant's DRAM arena and DMAs
them chunk by chunk into a device staging ring (``StagingRing``), decoding each chunk into the
engine's pages as it lands; a save encodes the engine's pages on the device and puts them
through the client (shared memory where the daemon offers it). From a daemon the client cannot
share memory with, pages stream through ``get``.

Only blocks that are whole in both ``tokens`` and ``block_ids`` move.
"""

from __future__ import annotations

import collections
import concurrent.futures
import ctypes
import logging
import weakref
from collections.abc import Sequence
from typing import Self

import numpy as np
import torch

from kvstore.api import BlockLocations, Lease, LookupResult, Medium, SlotGrants
from kvstore.client.staging import StagingRing, address_of, aligned, host_pages
from kvstore.codecs.device import DEVICE_CODECS, DeviceLayout, device_layout
from kvstore.codecs.triton.engine import from_engine, to_engine
from kvstore.engine_fp8 import Fp8Cache, check_fp8
from kvstore.errors import InvalidArgument, KVStoreError, NoSlotTier, Unavailable
from kvstore.ipc import device_id, map_region
from kvstore.keys import Namespace
from kvstore.spec import EngineLayout

log = logging.getLogger("kvstore.gpu")
EVENTS_KEPT = 256  # exported events stay alive until the daemon surely opened them
# cudaHostRegisterPortable | cudaHostRegisterReadOnly: the arena is mapped read-only here.
_HOST_REGISTER_READ_ONLY = 1 | 8


class LoadHandle:
    """A load in flight: ``matched_tokens`` are (being) written into the engine's cache.

    ``wait_for_layer(i)`` makes the caller's stream (or ``stream``) wait until layer ``i``
    landed, without blocking the host; ``wait()`` blocks until every layer landed. The lease
    goes back on its own once the last layer landed (a worker of the cache waits for it), so
    neither call waits for a round trip to the daemon.
    """

    def __init__(self, matched_tokens: int, events: list[object], finish,
                 source: str = "") -> None:
        self.matched_tokens = matched_tokens
        self.source = source  # "device pool", "host arena", "stream" or "" (nothing loaded)
        self._events = events  # one per layer, or one for all
        self._finish = finish

    def wait_for_layer(self, layer: int, stream: torch.cuda.Stream | None = None) -> None:
        if not self._events:
            return
        event = self._events[layer if len(self._events) > 1 else 0]
        if event is not None:
            (stream or torch.cuda.current_stream()).wait_event(event)

    def wait(self) -> int:
        for event in self._events[-1:]:
            if event is not None:
                event.synchronize()
        if self._finish is not None:
            self._finish()
            self._finish = None
        return self.matched_tokens


class EngineCache:
    """An engine's paged KV cache registered with kvstore (see the module docstring).

    Args:
        client: a sync ``kvstore.client.Client`` of the daemon on this host.
        ns: the namespace the cache's pages belong to (its spec is the cache's geometry).
        kv_caches: the cache as the engine holds it (``EngineLayout.of``).
        layout: a name from ``kvstore.spec.ENGINE_LAYOUTS`` when the shapes are ambiguous.
        fp8: an fp8 cache's flavour and scales (``kvstore.engine_fp8``); required for a cache
            of one-byte elements, whose every namespace must carry them (``Fp8Cache.bind``).
    """

    # Blocks of the first piece a host load leases (``_load_host``); each next piece doubles.
    FIRST_PIECE_BLOCKS = 32

    def __init__(self, client, ns: Namespace, kv_caches, *, layout: str | None = None,
                 fp8: Fp8Cache | None = None) -> None:
        self.client = client
        self.ns = ns
        self.layout = EngineLayout.of(kv_caches, ns.spec, layout)
        self.fp8 = check_fp8(self.layout, ns, fp8)
        self._device_id = device_id(self.layout.device)  # sent with device slots' requests
        self._device_ok: bool | None = None  # does the daemon lend device slots? (asked once)
        self._warned_unreachable = False
        self._arena_tier: str | None = None  # the tier host leases come from (seen once)
        self._events: collections.deque[object] = collections.deque(maxlen=EVENTS_KEPT)
        self._rings: dict[str, StagingRing] = {}
        self._pinned: dict[int, int] = {}  # registered arena mappings: base -> bytes
        self._unpinnable: set[int] = set()
        self._last_mapping: object = None  # the mapping _pin looked at last
        # Gives leases back once their loads landed, off the engine's thread.
        self._releasing = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="kvstore-release")
        weakref.finalize(self, _unregister, self._pinned)
        weakref.finalize(self, self._releasing.shutdown, False)

    def close(self) -> None:
        """Give back the leases of loads still landing (once they landed), and unregister the
        arena mappings this cache pinned (the engine's tensors stay); the mappings also when
        the cache is collected. Close it before its client: a mapping the client unmaps while
        registered stays registered."""
        self._releasing.shutdown(wait=True)
        self.client.flush_releases()  # the late Releases of those leases answered, too
        _unregister(self._pinned)

    def rebind(self, kv_caches, *, layout: str | None = None) -> None:
        """Point the cache at new engine tensors of the same geometry on the same device (an
        engine that grew its cache). The arena mappings, their pinned registrations and the
        staging rings stay: registering them again would cost 0.5 s per GiB. The caller makes
        sure no save or load still uses the old tensors."""
        new = EngineLayout.of(kv_caches, self.ns.spec, layout)
        if new.device != self.layout.device:
            raise InvalidArgument(f"rebind keeps the cache on {self.layout.device}, got tensors "
                                  f"on {new.device}")
        self.layout = new

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- helpers ----------------------------------------------------------------------------

    def _namespace(self, ns: Namespace | None) -> Namespace:
        """``ns`` (a request's own namespace: its salt, adapter, identity) or the cache's; any
        namespace of the cache's geometry may use its pages."""
        if ns is None or ns is self.ns:
            return self.ns
        if ns.spec != self.ns.spec:
            raise InvalidArgument(f"namespace spec {ns.spec} is not the engine cache's "
                                  f"{self.ns.spec}")
        if self.fp8 is not None:
            self.fp8.check(ns)
        return ns

    def _blocks(self, tokens: Sequence[int], block_ids) -> tuple[Sequence[int], torch.Tensor]:
        """The whole blocks of ``tokens`` and their engine pages (an int64 CPU tensor)."""
        bt = self.ns.spec.block_tokens
        ids = self.layout.check_block_ids(block_ids)
        n = min(len(tokens) // bt, len(ids))
        return tokens[:n * bt], ids[:n]  # a slice, not a copy: a 32k list costs a millisecond

    def _addresses(self, blocks: BlockLocations | SlotGrants, dev: DeviceLayout
                   ) -> tuple[torch.Tensor, list]:
        """Each block's address in the device pools it names (each pool mapped once), one
        vectorised pass and one bounds check over the batch; and the pools."""
        pools = [map_region(region, self.layout.device) for region in blocks.regions]
        bases = np.array([pool.base for pool in pools], dtype=np.int64)
        sizes = np.array([pool.nbytes for pool in pools], dtype=np.int64)
        index = blocks.region_index.astype(np.intp)
        offsets = blocks.offsets.astype(np.int64)
        if len(offsets) and bool((offsets + dev.nbytes > sizes[index]).any()):
            raise InvalidArgument(f"the daemon named {dev.codec} device pages past the end of "
                                  "their pool")
        return torch.from_numpy(bases[index] + offsets), pools

    def _cuda(self) -> bool:
        return self.layout.device.type == "cuda"

    def _event(self, stream: torch.cuda.Stream | None, interprocess: bool = False):
        if not self._cuda():
            return None
        event = torch.cuda.Event(interprocess=interprocess)
        event.record(stream or torch.cuda.current_stream(self.layout.device))
        return event

    def _unreachable(self, exc: Unavailable) -> None:
        if not self._warned_unreachable:
            log.warning("device pages of the daemon are out of this engine's reach (%s): "
                        "using the host path", exc)
            self._warned_unreachable = True

    def _try_device(self, call):
        """``call()`` on the daemon's device slots, or None when it lends none."""
        if self._device_ok is False:
            return None
        try:
            result = call()
        except NoSlotTier:
            self._device_ok = False
            return None
        self._device_ok = True
        return result

    # --- save -------------------------------------------------------------------------------

    def save(self, tokens: Sequence[int], block_ids, stream: torch.cuda.Stream | None = None,
             *, ns: Namespace | None = None, first_block: int = 0) -> int:
        """Store the blocks of ``tokens`` held in engine pages ``block_ids``; returns the
        tokens newly published (blocks already stored are skipped).

        ``first_block``: the blocks before it are stored already (an earlier save of the same
        prefix), so a save through host memory gathers and moves only the blocks from it on
        (NotFound where one before it is not stored); the device pool's reservation skips
        stored blocks by itself."""
        ns = self._namespace(ns)
        tokens, ids = self._blocks(tokens, block_ids)
        if first_block < 0:
            raise InvalidArgument(f"first_block must be >= 0, got {first_block}")
        if first_block >= len(ids):
            return 0
        res = self._try_device(lambda: self.client.reserve(ns, tokens, medium=Medium.DEVICE,
                                                           device=self._device_id))
        if res is None:
            return self._save_host(ns, tokens, ids, stream, first_block)
        try:
            grants = res.blocks
            handle = b""
            if len(grants):
                dev = device_layout(res.codec, ns.spec)
                try:
                    addrs, pools = self._addresses(grants, dev)
                except Unavailable as exc:  # a pool on a GPU this engine cannot reach
                    self._unreachable(exc)
                    self.client.abort(res.reservation_id)
                    return self._save_host(ns, tokens, ids, stream, first_block)
                from_engine(self.layout, dev, addrs,
                            ids[torch.from_numpy(grants.block_index.astype(np.int64))], stream)
                if any(pool.keep == "ipc" for pool in pools):  # the daemon is another process
                    event = self._event(stream, interprocess=True)
                    handle = event.ipc_handle()
                    self._events.append(event)
                elif self._cuda():  # the daemon is this process: wait here
                    self._event(stream).synchronize()
            return self.client.commit(res.reservation_id, handle)
        except BaseException:
            self.client.abort(res.reservation_id)
            raise

    def _save_host(self, ns: Namespace, tokens: Sequence[int], ids: torch.Tensor, stream,
                   first_block: int = 0) -> int:
        kv, ready = self.gather(ids[first_block:], stream)
        if ready is not None:
            ready.synchronize()
        return self.client.put(ns, tokens, kv, first_block=first_block)

    def gather(self, block_ids, stream: torch.cuda.Stream | None = None
               ) -> tuple[torch.Tensor, object]:
        """Engine pages ``block_ids`` in the canonical ``[L, 2, T, H, D]`` layout, in host
        memory of their own (pinned, for a CUDA cache), and the event after which it holds
        them (None where it already does). Launched on ``stream`` without waiting: the engine
        may change the pages once the event passed, so a put of the tensor can go on later
        (``Client.put``, on another thread). One encode launch into a device staging buffer,
        one reordering copy on the device and one copy over the link."""
        ids = self.layout.check_block_ids(block_ids)
        spec, n = self.ns.spec, len(ids)
        dev = device_layout("raw", spec)
        shape = spec.shape(n * spec.block_tokens)
        if not self._cuda():
            staging = aligned(n * dev.nbytes, self.layout.device)
            from_engine(self.layout, dev, strided_rows(staging.data_ptr(), dev.nbytes, n), ids)
            return _canonical(staging, dev, n).permute(1, 2, 0, 3, 4, 5).reshape(shape), None
        stream = stream or torch.cuda.current_stream(self.layout.device)
        with torch.cuda.stream(stream):  # the buffers belong to the stream that uses them
            staging = aligned(n * dev.nbytes, self.layout.device)
            from_engine(self.layout, dev, strided_rows(staging.data_ptr(), dev.nbytes, n), ids,
                        stream)
            kv = _canonical(staging, dev, n).permute(1, 2, 0, 3, 4, 5).reshape(shape)
            host = torch.empty(shape, dtype=kv.dtype, pin_memory=True)
            host.copy_(kv, non_blocking=True)
            ready = self._event(stream)
        return host, ready

    # --- load -------------------------------------------------------------------------------

    def load(self, tokens: Sequence[int], block_ids, stream: torch.cuda.Stream | None = None,
             *, layerwise: bool = False, advice: bool = True, first_block: int = 0,
             ns: Namespace | None = None) -> LoadHandle:
        """Write the stored prefix of ``tokens`` into engine pages ``block_ids`` (block i of the
        prefix into ``block_ids[i]``), on ``stream``.

        ``advice``: load only the prefix the cost model says is worth fetching (the rest is
        cheaper to recompute). ``layerwise``: one launch per layer, each with its event, so
        the caller can start layer i (``LoadHandle.wait_for_layer``) before the rest landed.
        ``first_block``: the blocks before it are in the engine already (its own prefix
        cache) and are neither fetched nor written. ``matched_tokens`` counts from token 0.
        """
        ns = self._namespace(ns)
        tokens, ids = self._blocks(tokens, block_ids)
        bt = self.ns.spec.block_tokens
        if not 0 <= first_block <= len(ids):
            raise InvalidArgument(f"first_block {first_block} is outside the {len(ids)} whole "
                                  "blocks given")
        if first_block == len(ids):
            return LoadHandle(0, [], None)
        hit = None
        if advice:
            hit = self.client.lookup(ns, tokens)
            worth = hit.matched_tokens if hit.advised_tokens is None else hit.advised_tokens
            tokens = tokens[:worth // bt * bt]
            if len(tokens) // bt <= first_block:
                return LoadHandle(0, [], None)
        lease = self._try_device(lambda: self.client.acquire(ns, tokens, medium=Medium.DEVICE,
                                                             first_block=first_block,
                                                             device=self._device_id))
        if lease is None:
            return self._load_host(ns, tokens, ids, stream, hit, first_block)
        release = releaser(self.client, lease)
        if not lease.blocks:
            release()
            return LoadHandle(0, [], None)
        try:
            dev = device_layout(lease.codec, ns.spec)
            addrs, _ = self._addresses(lease.blocks, dev)
        except Unavailable as exc:  # a pool on a GPU this engine cannot reach
            release()
            self._unreachable(exc)
            return self._load_host(ns, tokens, ids, stream, hit, first_block)
        except BaseException:
            release()
            raise
        try:
            events = self._decode(dev, addrs, ids[first_block:first_block + len(addrs)], stream,
                                  layerwise)
        except BaseException:
            release()
            raise
        return self._handle(lease, events, release, "device pool")

    def _handle(self, lease: Lease, events: list[object], release, source: str) -> LoadHandle:
        """The handle of a launched load; its lease goes back on the cache's worker once the
        last event passed (the pages are read by then)."""
        self._releasing.submit(release_after, events[-1] if events else None, release)
        return LoadHandle(lease.matched_tokens, events, None, source)

    def _decode(self, dev: DeviceLayout, addrs: torch.Tensor, ids: torch.Tensor, stream,
                layerwise: bool) -> list[object]:
        if not layerwise:
            to_engine(self.layout, dev, addrs, ids, stream)
            return [self._event(stream)]
        events = []
        for layer in range(self.layout.num_layers):
            to_engine(self.layout, dev, addrs, ids, stream, layers=range(layer, layer + 1))
            events.append(self._event(stream))
        return events

    def _load_host(self, ns: Namespace, tokens: Sequence[int], ids: torch.Tensor, stream,
                   hit: LookupResult | None = None, first_block: int = 0) -> LoadHandle:
        """Pages pinned in the tenant's shared-memory arena, DMA'd chunk by chunk into a device
        staging ring and decoded into the engine as each chunk lands; without an arena this
        client can map (a remote daemon), the socket path's ``get``.

        A prefix the arena holds whole (``hit``, the lookup, says so) is leased at once. A
        longer one than ``FIRST_PIECE_BLOCKS`` that the daemon must bring in from its SSD or
        the shared tier is leased in pieces that double in size, so the daemon brings the next
        piece in while the ring moves the last."""
        maps = getattr(getattr(self.client, "_zero_copy", None), "maps", None)
        if maps is not None and maps.channel is None:  # where the daemon hands out arenas
            maps.usable(self.client.health().arena_path)
        if maps is None or not maps.channel:
            return self._load_streamed(ns, tokens, ids, stream, first_block)
        bt = self.ns.spec.block_tokens
        total = len(tokens) // bt
        loaded, piece, last, dev = first_block, self.FIRST_PIECE_BLOCKS, None, None
        if self._arena_tier == "":  # a daemon that leases no pieces (it names no tier)
            piece = total
        elif total > piece and self._arena_tier is not None:  # known from an earlier lease
            hit = hit or self.client.lookup(ns, tokens)
            if hit.tokens_per_tier.get(self._arena_tier, 0) >= hit.matched_tokens:
                piece = total  # all in the arena already: one lease
        while loaded < total:
            end = min(total, loaded + piece)
            lease = self.client.acquire(ns, tokens[:end * bt], first_block=loaded)
            if not lease.tier and loaded:  # a daemon that ignores first_block: its pages
                releaser(self.client, lease)()  # would start at block 0
                return self._load_streamed(ns, tokens, ids, stream, first_block)
            if not lease.tier and end < total:  # such a daemon ignores first_block: lease all
                releaser(self.client, lease)()
                end = total
                lease = self.client.acquire(ns, tokens)
            release = releaser(self.client, lease)
            if not lease.blocks:
                release()
                break
            # zstd-framed pages, or pages whose sections a small shape pads apart (a blob's
            # lie back to back, so the ring cannot move them as device pages): through get
            if dev is None and (lease.codec not in DEVICE_CODECS
                                or not device_layout(lease.codec, ns.spec).packed):
                release()
                return self._load_streamed(ns, tokens, ids, stream, first_block)
            try:
                if dev is None or dev.codec != lease.codec:
                    dev = device_layout(lease.codec, ns.spec)
                maps.on_unmap(self._unpinned)  # a region given back is unmapped: unregister
                pages = host_pages(maps, lease.blocks, dev, self._pin)
                got = len(pages)
                events = self._ring(dev).load(self.layout, dev, pages, ids[loaded:loaded + got],
                                              stream)
            except BaseException:  # pieces launched before give their leases back as they land
                release()
                raise
            self._releasing.submit(release_after, events[-1], release)
            last = events[-1]
            loaded += got
            self._arena_tier = lease.tier
            if loaded < end or loaded == total:  # the stored prefix ends here, or is in
                break
            if hit is None:
                hit = self.client.lookup(ns, tokens)
            in_arena = hit.tokens_per_tier.get(lease.tier, 0) >= hit.matched_tokens
            piece = total if in_arena else 2 * piece
        got_any = loaded > first_block
        return LoadHandle(loaded * bt if got_any else 0, [last] if got_any else [], None,
                          "host arena" if got_any else "")

    def _pin(self, view: memoryview) -> None:
        """Register the arena mapping holding ``view`` as pinned memory, once (DMA at the
        link's rate instead of through a bounce buffer)."""
        mapping = view.obj
        if not self._cuda() or mapping is self._last_mapping:  # the lease's pages share few
            return
        self._last_mapping = mapping
        base, size = address_of(memoryview(mapping)), len(mapping)
        if self._pinned.get(base) == size or base in self._unpinnable:
            return
        cudart = torch.cuda.cudart()
        err = int(cudart.cudaHostRegister(base, size, _HOST_REGISTER_READ_ONLY))
        if err == 0:
            self._pinned[base] = size
            return
        _clear_last_error()  # a refused registration must not fail a later CUDA call
        self._unpinnable.add(base)  # e.g. registered already by another cache: copies still run
        log.info("arena mapping at %#x stays pageable here (cudaHostRegister: error %d)", base,
                 err)

    def _unpinned(self, base: int, size: int) -> None:
        """The client is about to unmap the mapping at ``base``: unregister it if pinned here."""
        if self._pinned.pop(base, None) is not None:
            torch.cuda.cudart().cudaHostUnregister(base)
        self._unpinnable.discard(base)

    def _ring(self, dev: DeviceLayout) -> StagingRing:
        ring = self._rings.get(dev.codec)
        if ring is None:
            ring = self._rings[dev.codec] = StagingRing(dev, self.layout.device)
        return ring

    def _load_streamed(self, ns: Namespace, tokens: Sequence[int], ids: torch.Tensor, stream,
                       first_block: int = 0) -> LoadHandle:
        kv = self.client.get(ns, tokens)
        bt = self.ns.spec.block_tokens
        if kv is None or kv.shape[2] // bt <= first_block:
            return LoadHandle(0, [], None)
        n = kv.shape[2] // bt
        kv = kv[:, :, first_block * bt:n * bt]
        dev = device_layout("raw", ns.spec)
        m = n - first_block
        staging = aligned(m * dev.nbytes, self.layout.device)
        blocks = kv.reshape(*kv.shape[:2], m, bt, *kv.shape[3:]).permute(2, 0, 1, 3, 4, 5)
        _canonical(staging, dev, m).copy_(blocks, non_blocking=True)
        to_engine(self.layout, dev, strided_rows(staging.data_ptr(), dev.nbytes, m),
                  ids[first_block:n], stream)
        event = self._event(stream)
        return LoadHandle(n * bt, [event], lambda: staging, "stream")  # staging kept till waited


def strided_rows(base: int, stride: int, n: int) -> torch.Tensor:
    """``n`` addresses from ``base``, ``stride`` bytes apart (an int64 CPU tensor)."""
    return torch.arange(n, dtype=torch.int64) * stride + base


def _clear_last_error() -> None:
    """Reset the CUDA runtime's last error (torch's ``cudart`` module does not offer
    ``cudaGetLastError``; the runtime library torch loaded does). Left set, torch would
    report it at its next kernel launch as that launch's failure."""
    global _LAST_ERROR
    if _LAST_ERROR is None:
        with open("/proc/self/maps") as maps:
            path = next((line.split()[-1] for line in maps if "libcudart.so" in line), None)
        _LAST_ERROR = ctypes.CDLL(path).cudaGetLastError if path else (lambda: 0)
    _LAST_ERROR()


_LAST_ERROR = None


def _unregister(pinned: dict[int, int]) -> None:
    for base in list(pinned):
        torch.cuda.cudart().cudaHostUnregister(base)
        del pinned[base]


def _canonical(staging: torch.Tensor, dev: DeviceLayout, n: int) -> torch.Tensor:
    """``n`` raw device pages in ``staging`` as ``[n, L, 2, bt, H, D]``."""
    section = dev.sections[0]
    pages = staging.view(n, dev.nbytes)[:, :section.nbytes]
    return pages.view(dev.dtype).view(n, *section.shape)


def release_after(event, release) -> None:
    """``release()`` once ``event`` passed; a failure is logged (the lease then ends with
    the client's session, or at its deadline)."""
    try:
        if event is not None:
            event.synchronize()
        release()
    except (KVStoreError, RuntimeError) as exc:  # a worker thread: nobody else would see it
        log.warning("kvstore: giving a load's lease back failed: %s", exc)


def releaser(client, lease: Lease):
    """Gives ``lease`` back once, through the client's late Releases (the next load's Acquire
    carries it)."""
    done = False

    def release() -> None:
        nonlocal done
        if not done:
            done = True
            client.release_later(lease.lease_id)

    return release
