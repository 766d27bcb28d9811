"""Pages an earlier build wrote to SSD still read: tests/data/pages_v0 holds an SSD tier (segments
and LMDB index) with one prefix stored raw and as fp8_e4m3+zstd, and what a get returned then."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from kvstore.config import DramConfig, KVStoreConfig, SsdConfig
from kvstore.keys import Namespace
from kvstore.spec import KVSpec
from kvstore.store import Store

DATA = Path(__file__).parent.parent / "data" / "pages_v0"
SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, block_tokens=16, dtype="bfloat16")


def _copy_tier(src: Path, dst: Path) -> str:
    shutil.copytree(src, dst)
    for root, dirs, files in os.walk(dst):
        os.chmod(root, 0o700)
        for name in files:
            os.chmod(os.path.join(root, name), 0o600)
    return str(dst)


@pytest.mark.parametrize("codec", ["raw", "fp8_e4m3+zstd"])
async def test_an_ssd_tier_written_by_an_earlier_build_reads_bit_exact(tmp_path, codec):
    name = codec.replace("+", "_")
    path = _copy_tier(DATA / f"ssd_{name}", tmp_path / "ssd")
    stored = torch.load(DATA / "input.pt")
    expected = torch.load(DATA / f"expected_{name}.pt")
    ns = Namespace(model_id="golden/model", revision="r1", spec=SPEC, tenant="acme")
    config = KVStoreConfig(
        dram=DramConfig(capacity_bytes=8 << 20, chunk_bytes=1 << 20),
        ssd=SsdConfig(path=path, capacity_bytes=64 << 20, segment_bytes=1 << 20, codec=codec,
                      admit_after_accesses=0, fsync="never", o_direct=False))
    async with Store(config) as store:
        hit = await store.lookup(ns, stored["tokens"])
        assert hit.matched_tokens == 48
        got = await store.get(ns, stored["tokens"])
    assert torch.equal(got, expected)
    if codec == "raw":
        assert torch.equal(got, stored["kv"])
    other = Namespace(model_id="golden/model", revision="r2", spec=SPEC, tenant="acme")
    async with Store(config) as store:
        assert (await store.lookup(other, stored["tokens"])).matched_tokens == 0
