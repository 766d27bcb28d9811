"""Connection floods on every port of a real daemon (issue 28, item 5) while a Unix client and
a TCP client with a token keep working: puts, lookups and gets succeed with exact bytes.

Each flood runs as a process of its own (``flooder.py``); the daemon runs with a lowered
descriptor limit where the flood must reach it. Before the fixes each of these failed: raw
TCP connections took the daemon's descriptors and Unix clients got UNAVAILABLE; preface-only
connections held the TCP port's every place; silent data-port connections made every
transfer fail; idle metrics connections held a thread and a descriptor each for good; a
descriptor-socket flood denied zero-copy. Timings are generous liveness bounds only.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import grpc
import torch

from kvstore.client import Client
from kvstore.keys import Namespace
from kvstore.rpc import framing
from kvstore.rpc import kvstore_pb2 as pb
from kvstore.rpc import kvstore_pb2_grpc as pbg
from kvstore.rpc.descriptors import fd_socket_path
from kvstore.spec import KVSpec

from ..server.helpers import REPO_ROOT
from ..server.hostile import daemon_process, free_port

TOKENS = {"acme": "tok-acme"}
SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, block_tokens=16)
NOFILE = (256, 512)  # the daemon's descriptor limit (soft, hard): a flood of 600 passes it
TIMEOUT_S = 5.0  # each client call's deadline: far above a healthy daemon's milliseconds


@contextlib.contextmanager
def flood(kind: str, address: str, count: int, mode: str, renew: bool = False
          ) -> Iterator[int]:
    """``count`` connections from another process (see flooder.py); yields how many opened."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.faults.flooder", kind, address, str(count), mode,
         *(["renew"] if renew else [])],
        cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().split()
        assert line[:1] == ["ready"], line
        yield int(line[1])
    finally:
        proc.kill()
        proc.wait(10)


def work(client: Client, seed: int, **kw) -> None:
    """A put, a lookup and a get of one prompt; the K/V comes back bit-exact."""
    ns = Namespace(model_id="floods", spec=SPEC, tenant="acme")
    tokens = [(seed * 7919 + i) % 50_000 for i in range(64)]
    kv = torch.randn(SPEC.shape(64)).to(torch.bfloat16)
    assert client.put(ns, tokens, kv, **kw) == 64
    assert client.lookup(ns, tokens).matched_tokens == 64
    got = client.get(ns, tokens, **kw)
    assert got is not None and torch.equal(got, kv)


def served(proc, field: str) -> int:
    return next(e for e in proc.events() if e["msg"] == "serving")[field]


def test_raw_tcp_flood_past_the_descriptor_limit(root):
    """600 raw TCP connections against a daemon whose soft limit is 256 (hard 512): the daemon
    raised its limit to 512 and logged both, its TCP port takes at most its share of the
    descriptors, and the Unix and TCP clients keep working throughout (before: the flood took
    every descriptor and Unix clients failed with UNAVAILABLE)."""
    with daemon_process(root, tcp_address="127.0.0.1:0", tenant_tokens=TOKENS,
                        nofile=NOFILE) as proc:
        with flood("tcp", proc.tcp_address(), 600, "raw") as opened:
            assert opened >= 500
            with Client(proc.address, timeout_s=TIMEOUT_S) as local, \
                    Client(proc.tcp_address(), token="tok-acme", timeout_s=TIMEOUT_S) as remote:
                for seed in range(3):
                    work(local, seed)
                    work(remote, 100 + seed)
            assert len(os.listdir(f"/proc/{proc.proc.pid}/fd")) < NOFILE[1] - 100
        limit = next(e for e in proc.events() if e["msg"] == "descriptor limit")
        assert (limit["soft_before"], limit["soft"], limit["hard"]) == (256, 512, 512)


def test_preface_flood_does_not_lock_out_the_tcp_port(root):
    """100 connections that send the HTTP/2 preface and SETTINGS and then nothing, against
    max_connections=64: the daemon closes those beyond a quarter of the port at once and the
    rest after unauthenticated_timeout_s (1 s), so a client with a token gets in (before: they
    held every place while they stayed open)."""
    with daemon_process(root, tcp_address="127.0.0.1:0", tenant_tokens=TOKENS,
                        max_connections=64, unauthenticated_timeout_s=1.0) as proc, \
            flood("tcp", proc.tcp_address(), 100, "preface") as opened:
        assert opened > 64  # past the cap (a connect may time out on a loaded box)
        time.sleep(0.5)  # the flood is in place (the gate sweeps every 0.25 s)
        with Client(proc.tcp_address(), token="tok-acme", timeout_s=TIMEOUT_S) as remote, \
                Client(proc.address, timeout_s=TIMEOUT_S) as local:
            work(remote, 1)
            work(local, 2)
            time.sleep(1.5)  # past the deadline: an authenticated connection stays
            work(remote, 3)


def test_idle_data_port_flood_leaves_transfers_working(root):
    """300 silent connections on the TCP data port (max_data_transfers 256): Puts and Gets of
    a Unix client and a TCP client still move their bytes over the data sockets, since the
    oldest silent connection makes room for each new one (before: every transfer failed, over
    TCP and Unix, with no fallback)."""
    with daemon_process(root, tcp_address="127.0.0.1:0", tenant_tokens=TOKENS) as proc, \
            flood("tcp", f"127.0.0.1:{served(proc, 'data_port')}", 300, "raw") as opened:
        assert opened > 256  # past the cap (a connect may time out on a loaded box)
        with Client(proc.address, timeout_s=TIMEOUT_S, zero_copy=False) as local, \
                Client(proc.tcp_address(), token="tok-acme", timeout_s=TIMEOUT_S) as remote:
            for seed in range(3):
                work(local, seed)
                work(remote, 100 + seed)
            assert local._data.num_fallbacks == remote._data.num_fallbacks == 0


def test_full_data_socket_falls_back_to_streaming(root):
    """A data socket whose every place is held by call channels (authenticated: none is
    dropped for a newcomer) closes the next connection at once: the client's Put and Get
    stream over gRPC instead and count it (before, the client raised the Put's ticket error
    once it lapsed, and the Get's stream error)."""
    with daemon_process(root, max_connections=4, stream_idle_timeout_s=2.0) as proc, \
            grpc.insecure_channel(proc.address) as channel:
        stub = pbg.KVStoreStub(channel)
        held = []
        for _ in range(4):
            ticket = stub.OpenChannel(pb.OpenChannelRequest())
            sock = framing.connect(framing.DataAddress(socket.AF_UNIX, ticket.unix_path),
                                   TIMEOUT_S)
            sock.sendall(framing.encode_hello(ticket.ticket, None))
            held.append(sock)
        time.sleep(0.2)  # the channels are open
        try:
            with Client(proc.address, timeout_s=TIMEOUT_S, zero_copy=False,
                        call_channel=False) as client:
                work(client, 1)
                assert client._data.num_fallbacks >= 2  # the Put and the Get
        finally:
            for sock in held:
                sock.close()


def test_idle_metrics_flood(root):
    """600 connections to the metrics port that send half a request line, against a soft
    descriptor limit of 256: at most a few are served at once, the rest are closed at once,
    and each idle one is dropped after unauthenticated_timeout_s (1 s); the clients keep
    working and a scrape is answered (before: each held a thread and a descriptor for good,
    until the daemon ran out)."""
    port = free_port()
    with daemon_process(root, tcp_address="127.0.0.1:0", tenant_tokens=TOKENS, nofile=NOFILE,
                        metrics_port=port, unauthenticated_timeout_s=1.0) as proc, \
            flood("tcp", f"127.0.0.1:{port}", 600, "http") as opened:
        assert opened >= 200
        with Client(proc.address, timeout_s=TIMEOUT_S) as local, \
                Client(proc.tcp_address(), token="tok-acme", timeout_s=TIMEOUT_S) as remote:
            work(local, 1)
            work(remote, 2)
        assert _scraped(f"http://127.0.0.1:{port}/metrics", 10.0)
        assert len(os.listdir(f"/proc/{proc.proc.pid}/task")) < 100


def test_descriptor_socket_flood_keeps_zero_copy(root):
    """200 silent connections to the descriptor socket, renewed as the daemon closes them: a
    Unix client still gets its arena and puts and gets zero-copy (strictly: no streaming
    allowed), since the oldest waiting connection of the flooding process makes room (before:
    the flood held every place and zero-copy was denied to every tenant)."""
    with daemon_process(root, dram_bytes=64 << 20) as proc:
        path = fd_socket_path(proc.config.server.socket_path)
        with flood("unix", path, 200, "raw", renew=True) as opened:
            assert opened >= 64
            time.sleep(0.5)
            with Client(proc.address, timeout_s=TIMEOUT_S) as local:
                for seed in range(3):
                    work(local, seed, zero_copy=True)


def _scraped(url: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2.0) as reply:
            return b"kvstore_" in reply.read()
        time.sleep(0.2)
    return False
