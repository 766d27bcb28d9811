"""The data socket's wire format: hellos, tickets and the addresses clients connect to."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from kvstore.client.address import parse_address
from kvstore.client.channels import DataSocket
from kvstore.errors import InvalidArgument
from kvstore.rpc import framing as datapath
from kvstore.rpc import kvstore_pb2 as pb
from kvstore.rpc.framing import (
    HELLO,
    MAX_TOKEN_BYTES,
    TICKET_BYTES,
    data_socket_path,
    encode_hello,
    new_ticket,
    parse_hello,
)
from kvstore.server.transfers import transport_of


def test_hello_carries_ticket_and_token():
    ticket = new_ticket()
    hello = encode_hello(ticket, "tok-acme")
    assert parse_hello(hello[: HELLO.size]) == (ticket, len("tok-acme"))
    assert hello[HELLO.size:] == b"tok-acme"
    assert len(encode_hello(ticket, None)) == HELLO.size


def test_tickets_are_random_and_full_length():
    tickets = {new_ticket() for _ in range(1000)}
    assert len(tickets) == 1000 and {len(t) for t in tickets} == {TICKET_BYTES}


def test_malformed_hellos_are_refused_by_name():
    ticket = new_ticket()
    with pytest.raises(InvalidArgument, match="does not start with"):
        parse_hello(HELLO.pack(b"HTTP", ticket, 0))
    with pytest.raises(InvalidArgument, match="token"):
        parse_hello(HELLO.pack(b"KVD1", ticket, MAX_TOKEN_BYTES + 1))
    with pytest.raises(InvalidArgument, match="32 bytes"):
        encode_hello(ticket[:16], None)
    with pytest.raises(InvalidArgument, match="token"):
        encode_hello(ticket, "x" * (MAX_TOKEN_BYTES + 1))


def test_transport_of_grpc_peers():
    assert transport_of("unix:/run/kvstore/kv.sock") == "unix"
    assert transport_of("ipv4:10.0.0.7:50123") == "10.0.0.7"
    assert transport_of("ipv6:[::1]:50123") == "::1"
    assert transport_of("ipv6:%5B::1%5D:50123") == "::1"
    assert transport_of("ipv6:[::ffff:10.0.0.7]:50123") == "10.0.0.7"


def test_clients_connect_where_their_transport_reaches():
    ticket = pb.DataTicket(ticket=new_ticket(), unix_path="/run/kv.sock.data", tcp_port=0)
    unix = DataSocket(True, parse_address("unix:///run/kv.sock"), None, 1.0)
    assert unix._address(ticket).address == "/run/kv.sock.data"
    tcp = DataSocket(True, parse_address("10.0.0.7:50051"), "tok", 1.0)
    assert tcp._address(ticket) is None  # the daemon serves no data port
    ticket.tcp_port = 50052
    address = tcp._address(ticket)
    assert (address.family, address.address) == (socket.AF_INET, ("10.0.0.7", 50052))
    assert data_socket_path("/run/kv.sock") == "/run/kv.sock.data"


def test_an_unreachable_data_socket_makes_the_client_stream_for_a_while(tmp_path):
    data = DataSocket(True, parse_address(f"unix://{tmp_path}/kv.sock"), None, 1.0)
    ticket = pb.DataTicket(ticket=new_ticket(), unix_path=str(tmp_path / "missing.data"))
    assert data.usable
    assert data.connect(ticket) is None
    assert not data.usable


def test_unix_data_connections_hold_more_in_flight_tcp_ones_are_left_alone():
    """A Unix transfer connection's send buffer is widened (as far as wmem_max allows) so a
    32 MiB transfer moves in a few handoffs; TCP keeps its own autotuned sizes."""
    wmem_max = int(Path("/proc/sys/net/core/wmem_max").read_text())
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with left, right, socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp:
        before = left.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        tcp_before = tcp.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        datapath.widen_buffers(left)
        datapath.widen_buffers(tcp)
        # the kernel doubles what it grants (its bookkeeping), up to twice wmem_max
        granted = left.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        assert granted == 2 * min(datapath.UNIX_BUFFER_BYTES, wmem_max)
        assert granted >= before
        assert tcp.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) == tcp_before
