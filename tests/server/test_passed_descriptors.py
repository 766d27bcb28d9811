"""Descriptors a client passes on: memory of published steps given to a process the daemon
never saw stays within the DRAM tier's budget once the daemon gives the steps back."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys

import torch

from kvstore.client import Client
from kvstore.page import PUBLISHED_HEADER_BYTES

from ..conftest import REPO_ROOT, random_kv, random_tokens
from .helpers import DaemonThread, MiB, memfd_bytes, memfd_inodes, small_config

TOKENS = {"acme": "tok-acme", "zeta": "tok-zeta"}

# The tenant's client: stores 200 blocks, reads them zero-copy (so it is sent the descriptors of
# the steps they lie in), hands every descriptor on to another process over a Unix socket
# (SCM_RIGHTS), then exits: the daemon can see nobody holding them any more.
_CLIENT = """
import os, socket, sys
from kvstore.client import Client
from kvstore.keys import Namespace
from kvstore.spec import KVSpec
from tests.conftest import random_kv, random_tokens
spec = KVSpec(num_layers={layers}, num_kv_heads={heads}, head_dim={dim}, block_tokens={bt})
ns = Namespace(model_id={model!r}, spec=spec, tenant="acme")
passing = socket.socket(fileno=int(sys.argv[1]))
with Client({address!r}, token="tok-acme") as c:
    tokens, kv = random_tokens(16 * 200), random_kv(spec, 16 * 200)
    c.put(ns, tokens, kv, zero_copy=False)
    assert c.get(ns, tokens, zero_copy=True).equal(kv)
    maps = c._zero_copy.maps
    for region in maps.regions:
        socket.send_fds(passing, [region.encode()], [maps._fds[region]])
    passing.send(b"")
"""

# The process it passes them to: maps every descriptor whole, reads every page, and keeps them;
# for each "?" line on stdin it prints the memory each memfd holds (the kernel's block count)
# and whether its header says retired.
_HOLDER = """
import json, mmap, os, socket, sys
passing = socket.socket(fileno=int(sys.argv[1]))
kept = {}
while True:
    name, fds, _, _ = socket.recv_fds(passing, 256, 1)
    if not name:
        break
    mapped = mmap.mmap(fds[0], os.fstat(fds[0]).st_size, prot=mmap.PROT_READ)
    sum(mapped[i] for i in range(0, len(mapped), mmap.PAGESIZE))
    kept[name.decode()] = (fds[0], mapped)
print(json.dumps(sorted(kept)), flush=True)
for _ in sys.stdin:
    print(json.dumps({name: [os.fstat(fd).st_blocks * 512, mapped[8] == 1]
                      for name, (fd, mapped) in kept.items()}), flush=True)
"""


def _python(script: str, passing: socket.socket) -> subprocess.Popen:
    path = os.pathsep.join(filter(None, (str(REPO_ROOT), os.environ.get("PYTHONPATH"))))
    return subprocess.Popen([sys.executable, "-c", script, str(passing.fileno())],
                            pass_fds=[passing.fileno()], cwd=REPO_ROOT, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": path})


def test_steps_passed_to_a_process_the_daemon_cannot_see_are_freed_when_given_back(
        root, ns, spec):
    """Attack (issue 28, item 4): acme's client passes the descriptors of its published steps
    to a second process and exits; that process keeps them mapped. The daemon empties acme's
    steps and gives them to zeta. Regression: the daemon looked for holders only among the
    processes it had sent descriptors to, so the second process kept every given-back step's
    memory outside the budget and outside ``lingering_bytes`` (112 MiB, 176 MiB in use against
    64 MiB). Now a step going back is cut down to its header page: what the daemon's memfds
    hold plus what the second process still holds of the steps given back stays within the
    capacity, and zeta reads back what it stored."""
    capacity = 4 * MiB
    others = memfd_inodes()  # of daemons earlier tests left to the collector
    config = small_config(root, dram_bytes=capacity, tenant_tokens=TOKENS)
    zeta_ns = dataclasses.replace(ns, tenant="zeta")
    thread = DaemonThread(config)
    with thread as daemon, Client(daemon.unix_address, token="tok-zeta") as zeta:
        dram = daemon.store.tiers["dram"]
        to_client, to_holder = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        holder = _python(_HOLDER, to_holder)
        client = _python(_CLIENT.format(layers=spec.num_layers, heads=spec.num_kv_heads,
                                        dim=spec.head_dim, bt=spec.block_tokens,
                                        model=ns.model_id, address=daemon.unix_address),
                         to_client)
        to_client.close()
        to_holder.close()
        try:
            assert client.wait(timeout=120) == 0
            passed = set(json.loads(holder.stdout.readline()))
            steps = passed & set(dram.published_regions("acme"))
            assert steps, passed
            assert thread.call(daemon.store.evict(tenant="acme")) == 200
            tokens, kv = random_tokens(16 * 400, seed=5), random_kv(spec, 16 * 400, seed=5)
            zeta.put(zeta_ns, tokens, kv, zero_copy=False)
            given_back = steps - set(dram.published_regions("acme"))
            assert given_back

            holder.stdin.write("?\n")
            holder.stdin.flush()
            held = json.loads(holder.stdout.readline())
            outside = sum(held[region][0] for region in given_back)
            in_use = memfd_bytes(others) + outside
            print(f"{len(given_back)} steps given back; the holder keeps {outside} bytes of "
                  f"them; in use {in_use / MiB:.2f} MiB against {capacity / MiB:.0f} MiB; "
                  f"lingering {dram.stats().extra['lingering_bytes']}")
            assert all(held[region][1] for region in given_back)  # their headers say so
            assert outside <= len(given_back) * PUBLISHED_HEADER_BYTES
            assert in_use <= capacity + len(given_back) * PUBLISHED_HEADER_BYTES
            assert dram.stats().extra["arena_bytes"] <= capacity
            for zero_copy in (True, False):
                got = zeta.get(zeta_ns, tokens, zero_copy=zero_copy)
                assert torch.equal(got, kv[:, :, : got.shape[2]])  # zero-copy: what DRAM holds
        finally:
            holder.stdin.close()
            holder.wait(timeout=30)
            if client.poll() is None:
                client.kill()
