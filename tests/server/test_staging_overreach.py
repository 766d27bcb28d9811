"""A tenant's writable staging arena: memory a client makes it hold outside the slots lent to
it (touching every page of its mapping, or allocating the file whole) is punched out and
charged, so the DRAM tier's memfds stay within its capacity and nobody is served wrong bytes."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time

import torch

from kvstore.client import Client

from ..conftest import REPO_ROOT, random_kv, random_tokens
from .helpers import DaemonThread, MiB, memfd_bytes, memfd_inodes, small_config

TOKENS = {"acme": "tok-acme", "zeta": "tok-zeta"}

# The tenant's client: stores 40 blocks zero-copy (so it maps its staging arena writable), then
# for each line on stdin touches every page of that mapping ("read": one read a page; "write":
# one write a page; "fallocate": allocates the whole file through its descriptor), prints
# "done", and keeps the mapping; at the end it checks its blocks read back right and stores
# more zero-copy.
_ATTACKER = """
import mmap, os, sys
from kvstore.client import Client
from kvstore.keys import Namespace
from kvstore.spec import KVSpec
from tests.conftest import random_kv, random_tokens
spec = KVSpec(num_layers={layers}, num_kv_heads={heads}, head_dim={dim}, block_tokens={bt})
ns = Namespace(model_id={model!r}, spec=spec, tenant="acme")
with Client({address!r}, token="tok-acme") as c:
    tokens, kv = random_tokens(16 * 40, seed=3), random_kv(spec, 16 * 40, seed=3)
    assert c.put(ns, tokens, kv, zero_copy=True) == 16 * 40
    maps = c._zero_copy.maps
    (region, mapped), = [(r, m) for (r, w), m in maps._maps.items() if w]
    fd = maps._fds[region]
    print("ready", flush=True)
    for line in sys.stdin:
        how = line.strip()
        if how == "end":
            break
        if how == "read":
            sum(mapped[i] for i in range(0, len(mapped), mmap.PAGESIZE))
        elif how == "write":
            for i in range(0, len(mapped), mmap.PAGESIZE):
                mapped[i] = mapped[i]
        elif how == "fallocate":
            try:
                os.posix_fallocate(fd, 0, len(mapped))
            except OSError:
                pass
        print("done", flush=True)
    assert c.get(ns, tokens, zero_copy=False).equal(kv)
    tokens, kv = random_tokens(16 * 40, seed=4), random_kv(spec, 16 * 40, seed=4)
    assert c.put(ns, tokens, kv, zero_copy=True) == 16 * 40  # its staging still lent, right
    assert c.get(ns, tokens, zero_copy=False).equal(kv)
"""


def _attacker(spec, ns, address: str) -> subprocess.Popen:
    path = os.pathsep.join(filter(None, (str(REPO_ROOT), os.environ.get("PYTHONPATH"))))
    script = _ATTACKER.format(layers=spec.num_layers, heads=spec.num_kv_heads,
                              dim=spec.head_dim, bt=spec.block_tokens, model=ns.model_id,
                              address=address)
    return subprocess.Popen([sys.executable, "-c", script], cwd=REPO_ROOT, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": path})


def _ask(process: subprocess.Popen, line: str) -> str:
    process.stdin.write(line + "\n")
    process.stdin.flush()
    return process.stdout.readline().strip()


def _settles(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def test_a_client_touching_its_whole_staging_mapping_holds_no_more_than_was_lent(root, ns,
                                                                                spec):
    """Attack (issue 28, item 4): acme's client maps its staging arena (the tier's whole
    capacity of address space) and touches every page of it, reading, writing, then
    allocating the file whole through its descriptor. Regression: the arena's memfd then held
    the whole capacity outside the budget (16 MiB lent 1 MiB: 16 MiB staging beside the
    published memory). Now the daemon punches out every range of the arena it did not lend
    and charges what it could not free yet: the daemon's memfds come back within the
    capacity, the tier keeps serving zeta, and both tenants read back what they stored."""
    capacity = 16 * MiB
    others = memfd_inodes()  # of daemons earlier tests in this process left behind
    config = small_config(root, dram_bytes=capacity, tenant_tokens=TOKENS)
    zeta_ns = dataclasses.replace(ns, tenant="zeta")
    with DaemonThread(config) as daemon, Client(daemon.unix_address, token="tok-zeta") as zeta:
        dram = daemon.store.tiers["dram"]
        attacker = _attacker(spec, ns, daemon.unix_address)
        try:
            assert attacker.stdout.readline().strip() == "ready"
            for round_, how in enumerate(("read", "write", "fallocate")):
                assert _ask(attacker, how) == "done"
                peak = memfd_bytes(others)
                settled = _settles(lambda: memfd_bytes(others) <= capacity)
                extra = dram.stats().extra
                print(f"{how}: {peak / MiB:.1f} MiB right after, {memfd_bytes(others) / MiB:.1f} "
                      f"MiB settled against {capacity / MiB:.0f}; staging lent "
                      f"{extra['staging_bytes'] / MiB:.1f} MiB, charged outside "
                      f"{extra.get('staging_outside_bytes', 0)}")
                assert settled, (how, memfd_bytes(others))
                assert extra["arena_bytes"] <= capacity
                tokens = random_tokens(16 * 40, seed=10 + round_)
                kv = random_kv(spec, 16 * 40, seed=10 + round_)
                assert zeta.put(zeta_ns, tokens, kv, zero_copy=True) == 16 * 40
                for zero_copy in (True, False):
                    got = zeta.get(zeta_ns, tokens, zero_copy=zero_copy)
                    assert torch.equal(got, kv[:, :, : got.shape[2]])
            assert _ask(attacker, "end") == ""
            assert attacker.wait(timeout=60) == 0
        finally:
            if attacker.poll() is None:
                attacker.kill()
                attacker.wait()
