"""The rich tables of the admin commands, rendered to plain text without a daemon."""

from __future__ import annotations

import io

import pytest
from rich.console import Console, RenderableType

from kvstore.cli.render import blocks_table, format_age, request_table, tier_table


def text(renderable: RenderableType) -> str:
    console = Console(file=io.StringIO(), width=120, color_system=None)
    console.print(renderable)
    return console.file.getvalue()


def tier(**fields: float) -> dict[str, float]:
    base = dict.fromkeys(("capacity_bytes", "used_bytes", "num_blocks", "hits", "misses",
                          "bytes_written", "bytes_read", "evictions", "corrupt", "rejected"), 0)
    return {**base, **fields}


@pytest.mark.parametrize("seconds, shown", [
    (5.5, "5.5s"), (75, "1m15s"), (3725, "1h2m"), (90061, "1d1h"),
])
def test_format_age_shows_the_two_largest_units(seconds: float, shown: str) -> None:
    assert format_age(seconds) == shown


def test_tier_table_rates_and_extra_gauges() -> None:
    table = text(tier_table({
        "dram": tier(capacity_bytes=4 << 20, used_bytes=1 << 20, hits=3, misses=1,
                     arena_bytes=2 << 20),
        "ssd": tier(num_segments=7),
    }))
    assert "25.0%" in table  # used / capacity of dram
    assert "75.0%" in table  # hit rate of dram
    arena = next(line for line in table.splitlines() if "arena_bytes" in line)
    assert "2.0 MiB" in arena and "-" in arena  # a _bytes gauge as bytes; ssd has none
    segments = next(line for line in table.splitlines() if "num_segments" in line)
    assert "7" in segments


def test_request_table_hit_rate_of_lookup_tokens() -> None:
    assert "75.0%" in text(request_table({"lookup_hit_tokens": 3, "lookup_miss_tokens": 1}))
    no_lookups = text(request_table({"lookups": 0}))
    rate = next(line for line in no_lookups.splitlines() if "lookup token hit rate" in line)
    assert rate.rstrip(" │").endswith("-")  # no tokens looked up: no rate, not 0%


def test_blocks_table_says_when_the_limit_cut_the_list() -> None:
    row = {"key": "ab" * 16, "tenant": "acme", "model_id": "m", "tiers": ["dram", "ssd"],
           "block_index": 0, "size_bytes": 1536, "age_s": 75.0, "hits": 2}
    full = text(blocks_table([row], limit=1))
    assert "1 blocks (limit reached: raise --limit)" in full
    assert "ab" * 16 in full and "dram,ssd" in full and "1.5 KiB" in full and "1m15s" in full
    assert "limit reached" not in text(blocks_table([row], limit=10))
    assert "limit reached" not in text(blocks_table([], limit=0))
