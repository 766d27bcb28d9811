"""The vLLM connector's state groups on a GPU cache: each group's snapshots moved by
``EngineStates`` between vLLM's state blocks (a block id is a slot) and kvstore's pages.

What vLLM registers on CUDA for a layer of a ``MambaSpec`` group (``register_kv_caches``):

- vLLM 0.32 (``v1/worker/utils.allocate_kv_cache`` -> ``kv_cache_interface.
  create_kv_cache_views``): one int8 view ``[num_blocks, 1, 1, C]`` per layer, C the layer's
  state bytes (``MambaSpec.state_content_size_bytes``: every part), its last dim contiguous,
  one block a page stride (``page_size_padded``, times the layers between under a
  block-outermost layout) from the next. The layer's parts share that one allocation: from
  each page's start, in ``MambaSpec.shapes`` order, back to back (``MambaBase.bind_kv_cache``
  slices them out so; the conv state, then the SSM or gated-delta-net state).
- vLLM 0.26 (``gpu_model_runner._reshape_kv_cache_tensors``): a list per layer, one tensor per
  part ``[num_blocks, *shape]`` of its dtype, ``torch.as_strided`` over the layer's buffer with
  a block stride of ``page_size_bytes``: the same bytes as 0.32's, the parts already split.

In both, one backing buffer serves every group (layer i of the attention group and of each
state group view the same bytes, block ids from one pool), and per part the blocks are
``[num_blocks, *shape]`` with each block's state contiguous: ``EngineStates``' slots. Any
other layout (a part's shape or dtype, C, a state not contiguous, parts not back to back in
one page) is refused with the layer's name and what was found.

- Loads: ``start`` makes the load stream wait for what the engine queued so far; each
  snapshot is one acquire and one launch (every layer) on the load stream; ``finish`` makes
  the engine's stream wait for them. vLLM's Mamba layers call no ``wait_for_layer_load``
  (only attention layers do), so the connector calls ``finish`` at the end of
  ``start_load_kv``: the states have landed before the step's first layer runs.
- Saves: ``gather`` queues on the save stream, behind the step's forward pass, the copy of
  the snapshot's block into device staging and from there into pinned host memory; the put
  waits for the second on the save thread (``vllm_saves``). The engine's stream waits for the
  first: in align mode vLLM frees a request's state blocks behind its last two while it runs
  (``MambaManager.remove_skipped_blocks``), so the next step may hand that block to another
  request and write it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch

from kvstore.client.engine import LoadHandle
from kvstore.client.engine_states import EngineStates
from kvstore.errors import InvalidArgument
from kvstore.groups import CacheGroup
from kvstore.integrations.vllm_saves import SaveJob
from kvstore.keys import Namespace

VLLM_STATE_LAYOUTS = ("vLLM 0.32: int8 [num_blocks, 1, 1, state bytes] per layer; "
                      "vLLM 0.26: per layer a list of [num_blocks, *shape], one per part")


def state_parts(group: CacheGroup, layers: Sequence[Any]) -> list[dict[str, torch.Tensor]]:
    """Each registered layer of a state group as its parts' ``[num_blocks, *shape]`` tensors,
    by part name (``EngineStates``' states); InvalidArgument names the first layer that is
    laid out as neither vLLM version lays it out."""
    return [_layer_parts(group, i, layer) for i, layer in enumerate(layers)]


def _layer_parts(group: CacheGroup, i: int, layer: Any) -> dict[str, torch.Tensor]:
    if isinstance(layer, torch.Tensor):
        parts = _split_pages(group, i, layer)
    elif isinstance(layer, (list, tuple)) and len(layer) == len(group.parts) \
            and all(isinstance(t, torch.Tensor) for t in layer):
        parts = list(layer)
    else:
        raise InvalidArgument(f"{group.label} layer {i}: registered a {type(layer).__name__}; "
                              f"kvstore reads {VLLM_STATE_LAYOUTS}")
    base, stride = parts[0].data_ptr(), parts[0].stride(0) * parts[0].element_size()
    at = 0
    for part, t in zip(group.parts, parts, strict=True):
        found = f"{tuple(t.shape)} {t.dtype} strides {t.stride()}"
        if t.dtype != part.torch_dtype or tuple(t.shape[1:]) != part.shape \
                or (t.shape[0] and not t[0].is_contiguous()):
            raise InvalidArgument(f"{group.label} layer {i} part {part.name}: found {found}, "
                                  f"expected [num_blocks, *{part.shape}] {part.dtype}, each "
                                  f"block's state contiguous ({VLLM_STATE_LAYOUTS})")
        if t.data_ptr() != base + at or t.stride(0) * t.element_size() != stride \
                or t.shape[0] != parts[0].shape[0] or stride < at + part.nbytes:
            raise InvalidArgument(f"{group.label} layer {i} part {part.name}: found {found} "
                                  f"at byte {t.data_ptr() - base} of the page; vLLM lays a "
                                  f"layer's parts back to back in one page ({at} here), one "
                                  f"page stride ({stride} bytes) for every part")
        at += part.nbytes
    return {part.name: t for part, t in zip(group.parts, parts, strict=True)}


def _split_pages(group: CacheGroup, i: int, pages: torch.Tensor) -> list[torch.Tensor]:
    """vLLM 0.32's ``[num_blocks, 1, 1, C]`` int8 pages cut into the parts, as
    ``MambaBase.bind_kv_cache`` cuts them."""
    num_bytes = group.block_bytes_per_layer(1)
    if pages.dim() != 4 or pages.shape[1:3] != (1, 1) or pages.shape[3] != num_bytes \
            or pages.element_size() != 1 or pages.stride(3) != 1:
        raise InvalidArgument(f"{group.label} layer {i}: cache {tuple(pages.shape)} "
                              f"{pages.dtype} strides {pages.stride()}; kvstore reads "
                              f"{VLLM_STATE_LAYOUTS} ({num_bytes} state bytes here)")
    rows = pages.view(torch.uint8)[:, 0, 0]
    out, at = [], 0
    for part in group.parts:
        try:
            out.append(rows[:, at:at + part.nbytes].view(part.torch_dtype)
                       .view(-1, *part.shape))
        except RuntimeError as exc:  # a page stride or offset not a multiple of the dtype
            raise InvalidArgument(f"{group.label} layer {i} part {part.name}: pages of stride "
                                  f"{pages.stride(0)} bytes from {pages.data_ptr()} hold no "
                                  f"aligned {part.dtype} state ({exc})") from exc
        at += part.nbytes
    return out


class StateTransfers:
    """One state group of a worker's GPU cache, and the step's loads of it in flight.

    Args:
        client: the worker's sync client (acquires, late releases, the pool's reserves).
        ns: the engine's grouped namespace (requests bring their own, same cache).
        group: the state group's index in it.
        layers: the group's layers as vLLM registered them, in layer order.
    """

    def __init__(self, client, ns: Namespace, group: int, layers: Sequence[Any]) -> None:
        self.states = EngineStates(client, ns, group,
                                   state_parts(ns.cache.groups[group], layers))
        self._device = self.states.layout.device
        self._cuda = self._device.type == "cuda"
        self._load_stream = torch.cuda.Stream(self._device) if self._cuda else None
        self._save_stream = torch.cuda.Stream(self._device) if self._cuda else None
        self._loads: list[LoadHandle] = []

    def _engine_stream(self):
        return torch.cuda.current_stream(self._device) if self._cuda else None

    def start(self) -> None:
        """Before the step's loads: a block written may have been read by the last step."""
        if self._cuda:
            self._load_stream.wait_stream(self._engine_stream())

    def load(self, ns: Namespace, token_ids, n: int, block_id: int) -> bool:
        """Launch the load of the snapshot at block ``n`` of ``token_ids`` (``ns``: the
        request's namespace of the group) into block ``block_id``; False (nothing written)
        when it is not stored."""
        handle = self.states.load(token_ids, n, block_id, self._load_stream, ns=ns)
        if handle.matched_tokens:
            self._loads.append(handle)
        return bool(handle.matched_tokens)

    def wait_for_layer(self, layer: int) -> None:
        """The engine's stream waits for the step's loads: one launch moves every layer."""
        if self._cuda:
            for handle in self._loads:
                handle.wait_for_layer(0, self._engine_stream())

    def finish(self) -> None:
        """The engine's stream waits for every load of the step; the loads are forgotten
        (their leases go back as they land)."""
        self.wait_for_layer(0)
        self._loads = []

    def gather(self, req_id: str, ns: Namespace, token_ids, n: int, block_id: int) -> SaveJob:
        """Queue the copy-out of the snapshot at block ``n`` of ``token_ids`` from block
        ``block_id`` behind the step's forward pass; the job's put waits for its ``ready``
        event, the engine's next work for the block's read."""
        stream, engine = self._save_stream, self._engine_stream()  # (current: the engine's)
        with torch.cuda.stream(stream) if self._cuda else contextlib.nullcontext():
            if self._cuda:
                stream.wait_stream(engine)  # the forward pass that wrote the state
            pages, got = self.states.gather([(token_ids, n, block_id)], stream, ns=ns)
        if got.taken is not None:
            engine.wait_event(got.taken)
        return SaveJob(req_id, ns, pages[0], got.kv[0], 0, got.ready)

    def close(self) -> None:
        self.states.close()
