"""State snapshots (``EngineStates``) and window-only loads (``WindowCache``) between an engine's
tensors and a real daemon, through its device pool or host memory. Without CUDA the kernels
run in Triton's interpreter and the device pool is host memory (the daemon runs in this
process)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvstore.client import Client
from kvstore.client.engine import EngineCache
from kvstore.client.engine_states import EngineStates
from kvstore.client.engine_windows import WindowCache
from kvstore.client.groups import GroupCache
from kvstore.client.snapshot_pages import snapshot_ids
from kvstore.codecs.triton.common import kernels_runnable
from kvstore.config import DramConfig, HbmConfig, TierConfig
from kvstore.errors import InvalidArgument
from kvstore.groups import CacheGroup, CacheSpec
from kvstore.keys import Namespace

from ..server.helpers import DaemonThread, rpc_calls, small_config, wait_for

DEVICE = "cuda:0" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not kernels_runnable(torch.device(DEVICE)),
                                reason="needs CUDA or TRITON_INTERPRET=1")
MiB = 1 << 20
BLOCK, SLOTS, PAGES, HEADS, DIM = 16, 4, 8, 2, 16
MAMBA = CacheGroup.state(2, {"conv": ((8, 3), "bfloat16"), "ssm": ((2, 4, 8), "float32")},
                         name="mamba")
ATTENTION = CacheGroup.attention(2, HEADS, DIM, name="full")
WINDOW = CacheGroup.attention(2, HEADS, DIM, window_tokens=24, name="sliding")
HYBRID = Namespace(model_id="hybrid", spec=CacheSpec((ATTENTION, MAMBA, WINDOW), BLOCK))
TOKENS = list(range(300, 300 + 5 * BLOCK + 3))  # five whole blocks


def config_for(tmp_path, tiers: str):
    config = small_config(tmp_path)
    if tiers == "host":
        return config
    return dataclasses.replace(config, tiers=(
        TierConfig("gpu", "hbm", HbmConfig(capacity_bytes=4 * MiB, device=DEVICE)),
        TierConfig("host", "dram", DramConfig(capacity_bytes=8 * MiB, chunk_bytes=MiB)),
    ))


def state_slots(fill: int | None = None) -> list[dict[str, torch.Tensor]]:
    out = []
    for _ in range(MAMBA.num_layers):
        layer = {}
        for part in MAMBA.parts:
            n = SLOTS * part.nbytes
            raw = torch.randint(0, 256, (n,), dtype=torch.uint8) if fill is None else \
                torch.full((n,), fill, dtype=torch.uint8)
            layer[part.name] = raw.view(part.torch_dtype).view(SLOTS, *part.shape).to(DEVICE)
        out.append(layer)
    return out


def slot_bytes(states: list[dict[str, torch.Tensor]], slot: int) -> torch.Tensor:
    return torch.cat([t[slot].reshape(-1).view(torch.uint8).cpu() for layer in states
                      for t in layer.values()])


def paged(fill: float | None = None) -> list[torch.Tensor]:
    """FlashAttention's [2, PAGES, BLOCK, H, D] per layer."""
    shape = (2, PAGES, BLOCK, HEADS, DIM)
    return [torch.full(shape, fill, dtype=torch.bfloat16, device=DEVICE) if fill is not None
            else torch.randn(shape, device=DEVICE).to(torch.bfloat16) for _ in range(2)]


@pytest.mark.parametrize("tiers", ["hbm", "host"])
def test_state_snapshots_round_trip_bit_exact_and_make_the_hit_whole(tmp_path, tiers):
    with DaemonThread(config_for(tmp_path, tiers)) as daemon, \
            Client(daemon.unix_address) as client:
        src = state_slots()
        saver = EngineStates(client, HYBRID, 1, src)
        assert saver.save(TOKENS, 2, slot=3)  # the state after two blocks, in slot 3
        assert not saver.save(TOKENS, 2, slot=3)  # stored already
        assert saver.save_many([(TOKENS, 4, 1), (TOKENS, 5, 2)]) == 2  # one launch for both
        dst = state_slots(fill=0x5A)
        loader = EngineStates(client, HYBRID, 1, dst)
        assert loader.load(TOKENS, 2, slot=0).wait() == 2 * BLOCK
        handle = loader.load_many([(TOKENS, 4, 3), (TOKENS, 5, 1)])
        assert handle.wait() == 5 * BLOCK
        for a, b in ((3, 0), (1, 3), (2, 1)):
            assert torch.equal(slot_bytes(src, a), slot_bytes(dst, b))
        assert bool((slot_bytes(dst, 2) == 0x5A).all())  # a slot outside the loads
        assert loader.load(TOKENS, 3, slot=2).wait() == 0  # no snapshot at block 3
        assert bool((slot_bytes(dst, 2) == 0x5A).all())

        # the page is the state group's: the group unpacks it into the slot's tensors
        gns = HYBRID.group(1)
        stored = client.get(gns, snapshot_ids(gns, TOKENS, [1])[0])
        parts = MAMBA.unpack(stored, BLOCK)
        for layer in range(MAMBA.num_layers):
            for name, t in parts.items():
                assert torch.equal(t[layer].contiguous().view(torch.uint8),
                                   src[layer][name][3].cpu().view(torch.uint8))  # NaNs too
        # with the attention prefix and the window of 2 blocks stored, the grouped lookup
        # finds a hit of two blocks: every group is whole there (no snapshot at 3)
        attention = EngineCache(client, HYBRID.group(0), paged())
        assert attention.save(TOKENS, [0, 1, 2, 3, 4]) == 5 * BLOCK
        window = WindowCache(client, HYBRID, 2, paged())
        assert window.save(TOKENS[:2 * BLOCK], [0, 1]) == 2
        assert client.lookup(HYBRID, TOKENS[:3 * BLOCK]).matched_tokens == 2 * BLOCK
        for cache in (saver, loader, attention, window):
            cache.close()
        assert client.stats().active_leases == 0


@pytest.mark.parametrize("tiers", ["hbm", "host"])
def test_a_window_load_writes_and_acquires_only_the_windows_blocks(tmp_path, tiers):
    """Window of 24 tokens over five blocks of 16: blocks 3 and 4. The load writes those two
    engine pages only (the rest keep their NaN sentinel) and asks the daemon for their two
    pages only; the pages a GroupCache saved from host tensors are the same pages."""
    with DaemonThread(config_for(tmp_path, tiers)) as daemon, \
            Client(daemon.unix_address) as client:
        src = paged()
        saver = WindowCache(client, HYBRID, 2, src)
        src_ids = [7, 1, 6, 2, 5]  # blocks 0-2 may be vLLM's null block: never read
        before = rpc_calls(daemon, "Reserve") + rpc_calls(daemon, "Put")
        assert saver.save(TOKENS, src_ids) == 2
        assert rpc_calls(daemon, "Reserve") + rpc_calls(daemon, "Put") - before <= 3  # + probe
        dst = paged(float("nan"))
        loader = WindowCache(client, HYBRID, 2, dst)
        dst_ids = [0, 3, 4, 6, 1]
        reads = ("Acquire", "Get")
        before = sum(rpc_calls(daemon, m) for m in reads)
        handle = loader.load(TOKENS, dst_ids)
        assert handle.wait() == 5 * BLOCK
        probe = tiers == "host"  # the first device-pool acquire, refused: no pool there
        assert sum(rpc_calls(daemon, m) for m in reads) - before == 2 + probe  # 2 pages
        assert client.stats().num_blocks == 2  # (nothing before the window was ever stored)
        for a, b in zip(src, dst):
            assert torch.equal(a[:, [2, 5]], b[:, [6, 1]])
            assert bool(torch.isnan(b[:, [0, 2, 3, 4, 5, 7]]).all())
        # GroupCache reads the same pages as the window of its load ...
        got = GroupCache(client, HYBRID).load(TOKENS, 5)
        assert got is None  # (the attention and state groups are not stored) ...
        gns = HYBRID.group(2)
        for block, page in zip((3, 4), (2, 5)):
            stored = client.get(gns, snapshot_ids(gns, TOKENS, [block])[0])
            parts = WINDOW.unpack(stored, BLOCK)
            for layer, t in enumerate(src):
                assert torch.equal(parts["k"][layer].to(t.device), t[0, page])
                assert torch.equal(parts["v"][layer].to(t.device), t[1, page])
        # ... and a window of a longer prefix, with a block missing, loads nothing at all
        longer = TOKENS + list(range(900, 900 + 2 * BLOCK))
        assert loader.load(longer, [0, 3, 4, 6, 1, 2, 5]).wait() == 0
        assert bool(torch.isnan(dst[0][:, [2, 5]]).all())
        saver.close()
        loader.close()
        assert client.stats().active_leases == 0


@pytest.mark.parametrize("tiers", ["hbm", "host"])
def test_a_gathered_snapshot_is_put_under_a_request_namespace_and_loads_back(tmp_path, tiers):
    """``EngineStates.gather`` copies a slot's snapshot into host memory for a put on
    another thread; keyed under a request's own namespace of the group (``ns=``), it is that
    namespace's page alone, loads back bit-exact through it, and a namespace of another
    geometry is refused."""
    with DaemonThread(config_for(tmp_path, tiers)) as daemon, \
            Client(daemon.unix_address) as client:
        src = state_slots()
        states = EngineStates(client, HYBRID, 1, src)
        salted = dataclasses.replace(HYBRID, extra_salt="request").group(1)
        pages, got = states.gather([(TOKENS, 3, 2)], ns=salted)
        if got.ready is not None:
            got.ready.synchronize()
        assert client.put(salted, pages[0], got.kv[0])
        assert states.load(TOKENS, 3, slot=0).wait() == 0  # not the engine's own page
        dst = state_slots(fill=0x5A)
        loader = EngineStates(client, HYBRID, 1, dst)
        assert loader.load(TOKENS, 3, slot=1, ns=salted).wait() == 3 * BLOCK
        assert torch.equal(slot_bytes(dst, 1), slot_bytes(src, 2))
        with pytest.raises(InvalidArgument, match="not the pages' of state group 'mamba'"):
            loader.load(TOKENS, 3, slot=1, ns=HYBRID.group(0))
        for cache in (states, loader):
            cache.close()
        # the get's lease goes back on its own within RELEASE_LINGER_S
        assert wait_for(lambda: client.stats().active_leases == 0)
