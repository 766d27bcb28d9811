"""The vLLM connector's state groups on a GPU cache (``vllm_states``) against a real daemon:
caches laid out exactly as vLLM 0.32 and 0.26 register a Mamba hybrid's tensors on CUDA (one
buffer per layer shared by the attention and the state group, a state block's parts back to
back in a padded page), forced through the GPU path (CPU tensors through Triton's interpreter
without CUDA, as test_vllm_groups.py's GPU test does): snapshots saved and loaded bit for bit
into other block ids, a missing one failing the load without writing the block, and layouts
vLLM does not register refused by name."""

from __future__ import annotations

import dataclasses
import shutil

import numpy as np
import pytest
import torch

from kvstore.client import Client
from kvstore.codecs.triton.common import kernels_runnable
from kvstore.config import DramConfig, HbmConfig, TierConfig
from kvstore.errors import InvalidArgument
from kvstore.groups import CacheGroup, CacheSpec
from kvstore.integrations.vllm_groups import GroupedTransfers
from kvstore.integrations.vllm_kernels import KernelTransfers
from kvstore.keys import Namespace
from tests.server.helpers import DaemonThread, short_tmpdir, small_config

DEVICE = "cuda:0" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not kernels_runnable(torch.device(DEVICE)),
                                reason="needs CUDA or TRITON_INTERPRET=1")
MiB = 1 << 20
BT, HEADS, HEAD_DIM, LAYERS, BLOCKS = 32, 2, 32, 2, 12
PAGE = HEADS * BT * 2 * HEAD_DIM * 2  # an attention block of one layer, bf16: 8 KiB
CONV, SSM = ((3, 64), torch.bfloat16), ((2, 16, 16), torch.float32)  # 384 + 2048 bytes
STATE_BYTES = 3 * 64 * 2 + 2 * 16 * 16 * 4
FULL = CacheGroup.attention(LAYERS, HEADS, HEAD_DIM, "bfloat16", name="full")
MAMBA = CacheGroup.state(LAYERS, {"state0": ((3, 64), "bfloat16"),
                                  "state1": ((2, 16, 16), "float32")}, name="mamba")
ENGINE = Namespace(model_id="qwen3-next", revision="r1", extra_salt="vllm/cuda",
                   spec=CacheSpec((MAMBA, FULL), BT))
REQUEST = dataclasses.replace(ENGINE, extra_salt="vllm/cuda/salt")  # a request's own
TOKENS = np.arange(3, 3 + 4 * BT, dtype=np.uint32)  # 4 blocks
SENTINEL = 0x5A
STATE_BLOCK = 8  # blocks from here on hold states in the sources (one pool: ids never shared)


def config_for(root, tiers: str):
    """``host``: the daemon lends no device pool (pages over put and get); ``hbm``: a
    device tier first (host memory for CPU tensors, the daemon in this process)."""
    config = small_config(root, dram_bytes=32 * MiB)
    if tiers == "host":
        return config
    return dataclasses.replace(config, tiers=(
        TierConfig("gpu", "hbm", HbmConfig(capacity_bytes=4 * MiB, device=DEVICE)),
        TierConfig("host", "dram", DramConfig(capacity_bytes=8 * MiB, chunk_bytes=MiB)),
    ))


@pytest.fixture(params=["host", "hbm"])
def client(request):
    root = short_tmpdir()
    try:
        with DaemonThread(config_for(root, request.param)) as daemon, \
                Client(daemon.unix_address) as kv:
            yield kv
    finally:
        shutil.rmtree(root, ignore_errors=True)


def raw_cache(seed: int | None, version: str) -> torch.Tensor:
    """The engine's int8 backing buffer: vLLM 0.32's default block-outermost packing
    ``[num_blocks, layers, page]``, 0.26's one buffer per layer ``[layers, num_blocks,
    page]``; random bytes, or the sentinel."""
    shape = (BLOCKS, LAYERS, PAGE) if version == "0.32" else (LAYERS, BLOCKS, PAGE)
    if seed is None:
        return torch.full(shape, SENTINEL, dtype=torch.int8, device=DEVICE)
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(-128, 128, shape, generator=g, dtype=torch.int8)
    for layer in range(LAYERS):  # finite K/V in the attention blocks (the daemon checks)
        kv = layer_page(raw, version, layer)[:STATE_BLOCK].view(torch.bfloat16)
        kv[~torch.isfinite(kv)] = 0
    return raw.to(DEVICE)  # the state blocks keep every byte pattern, NaNs too


def layer_page(raw: torch.Tensor, version: str, layer: int) -> torch.Tensor:
    """Layer ``layer``'s ``[num_blocks, page]`` bytes."""
    return raw[:, layer] if version == "0.32" else raw[layer]


def registered(raw: torch.Tensor, version: str) -> tuple[list, list]:
    """(attention layers, state layers) as vLLM registers them on CUDA, over ``raw``."""
    attention, states = [], []
    for layer in range(LAYERS):
        pages = layer_page(raw, version, layer)
        # [B, N, H, 2D] memory seen as the backends' logical [B, H, N, 2D]
        attention.append(pages.view(torch.bfloat16).view(BLOCKS, BT, HEADS, 2 * HEAD_DIM)
                         .permute(0, 2, 1, 3))
        if version == "0.32":  # create_kv_cache_views: int8 [B, 1, 1, C] over the page
            states.append(torch.as_strided(pages, (BLOCKS, 1, 1, STATE_BYTES),
                                           (pages.stride(0), STATE_BYTES, STATE_BYTES, 1)))
        else:  # _reshape_kv_cache_tensors: each part as_strided at its offset in the page
            parts, at = [], 0
            for shape, dtype in (CONV, SSM):
                size = dtype.itemsize
                parts.append(torch.as_strided(
                    pages.view(dtype), (BLOCKS, *shape),
                    (PAGE // size, *torch.empty(shape).stride()),
                    (pages.storage_offset() + at) // size))
                at += int(np.prod(shape)) * size
            states.append(parts)
    return attention, states


def state_bytes(raw: torch.Tensor, version: str, block: int) -> torch.Tensor:
    """Every layer's state bytes of ``block`` (and nothing of the page's padding)."""
    return torch.cat([layer_page(raw, version, layer)[block, :STATE_BYTES].cpu()
                      for layer in range(LAYERS)])


def transfers(client: Client, raw: torch.Tensor, version: str) -> GroupedTransfers:
    attention, states = registered(raw, version)

    def kernels(group, gns, tensors):  # the GPU path, as GroupedTransfers.of on CUDA
        return KernelTransfers(client, gns, tensors)

    return GroupedTransfers(client, ENGINE, [states, attention], kernels)


def save(moved: GroupedTransfers, client: Client, ids: list[list[int]], n: int) -> int:
    jobs = 0
    for _, gather in moved.gathers("r", REQUEST, TOKENS[:n * BT], ids, 0):
        job = gather()
        if job.ready is not None:  # CUDA: the copy into host memory landed
            job.ready.synchronize()
        client.put(job.ns, job.token_ids, job.kv, first_block=job.first_block)
        jobs += 1
    return jobs


def load(moved: GroupedTransfers, ids: list[list[int]], n: int) -> bool:
    moved.start()
    ok = moved.load(REQUEST, TOKENS[:n * BT], ids, 0)
    moved.finish()
    if DEVICE != "cpu":
        torch.cuda.synchronize()
    return ok


@pytest.mark.parametrize("version", ["0.32", "0.26"])
def test_a_snapshot_saved_from_one_block_loads_bit_exact_into_another(client, version):
    """The attention prefix (4 blocks) and the snapshot at 4 (in the state group's block
    n - 1 = 3rd of its table) are stored under the request's namespace; a fresh cache loads
    both into other block ids: the state bytes of every layer are the source block's, NaN
    patterns and all, and no other block is written."""
    src = raw_cache(0, version)
    moved = transfers(client, src, version)
    state_ids, full_ids = [8, 9, 10, 11], [1, 2, 3, 4]  # one pool: the groups' ids differ
    assert save(moved, client, [state_ids, full_ids], 4) == 2  # one prefix piece, one page
    assert client.stats().num_blocks == 4 + 1
    assert client.lookup(REQUEST, TOKENS).matched_tokens == 4 * BT
    assert client.lookup(ENGINE, TOKENS).matched_tokens == 0  # the request's own salt

    dst = raw_cache(None, version)
    loader = transfers(client, dst, version)
    assert load(loader, [[0, 0, 0, 7], [2, 3, 5, 6]], 4)
    assert torch.equal(state_bytes(dst, version, 7), state_bytes(src, version, 11))
    attention_src, _ = registered(src, version)
    attention_dst, _ = registered(dst, version)
    for s, d in zip(attention_src, attention_dst, strict=True):
        assert torch.equal(d[[2, 3, 5, 6]].cpu(), s[full_ids].cpu())
    for block in (0, 1, 4, 8, 9, 10, 11):
        assert bool((layer_page(dst, version, 0)[block] == SENTINEL).all())
    moved.close()
    loader.close()


@pytest.mark.parametrize("version", ["0.32", "0.26"])
def test_a_missing_snapshot_fails_the_load_and_never_writes_the_block(client, version):
    """The snapshot at 4 is stored, the one at 3 is not: a load of 3 blocks reports
    failure (vLLM recomputes the request) and the state block keeps its sentinel bytes."""
    src = raw_cache(1, version)
    moved = transfers(client, src, version)
    save(moved, client, [[8, 9, 10, 11], [1, 2, 3, 4]], 4)
    dst = raw_cache(None, version)
    loader = transfers(client, dst, version)
    assert not load(loader, [[0, 0, 7], [2, 3, 5]], 3)
    assert bool((state_bytes(dst, version, 7) == SENTINEL).all())
    assert load(loader, [[0, 0, 0, 7], [2, 3, 5, 6]], 4)  # the stored one does load
    assert torch.equal(state_bytes(dst, version, 7), state_bytes(src, version, 11))
    moved.close()
    loader.close()


def test_a_snapshot_saved_from_a_gpu_block_is_the_cpu_paths_page(client):
    """The page the GPU path stores is byte for byte the one vLLM's CPU path
    (``vllm_copies.gather_state``) makes of the same state: the two paths share pages."""
    from kvstore.integrations.vllm_copies import gather_state

    src = raw_cache(2, "0.32")
    moved = transfers(client, src, "0.32")
    jobs = [gather() for _, gather in moved.gathers("r", REQUEST, TOKENS, [[8, 9, 10, 11],
                                                                           [1, 2, 3, 4]], 0)]
    state = next(job for job in jobs if job.ns == REQUEST.group(0))
    if state.ready is not None:
        state.ready.synchronize()
    rows = [layer_page(src, "0.32", layer).view(torch.uint8)[:, :STATE_BYTES].cpu()
            for layer in range(LAYERS)]
    assert torch.equal(state.kv.view(torch.uint8).cpu(),
                       gather_state(rows, REQUEST.group(0).spec, 11).view(torch.uint8))
    moved.close()


def test_state_layouts_vllm_does_not_register_are_refused_by_name(client):
    raw = raw_cache(None, "0.32")
    attention, states = registered(raw, "0.32")

    def build(layers):
        return GroupedTransfers(client, ENGINE, [layers, attention],
                                lambda group, gns, tensors: KernelTransfers(client, gns, tensors))

    short = [t[..., :STATE_BYTES - 8] for t in states]  # C is not the state's bytes
    with pytest.raises(InvalidArgument, match="state group 'mamba' layer 0: cache"):
        build(short)
    _, parts = registered(raw_cache(None, "0.26"), "0.26")
    swapped = [[p[1], p[0]] for p in parts]  # the SSM state first
    with pytest.raises(InvalidArgument, match="layer 0 part state0: found"):
        build(swapped)
    apart = [[p[0], p[1][:, :, :, :8]] for p in parts]  # a state not contiguous
    with pytest.raises(InvalidArgument, match="part state1: found .* contiguous"):
        build(apart)
    with pytest.raises(InvalidArgument, match="registered a dict"):
        build([{"conv": p[0], "ssm": p[1]} for p in parts])


def test_grouped_transfers_of_takes_vllm_0_26_state_lists_and_refuses_them_on_the_cpu(client):
    """Regression: ``GroupedTransfers.of`` read the first registered layer's device, and
    vLLM 0.26 registers a state layer as a list of its parts (an AttributeError, not an
    answer). Now a list says which device its parts are on; on the CPU, where vLLM's CPU
    backend registers int8 pages, it is refused by name."""
    from types import SimpleNamespace

    _, states = registered(raw_cache(None, "0.26"), "0.26")
    attention, _ = registered(raw_cache(None, "0.32"), "0.32")
    names = [[f"model.layers.{i}.linear_attn" for i in (0, 2)],
             [f"model.layers.{i}.self_attn.attn" for i in (1, 3)]]
    config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(layer_names=n) for n in names])
    kv_caches = {**dict(zip(names[0], states)), **dict(zip(names[1], attention))}
    if DEVICE == "cpu":
        with pytest.raises(InvalidArgument, match="state group 'mamba' layer 0: registered "
                                                  "a list"):
            GroupedTransfers.of(client, ENGINE, kv_caches, config)
    else:
        GroupedTransfers.of(client, ENGINE, kv_caches, config).close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="stream order needs CUDA")
def test_a_gpu_save_reads_the_blocks_after_the_step_and_before_the_next_one(client):
    """Regression (not reproducible without CUDA): a GPU save made its stream wait on the
    current stream while the save stream was current, which orders nothing, so the copy out
    could read the blocks before the step's forward pass wrote them. Now a save's copy runs
    after what the engine queued before ``wait_for_save``, and the engine's next step waits
    for the read of a state block (vLLM may hand it to another request): both groups' pages
    hold the step's bytes, not the sentinel and not the next step's."""
    raw = raw_cache(None, "0.32")
    moved = transfers(client, raw, "0.32")
    torch.cuda._sleep(200_000_000)  # the step's forward pass, still running when saved ...
    for layer in range(LAYERS):
        layer_page(raw, "0.32", layer)[1:5].fill_(1)  # ... writes the attention blocks
        layer_page(raw, "0.32", layer)[11, :STATE_BYTES].fill_(2)  # ... and the state
    jobs = [gather() for _, gather in moved.gathers("r", REQUEST, TOKENS,
                                                    [[8, 9, 10, 11], [1, 2, 3, 4]], 0)]
    for layer in range(LAYERS):  # the next step: the state block is another request's
        layer_page(raw, "0.32", layer)[11, :STATE_BYTES].fill_(3)
    for job in jobs:
        job.ready.synchronize()
    state = next(job for job in jobs if job.ns == REQUEST.group(0))
    attention = next(job for job in jobs if job.ns == REQUEST.group(1))
    assert bool((state.kv.view(torch.uint8).reshape(LAYERS, -1)[:, :STATE_BYTES] == 2).all())
    assert bool((attention.kv.view(torch.uint8) == 1).all())
    moved.close()
