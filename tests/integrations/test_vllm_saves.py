"""The vLLM connector's background saves (``vllm_saves``) against a real daemon, without vLLM:
a lost save never leaves a gap (the next put of the request starts at block 0), dropped and
failed saves free their requests, and close lets queued puts land."""

from __future__ import annotations

import itertools
import shutil

import pytest
import torch

from kvstore.client import Client
from kvstore.errors import InvalidArgument
from kvstore.integrations.vllm_saves import AsyncSaves, SaveJob, SaveLimits
from kvstore.keys import Namespace
from kvstore.spec import KVSpec
from tests.server.helpers import DaemonProcess, MiB, short_tmpdir, small_config, wait_for

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=32, block_tokens=32, dtype="bfloat16")
NS = Namespace(model_id="saves", spec=SPEC, revision="r1")
TOKENS = list(range(5, 5 + 4 * 32))


@pytest.fixture(scope="module")
def client():
    root = short_tmpdir()
    daemon = DaemonProcess(small_config(root, dram_bytes=64 * MiB), root)
    try:
        daemon.wait_ready()
        with Client(daemon.address) as c:
            yield c
    finally:
        daemon.kill()
        shutil.rmtree(root, ignore_errors=True)


def job(req_id: str, tokens: list[int], first_block: int, num_blocks: int) -> SaveJob:
    kv = torch.randn(SPEC.shape(num_blocks * 32)).to(torch.bfloat16)
    return SaveJob(req_id, NS, tokens, kv, first_block)


def saves_of(client: Client, **limits: float) -> AsyncSaves:
    return AsyncSaves(lambda ns, ids, kv, first: client.put(ns, ids, kv, first_block=first),
                      SaveLimits(**limits))


def stored(client: Client, tokens: list[int]) -> int:
    return client.lookup(NS, tokens).matched_tokens


def test_a_save_over_the_cap_is_dropped_and_its_request_freed_at_once(client):
    saves = saves_of(client, max_queued_bytes=SPEC.block_bytes)
    try:
        tokens = [t + 1000 for t in TOKENS]
        assert not saves.submit("r", 2 * SPEC.block_bytes, lambda: job("r", tokens, 0, 2))
        assert saves.restarts("r")  # the next save puts the request from block 0
        assert saves.finished({"r"}) == {"r"}
        counters = saves.take_stats()
        assert (counters.dropped_saves, counters.saved_blocks) == (1, 0)
        assert stored(client, tokens) == 0
    finally:
        saves.close()


def test_blocks_behind_a_lost_save_are_not_stored_and_the_next_save_starts_over(client):
    """A put of blocks 2-3 whose blocks 0-1 were never stored fails (NotFound) and stores
    nothing, not blocks with a gap before them; the request's next save is whole."""
    saves = saves_of(client)
    try:
        tokens = [t + 2000 for t in TOKENS]
        assert saves.submit("r", 2 * SPEC.block_bytes, lambda: job("r", tokens, 2, 2))
        assert wait_for(lambda: saves.restarts("r"))
        assert saves.take_stats().failed_saves == 1
        assert stored(client, tokens) == 0
        assert saves.submit("r", 4 * SPEC.block_bytes, lambda: job("r", tokens, 0, 4))
        assert wait_for(lambda: saves.finished({"r"}) == {"r"})
        assert saves.take_stats().saved_blocks == 4
        assert stored(client, tokens) == 128
        assert saves.queued_bytes == 0
    finally:
        saves.close()


def test_a_request_is_named_finished_once_and_close_lets_queued_puts_land(client):
    saves = saves_of(client)
    tokens = [t + 3000 for t in TOKENS]
    saves.seen("planned-only")  # a save planned but never submitted is still reported
    assert saves.finished({"planned-only", "unknown"}) == {"planned-only"}
    assert saves.finished({"planned-only"}) == set()
    assert saves.submit("q", 4 * SPEC.block_bytes, lambda: job("q", tokens, 0, 4))
    saves.close()
    assert stored(client, tokens) == 128


@pytest.mark.parametrize("limits", [{"max_queued_bytes": -1}, {"max_queued_bytes": True},
                                    {"put_timeout_ms": 0}, {"put_timeout_ms": "5"}])
def test_save_limits_name_the_field_that_is_wrong(limits):
    with pytest.raises(InvalidArgument, match=next(iter(limits))):
        SaveLimits(**limits)


def test_a_steps_save_goes_in_pieces_and_the_queue_holds_two_steps():
    """A step's blocks are queued in pieces of at most SAVE_PIECE_BYTES that cover them
    exactly, and the default queue holds two of the engine's largest steps (a fixed 1 GiB
    took no step of an 8B-shaped model at vLLM's 16,384-token budget, 2 GiB)."""
    from kvstore.integrations.vllm_saves import (
        DEFAULT_SAVE_QUEUE_BYTES,
        SAVE_PIECE_BYTES,
        SaveLimits,
        pieces,
    )

    block = 2 << 20  # a 16-token block of that model
    got = pieces(1000, block)
    assert got[0] == (0, SAVE_PIECE_BYTES // block) and got[-1][1] == 1000
    assert all(a[1] == b[0] for a, b in itertools.pairwise(got))
    assert pieces(3, SAVE_PIECE_BYTES * 2) == [(0, 1), (1, 2), (2, 3)]
    assert pieces(0, block) == []
    step = 16384 * (128 << 10)
    assert SaveLimits.from_extra_config({}, step).max_queued_bytes == 2 * step
    assert SaveLimits.from_extra_config({}, 0).max_queued_bytes == DEFAULT_SAVE_QUEUE_BYTES
    assert SaveLimits.from_extra_config({"save_queue_bytes": 5}, step).max_queued_bytes == 5
