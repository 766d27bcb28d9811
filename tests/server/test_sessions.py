"""Client sessions (Hold): what a client process holds is given back the moment it goes away,
not at the deadline; a session is its tenant's alone; a daemon with open sessions still stops
promptly."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import time

import grpc
import pytest

from kvstore.client import AsyncClient, Client
from kvstore.errors import InvalidArgument, LeaseNotFound, PermissionDenied
from kvstore.keys import Namespace
from kvstore.rpc import kvstore_pb2 as pb
from kvstore.rpc import kvstore_pb2_grpc as pbg
from kvstore.rpc.convert import namespace_to_proto, tokens_to_bytes
from kvstore.rpc.metadata import SESSION_HEADER, new_session_id
from kvstore.rpc.status import translate
from kvstore.spec import KVSpec

from ..conftest import REPO_ROOT, random_kv
from .helpers import DaemonThread, small_config, wait_for

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, block_tokens=16)
TOKENS = {"acme": "tok-acme", "globex": "tok-globex"}


def ns(tenant: str = "acme") -> Namespace:
    return Namespace(model_id="m", spec=SPEC, tenant=tenant)


def held(client: Client) -> tuple[int, int]:
    stats = client.stats()
    return stats.active_leases, stats.active_reservations


@pytest.mark.parametrize("call_channel", [True, False])
def test_a_crashed_client_gives_back_what_it_held_at_once(tmp_path, call_channel):
    """A client process that dies holding a lease and a reservation (taken on its call
    channel, or over gRPC) has both given back when its session ends."""
    config = small_config(tmp_path, tenant_tokens=TOKENS)
    tokens = list(range(64))
    with DaemonThread(config) as daemon, Client(daemon.unix_address, token="tok-acme") as client:
        client.put(ns(), tokens, random_kv(SPEC, 64))
        script = textwrap.dedent(f"""
            import os
            from kvstore.client import Client
            from kvstore.keys import Namespace
            from kvstore.spec import KVSpec
            spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, block_tokens=16)
            ns = Namespace(model_id="m", spec=spec, tenant="acme")
            c = Client({daemon.unix_address!r}, token="tok-acme", call_channel={call_channel})
            lease = c.acquire(ns, list(range(64)), lease_s=600)
            res = c.reserve(ns, list(range(1000, 1064)), lease_s=600)
            print("holding", lease.matched_tokens, len(res.blocks), flush=True)
            os._exit(3)
        """)
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        on_channels = daemon.datapath.calls.num_calls
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                              text=True, timeout=120, check=False)
        assert "holding 64 4" in done.stdout, done.stderr
        # both grants went over the channel, or neither did
        assert daemon.datapath.calls.num_calls - on_channels == (2 if call_channel else 0)
        # Deadlines are ten minutes away: only the session ending can give these back.
        assert wait_for(lambda: held(client) == (0, 0)), held(client)


def test_closing_a_client_gives_back_what_it_held(tmp_path):
    with DaemonThread(small_config(tmp_path)) as daemon, Client(daemon.unix_address) as watcher:
        tokens = list(range(32))
        watcher.put(ns(), tokens, random_kv(SPEC, 32))
        client = Client(daemon.unix_address)
        client.acquire(ns(), tokens, lease_s=600)
        assert held(watcher) == (1, 0)
        client.close()
        assert wait_for(lambda: held(watcher) == (0, 0))


def test_a_reservation_named_in_a_release_stays_its_sessions(tmp_path):
    """Regression: a Release naming a reservation's id (refused: it is no lease) made the
    session forget the reservation, which then outlived its client until its deadline."""
    with DaemonThread(small_config(tmp_path)) as daemon, Client(daemon.unix_address) as watcher:
        client = Client(daemon.unix_address)
        reservation = client.reserve(ns(), list(range(1000, 1064)), lease_s=600)
        with pytest.raises(LeaseNotFound):
            client.release(reservation.reservation_id)
        assert held(watcher) == (0, 1)
        client.close()
        assert wait_for(lambda: held(watcher) == (0, 0))


def _raw_acquire(address: str, token: str, session: str, tenant: str = "acme"):
    channel = grpc.insecure_channel(address)
    stub = pbg.KVStoreStub(channel)
    request = pb.AcquireRequest(namespace=namespace_to_proto(ns(tenant)),
                                tokens=tokens_to_bytes(list(range(32))))
    metadata = (("authorization", f"Bearer {token}"), (SESSION_HEADER, session))
    try:
        return stub.Acquire(request, metadata=metadata, timeout=10)
    except grpc.RpcError as err:
        raise translate(err) from None
    finally:
        channel.close()


def test_a_session_is_its_tenants_alone(tmp_path):
    config = small_config(tmp_path, tenant_tokens=TOKENS)
    with DaemonThread(config) as daemon, Client(daemon.unix_address, token="tok-acme") as acme:
        acme.put(ns(), list(range(32)), random_kv(SPEC, 32))
        acme.acquire(ns(), list(range(32)))  # opens acme's session
        session = acme._session.metadata[0][1]
        with pytest.raises(PermissionDenied, match="another tenant"):
            _raw_acquire(daemon.unix_address, "tok-globex", session, tenant="globex")
        with pytest.raises(InvalidArgument, match="not open"):
            _raw_acquire(daemon.unix_address, "tok-acme", new_session_id())


def test_bad_session_ids_are_refused_and_a_daemon_with_sessions_stops_promptly(tmp_path):
    config = small_config(tmp_path)
    thread = DaemonThread(config)
    daemon = thread.__enter__()
    try:
        channel = grpc.insecure_channel(daemon.unix_address)
        stub = pbg.KVStoreStub(channel)
        for bad in ("", "xyz", "A" * 32, "0" * 65):
            with pytest.raises(grpc.RpcError) as info:
                next(stub.Hold(pb.HoldRequest(session=bad), timeout=10))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        session = new_session_id()
        stream = stub.Hold(pb.HoldRequest(session=session))
        assert next(stream).server_time > 0
        with pytest.raises(grpc.RpcError) as info:
            next(stub.Hold(pb.HoldRequest(session=session), timeout=10))
        assert "already open" in info.value.details()
        client = Client(daemon.unix_address)
        client.acquire(ns(), list(range(32)))  # nothing stored: an empty lease, a session
        start = time.monotonic()
    finally:
        thread.__exit__(None, None, None)
    assert time.monotonic() - start < config.server.shutdown_grace_s + 2.0
    client.close()
    channel.close()


def test_sessions_cannot_crowd_out_calls(tmp_path):
    """One tenant opens at most MAX_SESSIONS_PER_TENANT sessions and all tenants together a
    quarter of the call slots; past that a Hold is RESOURCE_EXHAUSTED and calls still run."""
    from kvstore.server.sessions import MAX_SESSIONS_PER_TENANT

    config = small_config(tmp_path, tenant_tokens=TOKENS, max_concurrent_rpcs=4 * 80)
    with DaemonThread(config) as daemon:
        channel = grpc.insecure_channel(daemon.unix_address)
        stub = pbg.KVStoreStub(channel)

        def hold(token: str):
            stream = stub.Hold(pb.HoldRequest(session=new_session_id()),
                               metadata=(("authorization", f"Bearer {token}"),))
            next(stream)
            return stream

        acme = [hold("tok-acme") for _ in range(MAX_SESSIONS_PER_TENANT)]
        with pytest.raises(grpc.RpcError) as info:
            hold("tok-acme")
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        globex = [hold("tok-globex") for _ in range(80 - MAX_SESSIONS_PER_TENANT)]
        with pytest.raises(grpc.RpcError) as info:
            hold("tok-globex")  # the daemon-wide quarter is taken
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        with Client(daemon.unix_address, token="tok-globex") as client:
            assert client.lookup(ns("globex"), list(range(32))).matched_tokens == 0
        for stream in acme + globex:
            stream.cancel()
        channel.close()


async def test_the_async_clients_session_keeps_reading_its_stream(tmp_path):
    """Regression: the async client read its Hold stream's first event with ``read`` and the
    rest with the iterator, which gRPC refuses on one call: the reading task ended at once, so
    no later event reached the client, and reopening a call channel took the session for gone
    and opened another. The task now reads every event, and the session stays one."""
    config = small_config(tmp_path, tenant_tokens=TOKENS)
    thread = DaemonThread(config)
    with thread as daemon:
        async with AsyncClient(daemon.unix_address, token="tok-acme") as client:
            tokens = list(range(32))
            await client.put(ns(), tokens, random_kv(SPEC, 32), zero_copy=True)
            lease = await client.acquire(ns(), tokens)
            session = client._session.metadata
            await asyncio.sleep(0.3)
            assert session and not client._session.hold_task.done()
            await client.release(lease.lease_id)
            assert (await client.lookup(ns(), tokens)).matched_tokens == 32
            assert client._session.metadata == session
