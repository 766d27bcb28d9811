"""A get into the caller's own buffer (``out=``), and the Release sent after the caller has its
data: a late release still frees its pins, a lease that expired mid-read is never trusted, and
a client that dies mid-copy holds nothing past its session or its deadline."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from kvstore.client import AsyncClient, Client, releases
from kvstore.client import sync as sync_module
from kvstore.config import QuotaConfig
from kvstore.errors import InvalidArgument
from kvstore.keys import Namespace
from kvstore.spec import KVSpec
from tests.server.helpers import DaemonThread, small_config, wait_for

from ..conftest import REPO_ROOT, random_kv

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, block_tokens=16)
NS = Namespace(model_id="m", spec=SPEC, tenant="acme")
TOKENS = list(range(64))


def active_leases(client: Client) -> int:
    return client.stats().active_leases


@pytest.mark.parametrize("zero_copy", [True, False])
def test_get_writes_into_the_callers_buffer(tmp_path, zero_copy):
    kv = random_kv(SPEC, 64)
    with DaemonThread(small_config(tmp_path)) as daemon, Client(daemon.unix_address) as client:
        client.put(NS, TOKENS, kv)
        # Room for more tokens than are stored: a buffer sized for the longest prompt.
        out = torch.full(SPEC.shape(96), 7.0, dtype=SPEC.torch_dtype)
        got = client.get(NS, list(range(96)), zero_copy=zero_copy, out=out)
        assert got.shape[2] == 64 and got.data_ptr() == out.data_ptr()
        assert torch.equal(got, kv) and torch.equal(out[:, :, :64], kv)
        assert bool((out[:, :, 64:] == 7.0).all())  # past the match: left as it was
        again = client.get(NS, TOKENS, zero_copy=zero_copy, out=out)  # the buffer reused
        assert torch.equal(again, kv)
        assert client.get(NS, list(range(500, 532)), zero_copy=zero_copy, out=out) is None


BIG_SPEC = KVSpec(num_layers=4, num_kv_heads=8, head_dim=128, block_tokens=16)  # 256 KiB blocks


@pytest.mark.parametrize("zero_copy", [True, False])
@pytest.mark.parametrize("copy_threads", [1, 3])
def test_a_large_get_shared_between_copy_threads_is_whole(tmp_path, zero_copy, copy_threads):
    """24 blocks (6 MiB) into a larger ``out``: with several copy threads the pages are cut
    between them (one straddling two shares); every byte lands as with one."""
    ns = Namespace(model_id="big", spec=BIG_SPEC, tenant="acme")
    kv = random_kv(BIG_SPEC, 24 * 16)
    tokens = list(range(24 * 16))
    with DaemonThread(small_config(tmp_path, dram_bytes=64 << 20)) as daemon, \
            Client(daemon.unix_address, copy_threads=copy_threads) as client:
        client.put(ns, tokens, kv)
        out = torch.full(BIG_SPEC.shape(32 * 16), 7.0, dtype=BIG_SPEC.torch_dtype)
        got = client.get(ns, tokens + [1, 2, 3], zero_copy=zero_copy, out=out)
        assert torch.equal(got, kv) and bool((out[:, :, 24 * 16:] == 7.0).all())
    with pytest.raises(InvalidArgument, match="copy_threads must be an int from 1 to 4"):
        Client(daemon.unix_address, copy_threads=0)


def _bad_outs() -> list[tuple[object, str]]:
    good = SPEC.shape(64)
    return [
        (torch.empty(good, dtype=torch.float16), "float16"),
        (torch.empty(SPEC.shape(48), dtype=SPEC.torch_dtype), "shape"),
        (torch.empty((3, *good[1:]), dtype=SPEC.torch_dtype), "shape"),
        (torch.empty(good[:-1], dtype=SPEC.torch_dtype), "shape"),
        (torch.empty(SPEC.shape(128), dtype=SPEC.torch_dtype)[:, :, ::2], "contiguous"),
        (torch.empty(good, dtype=SPEC.torch_dtype, device="meta"), "CPU"),
        (bytearray(SPEC.block_bytes * 4), "torch.Tensor"),
    ]


@pytest.mark.parametrize("zero_copy", [True, False])
def test_a_bad_out_is_refused_before_anything_moves(tmp_path, zero_copy):
    with DaemonThread(small_config(tmp_path)) as daemon, Client(daemon.unix_address) as client:
        client.put(NS, TOKENS, random_kv(SPEC, 64))
        for out, named in _bad_outs():
            with pytest.raises(InvalidArgument, match=named):
                client.get(NS, TOKENS, zero_copy=zero_copy, out=out)
        assert active_leases(client) == 0  # refused before any Acquire


async def test_async_get_into_the_callers_buffer(tmp_path):
    kv = random_kv(SPEC, 64)
    with DaemonThread(small_config(tmp_path)) as daemon:
        async with AsyncClient(daemon.unix_address, zero_copy=True) as client:
            await client.put(NS, TOKENS, kv)
            out = torch.empty(SPEC.shape(64), dtype=SPEC.torch_dtype)
            got = await client.get(NS, TOKENS, out=out)
            assert got.data_ptr() == out.data_ptr() and torch.equal(got, kv)
            streamed = torch.empty(SPEC.shape(80), dtype=SPEC.torch_dtype)
            got = await client.get(NS, list(range(80)), zero_copy=False, out=streamed)
            assert got.data_ptr() == streamed.data_ptr() and torch.equal(got, kv)
            for bad, named in _bad_outs():
                with pytest.raises(InvalidArgument, match=named):
                    await client.get(NS, TOKENS, out=bad)
            await client.flush_releases()
            assert (await client.stats()).active_leases == 0


def test_a_late_release_still_frees_its_pins(tmp_path, monkeypatch):
    """The Release leaves after get returned: until it is answered the lease still pins its
    blocks against another client's evict; once it is, nothing is held and the blocks can be
    evicted. The reader's own evict waits for its late Releases first."""
    sent = []
    gate = threading.Event()
    with DaemonThread(small_config(tmp_path)) as daemon, \
            Client(daemon.unix_address, zero_copy=True) as client, \
            Client(daemon.unix_address) as admin:
        client.put(NS, TOKENS, random_kv(SPEC, 64))
        release = client.release

        def held_release(lease_id: str) -> None:
            gate.wait(10)
            sent.append(lease_id)
            release(lease_id)

        client._late = releases.LateReleases(held_release)
        assert client.get(NS, TOKENS) is not None  # returned with its Release still queued
        assert sent == [] and active_leases(client) == 1
        assert admin.evict(model_id=NS.model_id) == 0  # pinned by the lease still
        gate.set()
        client.flush_releases()
        assert len(sent) == 1 and active_leases(client) == 0
        assert admin.evict(model_id=NS.model_id) == 4
        # The reader's own evict right after a get: its Release is waited for, not raced.
        client.put(NS, TOKENS, random_kv(SPEC, 64))
        gate.clear()
        threading.Timer(0.2, gate.set).start()
        assert client.get(NS, TOKENS) is not None and sent == [sent[0]]
        assert client.evict(model_id=NS.model_id) == 4 and len(sent) == 2


def test_a_tenant_at_its_lease_quota_waits_for_its_late_releases(tmp_path):
    """With one open lease allowed, the second get's Acquire is refused while the first get's
    Release is still on its way: the client waits for it and asks again, it does not fail."""
    config = dataclasses.replace(small_config(tmp_path), quota=QuotaConfig(max_open_leases=1))
    kv = random_kv(SPEC, 64)
    gate = threading.Event()
    with DaemonThread(config) as daemon, Client(daemon.unix_address, zero_copy=True) as client:
        client.put(NS, TOKENS, kv)
        release = client.release
        client._late = releases.LateReleases(lambda lease_id: (gate.wait(0.5),
                                                               release(lease_id)))
        assert torch.equal(client.get(NS, TOKENS), kv)
        assert torch.equal(client.get(NS, TOKENS), kv)  # the first Release still held back
        gate.set()
        client.flush_releases()
        assert active_leases(client) == 0


def test_a_lease_that_expired_mid_read_is_not_trusted(tmp_path, monkeypatch):
    """The daemon's answer to the Release no longer says whether the read was in time: the
    client checks the lease's deadline itself, and falls back (or, insisting, raises)."""
    kv = random_kv(SPEC, 64)
    with DaemonThread(small_config(tmp_path)) as daemon, Client(daemon.unix_address) as client:
        client.put(NS, TOKENS, kv)
        acquire, read = client.acquire, sync_module.read_lease
        monkeypatch.setattr(client, "acquire", lambda ns, tokens: acquire(ns, tokens, 0.2))

        def slow_read(*args):
            result = read(*args)
            time.sleep(0.4)  # past the lease's deadline
            return result

        monkeypatch.setattr(sync_module, "read_lease", slow_read)
        with pytest.raises(InvalidArgument, match="expired"):
            client.get(NS, TOKENS, zero_copy=True)
        got = client.get(NS, TOKENS)  # auto mode: streamed instead
        assert torch.equal(got, kv)
        with pytest.raises(InvalidArgument, match="expired"):
            client.read_blocks(NS, TOKENS, lambda i, block: time.sleep(0.1), zero_copy=True)


_DIE_MID_COPY = """
import os
from kvstore.client import Client
from kvstore.keys import Namespace
from kvstore.spec import KVSpec
spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, block_tokens=16)
ns = Namespace(model_id="m", spec=spec, tenant="acme")
c = Client({address!r}, zero_copy=True)
if {no_session!r}:
    c._session.metadata = ()  # as against a daemon without sessions: only the deadline is left
def visit(i, kv):
    if i == 1:
        print("dying mid-copy", flush=True)
        os._exit(3)
c.read_blocks(ns, list(range(64)), visit)
"""


@pytest.mark.parametrize("no_session", [False, True])
def test_a_client_dying_mid_copy_leaks_nothing_past_its_session_or_deadline(tmp_path,
                                                                             no_session):
    lease_s = 1.5
    config = small_config(tmp_path, lease_timeout_s=lease_s)
    with DaemonThread(config) as daemon, Client(daemon.unix_address) as watcher:
        watcher.put(NS, TOKENS, random_kv(SPEC, 64))
        script = textwrap.dedent(_DIE_MID_COPY.format(address=daemon.unix_address,
                                                      no_session=no_session))
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        started = time.time()
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                              text=True, timeout=120, check=False)
        assert "dying mid-copy" in done.stdout, done.stderr
        assert wait_for(lambda: active_leases(watcher) == 0)
        if no_session:  # nothing but the deadline gave it back
            assert time.time() >= started + lease_s
        assert watcher.evict(model_id=NS.model_id) == 4
