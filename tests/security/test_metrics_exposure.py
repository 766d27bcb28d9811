"""The metrics endpoint listens on loopback only (by default and in fact), and what it shows
without a token carries no tenant: no tenant or model label, no tenant or model name."""

from __future__ import annotations

import asyncio
import socket
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from kvstore.client import AsyncClient
from kvstore.config import ServerConfig, load_config
from kvstore.keys import Namespace
from kvstore.server.daemon import serve

from ..conftest import random_kv, random_tokens
from ..server.helpers import small_config
from ..server.test_metrics import free_port

TENANTS = {"tenant-alpha-secret": "tok-alpha", "tenant-beta-secret": "tok-beta"}
ALLOWED_LABELS = {"tier", "method", "code", "le"}  # per tier, per RPC method and status


def test_metrics_host_defaults_to_loopback():
    assert ServerConfig().metrics_host == "127.0.0.1"
    assert load_config(environ={}).server.metrics_host == "127.0.0.1"


def listening_addresses(port: int) -> set[str]:
    """Local IPv4 addresses with a TCP socket listening on ``port`` (from /proc/net/tcp)."""
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, port_hex = local.split(":")
        if state == "0A" and int(port_hex, 16) == port:  # 0A: LISTEN
            found.add(socket.inet_ntoa(bytes.fromhex(address)[::-1]))
    return found


def outward_address() -> str | None:
    """This host's address toward other hosts, if it has one (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 1))
            address = probe.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


async def test_unauthenticated_metrics_show_no_tenant(root, spec):
    port = free_port()
    daemon = await serve(small_config(root, metrics_port=port, tenant_tokens=TENANTS))
    try:
        for i, (tenant, token) in enumerate(TENANTS.items()):
            ns = Namespace(model_id=f"model-of-{tenant}", spec=spec, tenant=tenant)
            tokens = random_tokens(48, seed=i)
            async with AsyncClient(daemon.unix_address, token=token, zero_copy=False) as client:
                await client.put(ns, tokens, random_kv(spec, 48, seed=i))
                await client.lookup(ns, tokens)
                await client.get(ns, tokens)
        url = f"http://127.0.0.1:{port}/metrics"
        text = (await asyncio.to_thread(
            lambda: urllib.request.urlopen(url, timeout=10).read())).decode()
        assert listening_addresses(port) == {"127.0.0.1"}
        if (address := outward_address()) is not None:
            with socket.socket() as s:
                s.settimeout(2)
                assert s.connect_ex((address, port)) != 0, f"metrics answer on {address}"
    finally:
        await daemon.stop(1.0)
    samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
    assert any(s.name == "kvstore_puts_total" and s.value == 2 for s in samples)
    labels = {name for s in samples for name in s.labels}
    assert labels <= ALLOWED_LABELS, labels - ALLOWED_LABELS
    assert "tenant-" not in text and "model-of" not in text
