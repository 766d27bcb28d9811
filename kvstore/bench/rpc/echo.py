"""kvstore's calls against a bare grpc.aio echo of the same payloads: the echo server, its
blocking client, and the rows of Lookup latency, put/get GB/s (the socket, shared memory,
and one memfd copy as the floor) and small-call throughput."""

from __future__ import annotations

import asyncio
import mmap
import os
import signal
import struct
import sys
from collections.abc import Callable

import grpc
import numpy as np
import torch

from kvstore.bench.rpc.common import (
    BLOCK_SPEC,
    LOOKUP_PREFIXES,
    LOOKUP_SPEC,
    MAX_MESSAGE_BYTES,
    PROMPT_BLOCKS,
    calls_per_second,
    each,
    latencies_ms,
    python_lookup_floor,
    seconds_of,
)
from kvstore.client import NO_RETRY, AsyncClient, Client
from kvstore.copies import copy_all, default_copy_threads
from kvstore.errors import KVStoreError
from kvstore.keys import Namespace
from kvstore.rpc import kvstore_pb2 as pb
from kvstore.rpc.convert import namespace_to_proto, tokens_to_bytes
from kvstore.rpc.tensors import chunk_limit

_ECHO = "/kvstore.bench.Echo/"
ECHO_SECTION = "against a bare gRPC echo"
_COPY_SECTION = "shared memory against one copy (np.copyto) into or out of a memfd"


# ------------------------------------------------------------------------------ echo server


async def _echo_unary(request: bytes, context) -> bytes:
    """Replies with as many bytes as the first 8 request bytes ask for."""
    return bytes(int.from_bytes(request[:8], "little"))


async def _echo_upload(request_iterator, context) -> bytes:
    total = 0
    async for chunk in request_iterator:
        total += len(chunk)
    return total.to_bytes(8, "little")


async def _echo_download(request: bytes, context):
    total, chunk_bytes = struct.unpack_from("<QQ", request)
    block = bytes(chunk_bytes)
    for start in range(0, total, chunk_bytes):
        yield block if start + chunk_bytes <= total else block[: total - start]


async def serve_echo(address: str) -> None:
    """A bare grpc.aio server with identity (bytes) serialisers, until SIGTERM."""
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                                      ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("kvstore.bench.Echo", {
        "Unary": grpc.unary_unary_rpc_method_handler(_echo_unary),
        "Upload": grpc.stream_unary_rpc_method_handler(_echo_upload),
        "Download": grpc.unary_stream_rpc_method_handler(_echo_download),
    }),))
    server.add_insecure_port(address)
    await server.start()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await server.stop(1.0)


# -------------------------------------------------------------------------------- client


class Echo:
    """Blocking calls to the echo server, shaped like the kvstore calls they stand beside."""

    def __init__(self, address: str) -> None:
        options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]
        self.channel = grpc.insecure_channel(address, options=options)
        self.unary = self.channel.unary_unary(_ECHO + "Unary")
        self.upload = self.channel.stream_unary(_ECHO + "Upload")
        self.download = self.channel.unary_stream(_ECHO + "Download")

    def call(self, request_bytes: int, response_bytes: int) -> Callable[[], object]:
        request = response_bytes.to_bytes(8, "little") + bytes(max(0, request_bytes - 8))
        return lambda: self.unary(request)

    def put(self, view: memoryview, chunk_bytes: int) -> None:
        self.upload(bytes(view[i : i + chunk_bytes]) for i in range(0, len(view), chunk_bytes))

    def get(self, total_bytes: int, chunk_bytes: int) -> bytearray:
        out, pos = bytearray(total_bytes), 0
        for chunk in self.download(struct.pack("<QQ", total_bytes, chunk_bytes)):
            out[pos : pos + len(chunk)] = chunk
            pos += len(chunk)
        return out



# ---------------------------------------------------------------------------------- rows


def _row(measurement: str, value: float, unit: str, baseline: float, **extra) -> dict:
    return {"section": ECHO_SECTION, "measurement": measurement, "value": value, "unit": unit,
            "echo": baseline, "vs_echo": value / baseline if baseline else None, **extra}



def lookup_rows(client: Client, echo: Echo, repeats: int) -> list[dict]:
    rows = []
    for num_tokens in LOOKUP_PREFIXES:
        ns = Namespace(model_id="bench/lookup", spec=LOOKUP_SPEC, tenant="bench")
        tokens = np.random.default_rng(num_tokens).integers(0, 50_000, num_tokens).tolist()
        kv = torch.zeros(LOOKUP_SPEC.shape(num_tokens), dtype=torch.bfloat16)
        client.put(ns, tokens, kv, zero_copy=False)
        result = client.lookup(ns, tokens)
        if result.matched_tokens != num_tokens:
            raise KVStoreError(f"lookup bench: {result.matched_tokens} of {num_tokens} matched")
        # the echo carries what the client and the daemon send: the keys packed
        request = pb.LookupRequest(namespace=namespace_to_proto(ns), tokens=tokens_to_bytes(tokens),
                                   packed=True).ByteSize()
        response = pb.LookupResponse(packed_keys=b"".join(result.keys), matched_tokens=num_tokens,
                                     num_tokens=num_tokens,
                                     tokens_per_tier=result.tokens_per_tier).ByteSize()
        index: dict[bytes, None] = {}
        python_lookup_floor(ns.fingerprint, tokens, index, LOOKUP_SPEC.block_tokens, record=True)
        ours = latencies_ms(lambda ns=ns, tokens=tokens: client.lookup(ns, tokens), repeats)
        bare = latencies_ms(echo.call(request, response), repeats)
        floor = latencies_ms(lambda ns=ns, tokens=tokens, index=index: python_lookup_floor(
            ns.fingerprint, tokens, index, LOOKUP_SPEC.block_tokens), repeats)
        for q in (50, 99):
            value, below = float(np.percentile(ours, q)), float(np.percentile(floor, q))
            rows.append(_row(f"Lookup {num_tokens // 1024}k-token prefix p{q}", value, "ms",
                             float(np.percentile(bare, q)), payload_bytes=request + response,
                             floor=below, vs_floor=value / below))
    return rows


def transfer_rows(client: Client, echo: Echo, total_bytes: int) -> list[dict]:
    ns = Namespace(model_id="bench/blocks", spec=BLOCK_SPEC, tenant="bench")
    prompt_tokens = PROMPT_BLOCKS * BLOCK_SPEC.block_tokens
    num_calls = max(1, total_bytes // (PROMPT_BLOCKS * BLOCK_SPEC.block_bytes))
    kv = torch.randn(BLOCK_SPEC.shape(prompt_tokens)).to(torch.bfloat16)
    nbytes = kv.numel() * kv.element_size()
    moved = num_calls * nbytes / 1e9
    chunk = chunk_limit(MAX_MESSAGE_BYTES)
    view = memoryview(kv.view(-1).view(torch.uint8).numpy())

    def prompts(base: int) -> list[list[int]]:
        return [list(range(base + i * prompt_tokens, base + (i + 1) * prompt_tokens))
                for i in range(num_calls)]

    def put_all(batch: list[list[int]], zero_copy: bool) -> float:
        return seconds_of(lambda: [client.put(ns, t, kv, zero_copy=zero_copy) for t in batch])

    put_all(prompts(10_000_000), False)  # warm-up: grows and pre-faults the DRAM arena
    # ... and, as the copy baseline faults its memfd in untimed, the staging slots and this
    # client's mappings of them and of published memory.
    warm = torch.ones_like(kv)
    warm_up = prompts(15_000_000)
    put_all(warm_up, True)
    for t in warm_up:
        client.get(ns, t, zero_copy=True, out=warm)
    client.flush_releases()
    client.evict(model_id=ns.model_id)
    put_socket = put_all(prompts(20_000_000), False)
    client.evict(model_id=ns.model_id)
    shared = prompts(30_000_000)
    put_shm = put_all(shared, True)
    get_socket = seconds_of(lambda: each(shared, lambda t: client.get(ns, t, zero_copy=False)))
    get_shm = seconds_of(lambda: each(shared, lambda t: client.get(ns, t, zero_copy=True)))
    # Into a warm buffer of the caller's, as the copy baseline copies into one.
    get_shm_out = seconds_of(lambda: each(shared, lambda t: client.get(ns, t, zero_copy=True,
                                                                       out=warm)))
    echo_put = seconds_of(lambda: [echo.put(view, chunk) for _ in range(num_calls)])
    echo_get = seconds_of(lambda: each(range(num_calls), lambda _: echo.get(nbytes, chunk)))
    copy_in, copy_out, copy_out_shared = _memfd_copies(view, num_calls)
    threads = default_copy_threads()
    client.flush_releases()
    client.evict(model_id=ns.model_id)
    extra = {"payload_bytes": nbytes}
    return [
        _row("put 2 MiB blocks, socket", moved / put_socket, "GB/s", moved / echo_put, **extra),
        _row("put 2 MiB blocks, shared memory", moved / put_shm, "GB/s", moved / echo_put,
             **extra),
        _row("get 2 MiB blocks, socket", moved / get_socket, "GB/s", moved / echo_get, **extra),
        _row("get 2 MiB blocks, shared memory", moved / get_shm, "GB/s", moved / echo_get,
             **extra),
        _copy_row("put 2 MiB blocks x16, shared memory, vs one copy into a memfd",
                  moved / put_shm, moved / copy_in, 0.7, **extra),
        _copy_row("get 2 MiB blocks x16, shared memory, vs one copy out of a memfd (into a "
                  "warm out=)", moved / get_shm_out, moved / copy_out, 0.8, **extra),
        _copy_row("get 2 MiB blocks x16, shared memory, vs one copy out of a memfd (a fresh "
                  "result)", moved / get_shm, moved / copy_out, 0.8, **extra),
        # The ceiling on this host: the same copy spread over the client's copy threads.
        _copy_row(f"get 2 MiB blocks x16, shared memory, vs that copy on {threads} threads "
                  "(into a warm out=)", moved / get_shm_out, moved / copy_out_shared, None,
                  copy_threads=threads, **extra),
    ]


def _memfd_copies(view: memoryview, num_calls: int) -> tuple[float, float, float]:
    """Seconds of ``num_calls`` single-threaded copies (``np.copyto``) of ``view`` into a
    prefaulted memfd mapping, as many out of it into a warm buffer (the floor of a
    shared-memory put and get of the same bytes), and as many out of it shared between the
    client's default copy threads (``copy_all``: this host's ceiling for a get)."""
    src = np.frombuffer(view, dtype=np.uint8)
    fd = os.memfd_create("kvstore-bench-copy", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, src.nbytes)
        mapped = mmap.mmap(fd, src.nbytes)
        shared = np.frombuffer(mapped, dtype=np.uint8)
        out = np.ones_like(src)  # warm: a get's result buffer is not a fresh one here
        np.copyto(shared, src)  # untimed: faults the pages in
        copy_in = seconds_of(lambda: [np.copyto(shared, src) for _ in range(num_calls)])
        copy_out = seconds_of(lambda: [np.copyto(out, shared) for _ in range(num_calls)])
        threads = default_copy_threads()
        copy_out_shared = seconds_of(lambda: [copy_all([(out, shared)], threads)
                                               for _ in range(num_calls)])
        shared = None  # the mapping closes once no array views it
        mapped.close()
    finally:
        os.close(fd)
    return copy_in, copy_out, copy_out_shared


def _copy_row(measurement: str, value: float, copy_gbps: float, aim: float | None,
              **extra) -> dict:
    return {"section": _COPY_SECTION, "measurement": measurement, "value": value,
            "unit": "GB/s", "copy": copy_gbps, "vs_copy": value / copy_gbps, "aim": aim, **extra}



async def small_call_rows(address: str, echo_address: str, seconds: float,
                           concurrency: int) -> list[dict]:
    ns = Namespace(model_id="bench/small", spec=LOOKUP_SPEC, tenant="bench")
    tokens = list(range(LOOKUP_SPEC.block_tokens))
    request = pb.LookupRequest(namespace=namespace_to_proto(ns),
                               tokens=tokens_to_bytes(tokens)).ByteSize()
    response = pb.LookupResponse(num_tokens=len(tokens)).ByteSize()
    async with AsyncClient(address, retry=NO_RETRY) as client, \
            grpc.aio.insecure_channel(echo_address) as channel:
        unary = channel.unary_unary(_ECHO + "Unary")
        payload = response.to_bytes(8, "little") + bytes(max(0, request - 8))
        ours = await calls_per_second(lambda: client.lookup(ns, tokens), seconds, concurrency)
        bare = await calls_per_second(lambda: unary(payload), seconds, concurrency)
    return [_row(f"small calls (Lookup, 1 block, {concurrency} in flight)", ours, "calls/s",
                 bare, payload_bytes=request + response)]



def main(argv: list[str] | None = None) -> int:
    """``python -m kvstore.bench.rpc.echo ADDRESS``: serve the echo until SIGTERM."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m kvstore.bench.rpc.echo ADDRESS", file=sys.stderr)
        return 2
    asyncio.run(serve_echo(args[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
