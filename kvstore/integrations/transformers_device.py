"""The transformers adapter's device path: a plain cache's hits decoded on the device into one
K/V buffer per wrapper, and saves encoded from it, through ``EngineCache``.

The buffer is, per layer, ``[2, H, T_max, D]`` (K then V, heads, tokens, dims): the layout a
``DynamicCache`` layer's ``[1, H, T, D]`` tensors are views of. ``EngineCache`` sees it as pages
of ``block_tokens`` tokens ("flash_hnd", ``[2, num_blocks, H, block_tokens, D]``, strides read
from the views), block i of a prompt in page i. A load decodes the stored prefix's pages (raw,
fp8 or fp4, from the HBM pool or the pinned DRAM arena) into pages 0..n-1 and the cache's
layers start as copies of those views; a save copies the finished tokens of the model's cache
into the buffer on the device and encodes them from there, on a stream of its own. No K/V goes
through a host tensor on the way in (but for pages EngineCache cannot move as device pages:
zstd-framed ones, or fp4 pages of a shape too small to pack, which come through ``get``); on
the way out only what the DRAM tier itself stores (a pool tier's pages never leave the device).

One buffer per wrapper, sized to the longest sequence it has seen, rounded up to blocks and
grown by a quarter at least, so memory stays bounded and a long decode does not reallocate at
every block.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache

from kvstore.api import LookupResult
from kvstore.client.engine import EngineCache, LoadHandle
from kvstore.codecs.triton.common import kernels_runnable
from kvstore.errors import InvalidArgument, NotFound
from kvstore.keys import Namespace
from kvstore.spec import ENGINE_DTYPES, KVSpec

ENGINE_LAYOUT = "flash_hnd"  # the buffer's per-layer view: [2, num_blocks, H, block_tokens, D]
GROWTH = 1.25  # a grown buffer is at least this much longer than the one it replaces
# A save goes in pieces of at most this many bytes of K/V, as the vLLM connector's do: the
# staging and pinned host memory a host save takes stay bounded (a 32k-token prompt of an 8B
# model is 4 GiB), and each piece's put starts while the next is gathered.
SAVE_PIECE_BYTES = 256 << 20


def device_path_reason(spec: KVSpec | None, device: torch.device,
                       dtype: torch.dtype) -> str | None:
    """Why a model's cache cannot take the device path, or None where it can."""
    if spec is None:
        return "its cache is made of groups (only a cache of one kind of full attention is)"
    if dtype not in ENGINE_DTYPES:
        return f"its dtype is {dtype}; the engine kernels take {list(ENGINE_DTYPES)}"
    if not kernels_runnable(device):
        return f"the engine kernels cannot run on {device} (CUDA, or TRITON_INTERPRET=1 on CPU)"
    return None


class DeviceKV:
    """One wrapper's device buffer and the ``EngineCache`` over it.

    ``load`` and ``stage`` run on the thread that calls ``generate``, on the current stream;
    ``save`` runs on the adapter's saver thread, on a stream of its own that waits for the
    staging copy (``stage``'s event) before it reads the buffer. A load waits for the saves'
    stream first: the device pool path returns before its encode ran.
    """

    def __init__(self, client: Any, ns: Namespace, device: torch.device,
                 dtype: torch.dtype) -> None:
        spec = ns.spec
        if not isinstance(spec, KVSpec):
            raise InvalidArgument("the device path takes a KVSpec namespace")
        self.ns = ns
        self._spec = spec
        self._device = device
        self._dtype = dtype
        self._cuda = device.type == "cuda"
        self._save_stream = torch.cuda.Stream(device) if self._cuda else None
        self._buffer = self._allocate(spec.block_tokens)
        self.engine = EngineCache(client, ns, self._views(self._buffer), layout=ENGINE_LAYOUT)
        self._loads: list[LoadHandle] = []

    @property
    def capacity_tokens(self) -> int:
        return self._buffer.shape[3]

    def _allocate(self, num_tokens: int) -> torch.Tensor:
        s = self._spec
        length = -(-num_tokens // s.block_tokens) * s.block_tokens
        buffer = torch.empty((s.num_layers, 2, s.num_kv_heads, length, s.head_dim),
                             dtype=self._dtype, device=self._device)
        if self._save_stream is not None:  # saves read it there: not reused before they ran
            buffer.record_stream(self._save_stream)
        return buffer

    def _views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """Each layer of ``buffer`` as ``[2, num_blocks, H, block_tokens, D]``."""
        _, _, heads, length, dim = buffer.shape
        bt = self._spec.block_tokens
        return [layer.view(2, heads, length // bt, bt, dim).permute(0, 2, 1, 3, 4)
                for layer in buffer]

    def reserve(self, num_tokens: int, keep_tokens: int = 0) -> None:
        """Make the buffer hold ``num_tokens``, keeping its first ``keep_tokens``. The caller
        makes sure no save still reads it."""
        if num_tokens <= self.capacity_tokens:
            return
        old = self._buffer
        new = self._allocate(max(num_tokens, int(self.capacity_tokens * GROWTH)))
        if keep_tokens:
            new[:, :, :, :keep_tokens].copy_(old[:, :, :, :keep_tokens])
        self.engine.rebind(self._views(new), layout=ENGINE_LAYOUT)
        self._buffer = new

    # --- load -------------------------------------------------------------------------------

    def load(self, prompt: list[int], hit: LookupResult) -> tuple[DynamicCache, dict[str, int],
                                                                  int]:
        """The cache of the stored prefix ``hit`` advises fetching, decoded on the device; the
        reused tokens by tier and in all."""
        bt = self._spec.block_tokens
        tokens = prompt[: hit.tokens_to_fetch // bt * bt]
        if not tokens:
            return DynamicCache(), {}, 0
        self.reserve(len(tokens))
        if self._save_stream is not None:  # the last saves' encodes read the buffer
            torch.cuda.current_stream(self._device).wait_stream(self._save_stream)
        handle = self.engine.load(tokens, torch.arange(len(tokens) // bt), advice=False)
        self._loads.append(handle)  # its kernels run on the current stream: no host wait
        got = handle.matched_tokens
        if not got:  # evicted between the lookup and the load
            return DynamicCache(), {}, 0
        cache = DynamicCache()
        for i, layer in enumerate(self._buffer):
            # A copy (the layer's first update concatenates): the buffer is free for saves.
            cache.update(layer[0, :, :got].unsqueeze(0), layer[1, :, :got].unsqueeze(0), i)
        # Per-tier counts describe the whole match; a shorter load cannot be split by tier.
        per_tier = dict(hit.tokens_per_tier) if got == hit.matched_tokens else {"unknown": got}
        return cache, per_tier, got

    def finish_loads(self) -> None:
        """Wait for this call's loads (their staging and leases are let go)."""
        for handle in self._loads:
            handle.wait()
        self._loads.clear()

    # --- save -------------------------------------------------------------------------------

    def needs_room(self, num_tokens: int) -> bool:
        return num_tokens > self.capacity_tokens

    def stage(self, cache: DynamicCache, start: int, end: int) -> torch.cuda.Event | None:
        """Copy tokens ``[start, end)`` of the model's cache into the buffer on the current
        stream; the event the save waits for (None off CUDA). ``start`` is where the tokens
        already in the buffer end (the loaded or staged prefix)."""
        self.reserve(end, keep_tokens=start)
        for i, layer in enumerate(cache.layers):
            self._buffer[i, 0, :, start:end].copy_(layer.keys[0, :, start:end])
            self._buffer[i, 1, :, start:end].copy_(layer.values[0, :, start:end])
        if not self._cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self._device))
        return event

    def save(self, tokens: list[int], first_block: int, ready: torch.cuda.Event | None) -> int:
        """Store the blocks of ``tokens`` from the buffer (blocks before ``first_block`` are
        stored already); runs on the saver thread. Returns the tokens newly written."""
        if ready is not None and self._save_stream is not None:  # the staging copy wrote it
            self._save_stream.wait_event(ready)
        try:
            return self._save_pieces(tokens, first_block)
        except NotFound:  # a stored block before first_block was evicted since: all of it
            return self._save_pieces(tokens, 0)

    def _save_pieces(self, tokens: list[int], first_block: int) -> int:
        bt = self._spec.block_tokens
        num_blocks = len(tokens) // bt
        ids = torch.arange(num_blocks)
        step = max(1, SAVE_PIECE_BYTES // self._spec.block_bytes)
        written = 0
        for start in range(first_block, num_blocks, step):
            end = min(num_blocks, start + step)
            written += self.engine.save(tokens[:end * bt], ids[:end], self._save_stream,
                                        first_block=start)
        return written

    def close(self) -> None:
        self.finish_loads()
        self.engine.close()
