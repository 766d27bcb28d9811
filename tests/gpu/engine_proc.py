"""An engine-like process for the GPU tests: it registers a paged cache with a daemon on this
host, and saves or loads a seeded prefix through the daemon's CUDA IPC pool.

    python -m tests.gpu.engine_proc ROLE SOCKET SEED

ROLE is ``save``, ``load`` (prints ``loaded N ok``), ``race`` (writes its cache on a side
stream behind a long kernel, saves without a host synchronise, then reads the blocks back
through the daemon), ``die-after-acquire`` or ``die-after-reserve`` (exits abruptly mid-load or
mid-save, leaving its lease or reservation to the daemon's reaper).
"""

from __future__ import annotations

import os
import sys

import torch

from kvstore.api import Medium
from kvstore.client import Client
from kvstore.client.engine import EngineCache
from kvstore.keys import Namespace
from kvstore.spec import KVSpec

SPEC = KVSpec(num_layers=4, num_kv_heads=2, head_dim=64, block_tokens=16)
PAGES = 32
BLOCKS = 6


def namespace() -> Namespace:
    return Namespace(model_id="gpu-test", spec=SPEC, tenant="default")


def tokens(seed: int) -> list[int]:
    return [(seed * 7919 + i) % 50_000 for i in range(BLOCKS * SPEC.block_tokens)]


def blocks(seed: int) -> torch.Tensor:
    """The seeded K/V of the prefix: [BLOCKS, layers, 2, block_tokens, heads, dim]."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(BLOCKS, *SPEC.block_shape, generator=g).to(torch.bfloat16)


def cache() -> list[torch.Tensor]:
    shape = (2, PAGES, SPEC.block_tokens, SPEC.num_kv_heads, SPEC.head_dim)
    return [torch.full(shape, float("nan"), dtype=torch.bfloat16, device="cuda")
            for _ in range(SPEC.num_layers)]


def fill(caches: list[torch.Tensor], pages: list[int], data: torch.Tensor) -> None:
    for i, page in enumerate(pages):
        for layer, c in enumerate(caches):
            c[:, page].copy_(data[i, layer], non_blocking=True)


def main() -> int:
    role, socket, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    ns = namespace()
    data = blocks(seed)
    with Client(f"unix://{socket}") as client:
        caches = cache()
        engine = EngineCache(client, ns, caches)
        pages = list(range(3, 3 + 2 * BLOCKS, 2))
        if role == "save":
            fill(caches, pages, data)
            torch.cuda.synchronize()
            print("saved", engine.save(tokens(seed), pages), flush=True)
        elif role == "load":
            n = engine.load(tokens(seed), pages, layerwise=True).wait()
            got = torch.stack([torch.stack([c[:, p] for c in caches]) for p in pages]).cpu()
            print("loaded", n, "ok" if torch.equal(got[:n // SPEC.block_tokens],
                                                  data[:n // SPEC.block_tokens]) else "WRONG",
                  flush=True)
        elif role == "race":
            side = torch.cuda.Stream()
            with torch.cuda.stream(side):
                torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the cache is written
                fill(caches, pages, data)
            saved = engine.save(tokens(seed), pages, stream=side)  # no host synchronise
            kv = client.get(ns, tokens(seed))  # the daemon reads the slots it was handed
            want = data.permute(1, 2, 0, 3, 4, 5).reshape(SPEC.shape(BLOCKS * SPEC.block_tokens))
            print("raced", saved, "ok" if torch.equal(kv, want) else "WRONG", flush=True)
        elif role == "die-after-acquire":
            lease = client.acquire(ns, tokens(seed), lease_s=1.0, medium=Medium.DEVICE)
            print("acquired", lease.matched_tokens, flush=True)
            os._exit(3)
        elif role == "die-after-reserve":
            res = client.reserve(ns, tokens(seed), lease_s=1.0, medium=Medium.DEVICE)
            print("reserved", len(res.blocks), flush=True)
            os._exit(3)
    return 0


if __name__ == "__main__":
    sys.exit(main())
