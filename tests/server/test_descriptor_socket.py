"""Arena isolation: each tenant's pages are in a memfd of its own, handed over the descriptor
socket only to that tenant's clients; attacks on the channel and on the memfd itself."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import socket
import stat
import subprocess
import sys
import textwrap

import pytest
import torch

from kvstore.client import NO_RETRY, AsyncClient
from kvstore.client.mappings import fetch_region_fd
from kvstore.errors import InvalidArgument, NotFound, PermissionDenied, Unauthenticated
from kvstore.rpc.descriptors import MAX_MESSAGE_BYTES, fd_socket_path, parse_reply
from kvstore.server import descriptor_socket as fdpass
from kvstore.server.daemon import serve

from ..conftest import random_kv, random_tokens
from .helpers import small_config

TOKENS = {"acme": "tok-acme", "zeta": "tok-zeta"}
NOBODY_UID = 65534


@pytest.fixture
async def tenants_daemon(root):
    d = await serve(small_config(root, tenant_tokens=TOKENS, require_auth_on_unix=True))
    yield d
    await d.stop(1.0)


def tenant_client(daemon, tenant: str) -> AsyncClient:
    return AsyncClient(daemon.unix_address, token=TOKENS[tenant], retry=NO_RETRY)


async def _fetch(daemon, region: str, token: str | None) -> int | None:
    """Ask the daemon's descriptor socket for ``region`` (in a thread: this loop serves it)."""
    return await asyncio.to_thread(fetch_region_fd, fd_socket_path(daemon.socket_path), region,
                                   token)


async def _raw_exchange(daemon, request: bytes) -> bytes:
    """Send ``request`` as is and return everything the daemon answers before closing."""
    def go() -> bytes:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(10)
            sock.connect(fd_socket_path(daemon.socket_path))
            sock.sendall(request)
            sock.shutdown(socket.SHUT_WR)
            reply = b""
            while chunk := sock.recv(65536):
                reply += chunk
            return reply

    return await asyncio.to_thread(go)


async def test_each_tenant_reads_its_own_arena_zero_copy(tenants_daemon, ns, spec):
    zeta_ns = dataclasses.replace(ns, tenant="zeta")
    tokens = random_tokens(48)
    kv_a, kv_z = random_kv(spec, 48, seed=1), random_kv(spec, 48, seed=2)
    async with tenant_client(tenants_daemon, "acme") as acme, \
            tenant_client(tenants_daemon, "zeta") as zeta:
        assert await acme.put(ns, tokens, kv_a, zero_copy=True) == 48
        assert await zeta.put(zeta_ns, tokens, kv_z, zero_copy=True) == 48
        assert torch.equal(await acme.get(ns, tokens, zero_copy=True), kv_a)
        assert torch.equal(await zeta.get(zeta_ns, tokens, zero_copy=True), kv_z)
        lease_a, lease_z = await acme.acquire(ns, tokens), await zeta.acquire(zeta_ns, tokens)
        dram = tenants_daemon.store.tiers["dram"]
        regions_a = {b.region for b in lease_a.blocks}
        regions_z = {b.region for b in lease_z.blocks}
        assert len(regions_a) == len(regions_z) == 1 and regions_a != regions_z
        assert regions_a <= set(dram.published_regions("acme"))
        assert regions_z <= set(dram.published_regions("zeta"))
        # each client holds the descriptors of its own tenant's memory (the published step its
        # blocks are in, the staging arena it wrote them into) and of no other
        assert set(acme._zero_copy.maps.regions) == regions_a | {dram.region_of("acme")}
        assert set(zeta._zero_copy.maps.regions) == regions_z | {dram.region_of("zeta")}
        await acme.release(lease_a.lease_id)
        await zeta.release(lease_z.lease_id)
    health = (await _probe_health(tenants_daemon))
    assert health == fd_socket_path(tenants_daemon.socket_path)


async def _probe_health(daemon) -> str:
    async with tenant_client(daemon, "acme") as client:
        return (await client.health()).arena_path


async def test_a_tenant_is_refused_another_tenants_arena(tenants_daemon, ns, spec):
    """Tenant zeta learns acme's region name (say it leaked) and asks for it with its own
    token, with a wrong one and with none: every request is refused, no descriptor sent."""
    tokens = random_tokens(32)
    async with tenant_client(tenants_daemon, "acme") as acme:
        assert await acme.put(ns, tokens, random_kv(spec, 32), zero_copy=True) == 32
        lease = await acme.acquire(ns, tokens)
        region = lease.blocks[0].region
        fd = await _fetch(tenants_daemon, region, "tok-acme")  # the owner gets it
        assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:kvstore-dram.")
        os.close(fd)
        with pytest.raises(PermissionDenied, match="'zeta' may not map the arena of tenant"):
            await _fetch(tenants_daemon, region, "tok-zeta")
        with pytest.raises(Unauthenticated):
            await _fetch(tenants_daemon, region, "tok-wrong")
        with pytest.raises(Unauthenticated):
            await _fetch(tenants_daemon, region, None)  # require_auth_on_unix
        with pytest.raises(NotFound):
            await _fetch(tenants_daemon, "dram.0123456789abcdef", "tok-zeta")
        # and zeta cannot reach the blocks through gRPC either
        with pytest.raises(PermissionDenied):
            async with tenant_client(tenants_daemon, "zeta") as zeta:
                await zeta.acquire(ns, tokens)
        await acme.release(lease.lease_id)


async def test_an_arena_has_no_path_another_process_could_open(tenants_daemon, ns, spec):
    """The only names of an arena are the daemon's own descriptors: nothing in /dev/shm, the
    socket directory or the temp directory, and the descriptor reads as an anonymous memfd."""
    tokens = random_tokens(32)
    async with tenant_client(tenants_daemon, "acme") as acme:
        assert await acme.put(ns, tokens, random_kv(spec, 32), zero_copy=True) == 32
        region = (await acme.acquire(ns, tokens)).blocks[0].region
    for directory in ("/dev/shm", os.path.dirname(tenants_daemon.socket_path), "/tmp"):
        if os.path.isdir(directory):
            assert not [n for n in os.listdir(directory) if region in n or "arena" in n
                        and str(os.getpid()) in n], directory
    _, fd = tenants_daemon.store.host_regions.region_fd(region)
    assert os.readlink(f"/proc/self/fd/{fd}") == f"/memfd:kvstore-{region} (deleted)"
    mode = os.stat(fd_socket_path(tenants_daemon.socket_path)).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600


CHILD_AS_NOBODY = textwrap.dedent("""
    import json, os, socket, sys
    proc_fd, channel = sys.argv[1], sys.argv[2]
    os.setgroups([])
    os.setgid({uid})
    os.setuid({uid})
    result = {{}}
    for name, attempt in (("open", lambda: os.close(os.open(proc_fd, os.O_RDONLY))),
                          ("readlink", lambda: os.readlink(proc_fd)),
                          ("connect", lambda: socket.socket(socket.AF_UNIX).connect(channel))):
        try:
            attempt()
            result[name] = "ok"
        except OSError as exc:
            result[name] = type(exc).__name__
    print(json.dumps(result))
""").format(uid=NOBODY_UID)


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping to another uid needs root")
async def test_another_uid_can_neither_open_the_memfd_through_proc_nor_ask(tenants_daemon, ns,
                                                                            spec):
    """A process of another user on the host tries the daemon's /proc/<pid>/fd entry of the
    arena (the one path a memfd has) and the descriptor socket: both are refused by the
    kernel, before any token is looked at."""
    tokens = random_tokens(32)
    async with tenant_client(tenants_daemon, "acme") as acme:
        assert await acme.put(ns, tokens, random_kv(spec, 32), zero_copy=True) == 32
        region = (await acme.acquire(ns, tokens)).blocks[0].region
    _, fd = tenants_daemon.store.host_regions.region_fd(region)
    proc_fd = f"/proc/{os.getpid()}/fd/{fd}"
    with open(proc_fd, "rb"):  # root, the daemon's own user, can: the path is real
        pass
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CHILD_AS_NOBODY, proc_fd, fd_socket_path(tenants_daemon.socket_path),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    stdout, stderr = await asyncio.wait_for(proc.communicate(), timeout=60)
    assert proc.returncode == 0, stderr.decode()
    assert json.loads(stdout) == {"open": "PermissionError", "readlink": "PermissionError",
                                  "connect": "PermissionError"}


async def test_malformed_slow_and_oversized_requests_are_dropped(tenants_daemon, ns, spec,
                                                                 monkeypatch):
    """The channel bounds what it reads in size and time and answers garbage with a refusal;
    the daemon keeps serving descriptors and RPCs after each."""
    monkeypatch.setattr(fdpass, "REQUEST_TIMEOUT_S", 0.3)
    try:  # refused after MAX_MESSAGE_BYTES: the rest is never read (the close may reset)
        reply = await _raw_exchange(tenants_daemon, b"x" * (4 * MAX_MESSAGE_BYTES))
    except ConnectionResetError:
        reply = b'{"error": "InvalidArgument"}'
    assert json.loads(reply)["error"] == "InvalidArgument"
    for request, error in ((b"not json\n", "InvalidArgument"),
                           (b'{"v": 9, "region": ""}\n', "InvalidArgument"),
                           (b'{"v": 1, "region": 5}\n', "InvalidArgument"),
                           (b'{"v": 1}\n{"v": 1}\n', "InvalidArgument"),
                           (b'{"v": 1, "region": "", "token": "nope"}\n', "Unauthenticated")):
        reply = await _raw_exchange(tenants_daemon, request)
        assert json.loads(reply)["error"] == error, request[:40]
        with pytest.raises((InvalidArgument, Unauthenticated)):
            parse_reply(reply)

    def silent() -> bytes:  # connects, sends nothing: dropped after the timeout, unanswered
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(10)
            sock.connect(fd_socket_path(tenants_daemon.socket_path))
            return sock.recv(100)

    assert await asyncio.to_thread(silent) == b""
    tokens = random_tokens(16)
    async with tenant_client(tenants_daemon, "acme") as acme:
        assert await acme.put(ns, tokens, random_kv(spec, 16), zero_copy=True) == 16
        assert await acme.get(ns, tokens, zero_copy=True) is not None


async def test_local_trust_may_map_any_tenants_arena(daemon, ns, spec):
    """Without tokens, a Unix-socket caller may act as any tenant (DESIGN.md, local trust), so
    it may ask for any region; naming a region that does not exist is still refused."""
    tokens = random_tokens(32)
    async with AsyncClient(daemon.unix_address) as client:
        assert await client.put(ns, tokens, random_kv(spec, 32), zero_copy=True) == 32
        region = (await client.acquire(ns, tokens)).blocks[0].region
    fd = await _fetch(daemon, region, None)
    os.close(fd)
    assert await _fetch(daemon, "", None) is None  # a probe
    with pytest.raises(NotFound):
        await _fetch(daemon, region + "x", None)


async def test_the_descriptor_socket_goes_with_the_daemon_and_a_stale_one_is_replaced(config):
    """A daemon removes its descriptor socket when it stops; one a killed daemon left behind
    is replaced by the next (which holds the socket lock, so nobody else serves it)."""
    path = fd_socket_path(config.server.socket_path)
    daemon = await serve(config)
    await daemon.stop(1.0)
    assert not os.path.exists(path)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path)  # bound, never served, never unlinked: what SIGKILL leaves
    stale.close()
    daemon = await serve(config)
    try:
        assert await _fetch(daemon, "", None) is None
    finally:
        await daemon.stop(1.0)
    assert not os.path.exists(path)
