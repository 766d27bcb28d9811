"""A client killed while it holds a lease: the lease expires and its blocks become evictable."""

from __future__ import annotations

import asyncio
import os
import sys
import time

from kvstore.keys import block_keys

from ..conftest import random_kv, random_tokens
from .helpers import REPO_ROOT

HOLDER = """
import sys, time
from kvstore.client import Client
from kvstore.keys import Namespace
from kvstore.spec import KVSpec
spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, block_tokens=16)
ns = Namespace(model_id="test/model", spec=spec, revision="r1", tenant="acme")
tokens = [int(t) for t in sys.argv[2].split(",")]
client = Client(sys.argv[1])
lease = client.acquire(ns, tokens, lease_s=1.0)
print(lease.matched_tokens, flush=True)
time.sleep(600)
"""


async def test_killed_lease_holder(daemon, aclient, ns, spec):
    tokens = random_tokens(32)
    await aclient.put(ns, tokens, random_kv(spec, 32), zero_copy=False)
    keys = block_keys(ns, tokens)
    holder = await asyncio.create_subprocess_exec(
        sys.executable, "-c", HOLDER, daemon.unix_address, ",".join(map(str, tokens)),
        cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        stdout=asyncio.subprocess.PIPE)
    try:
        line = await asyncio.wait_for(holder.stdout.readline(), timeout=60)
        assert line.strip() == b"32"
        assert (await aclient.stats()).active_leases == 1
        assert await aclient.evict(keys=keys) == 0  # pinned while the lease lives
    finally:
        holder.kill()
        await holder.wait()
    deadline = time.monotonic() + 10
    while (await aclient.stats()).active_leases and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert (await aclient.stats()).active_leases == 0
    assert await aclient.evict(keys=keys) == 2
    assert (await aclient.lookup(ns, tokens)).matched_tokens == 0
