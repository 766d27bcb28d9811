"""Rich tables for the admin commands: tiers, requests, blocks and doctor checks."""

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rich.console import Group, RenderableType
from rich.table import Table

from kvstore.cli.doctor import format_bytes

if TYPE_CHECKING:
    from kvstore.api import BlockInfo, StoreStats
    from kvstore.cli.doctor import Check

_TIER_ROWS = ("capacity_bytes", "used_bytes", "num_blocks", "hits", "misses", "bytes_written",
              "bytes_read", "evictions", "corrupt", "rejected")
_STATUS_STYLE = {"ok": "[green]ok[/]", "warn": "[yellow]warn[/]", "fail": "[red]FAIL[/]"}


def _ratio(num: float, den: float) -> str:
    return f"{num / den:.1%}" if den else "-"


def _number(value: Any, name: str) -> str:
    if value is None:
        return "-"
    if name.endswith("_bytes"):
        return format_bytes(int(value))
    return str(int(value)) if float(value).is_integer() else f"{value:.3g}"


def tier_table(tiers: dict[str, dict[str, Any]]) -> Table:
    """A column per tier, a row per figure (fits 80 columns however many counters there are)."""
    table = Table(title="tiers")
    table.add_column("")
    for name in tiers:
        table.add_column(name, justify="right")
    rows: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        ("capacity", lambda t: format_bytes(t["capacity_bytes"])),
        ("used", lambda t: f"{format_bytes(t['used_bytes'])} "
                           f"({_ratio(t['used_bytes'], t['capacity_bytes'])})"),
        ("blocks", lambda t: str(t["num_blocks"])),
        ("hit rate", lambda t: _ratio(t["hits"], t["hits"] + t["misses"])),
        ("hits / misses", lambda t: f"{t['hits']} / {t['misses']}"),
        ("bytes in", lambda t: format_bytes(t["bytes_written"])),
        ("bytes out", lambda t: format_bytes(t["bytes_read"])),
        ("evictions", lambda t: str(t["evictions"])),
        ("corrupt", lambda t: str(t["corrupt"])),
        ("rejected", lambda t: str(t["rejected"])),
    ]
    for label, cell in rows:
        table.add_row(label, *(cell(t) for t in tiers.values()))
    extras = sorted({k for t in tiers.values() for k in t} - set(_TIER_ROWS) - {"name"})
    for key in extras:  # tier-specific gauges (arena size, segments, ...)
        table.add_row(key, *(_number(t.get(key), key) for t in tiers.values()))
    return table


def request_table(counters: dict[str, Any]) -> Table:
    """Request counters, one per row, with the token hit rate of lookups."""
    table = Table(title="requests")
    table.add_column("counter")
    table.add_column("value", justify="right")
    for name, value in counters.items():
        table.add_row(name, str(value))
    hit, miss = counters.get("lookup_hit_tokens", 0), counters.get("lookup_miss_tokens", 0)
    table.add_row("lookup token hit rate", _ratio(hit, hit + miss))
    return table


def render_stats(stats: "StoreStats") -> RenderableType:
    """The tier table above the request table."""
    data = stats.as_dict()
    tiers = data.pop("tiers")
    return Group(tier_table(tiers), request_table(data))


def format_age(seconds: float) -> str:
    """``75`` -> ``1m15s``: the two largest units."""
    whole = int(seconds)
    for unit, size, sub, sub_size in (("d", 86400, "h", 3600), ("h", 3600, "m", 60),
                                      ("m", 60, "s", 1)):
        if whole >= size:
            return f"{whole // size}{unit}{(whole % size) // sub_size}{sub}"
    return f"{seconds:.1f}s"


def block_row(info: "BlockInfo") -> dict[str, Any]:
    """A listed block as JSON-friendly values (keys in hex)."""
    return {"key": info.key.hex(), "tenant": info.tenant, "model_id": info.model_id,
            "tiers": list(info.tiers), "size_bytes": info.size_bytes, "age_s": info.age_s,
            "hits": info.hits, "block_index": info.block_index,
            "parent": info.parent.hex() if info.parent else None}


def blocks_table(rows: list[dict[str, Any]], limit: int) -> Table:
    """Listed blocks; borderless, so a whole key (what ``evict --key`` takes) fits 80 columns."""
    full = " (limit reached: raise --limit)" if rows and len(rows) == limit else ""
    table = Table(title=f"{len(rows)} blocks{full}", box=None, pad_edge=False,
                  collapse_padding=True, header_style="bold")
    for header in ("key", "tenant", "model", "tier", "block", "size", "age", "hits"):
        table.add_column(header, justify="right" if header in ("block", "size", "hits") else "left",
                         no_wrap=header in ("key", "tier", "size", "age"), overflow="fold",
                         min_width=len(header))
    for r in rows:
        table.add_row(r["key"], r["tenant"], r["model_id"], ",".join(r["tiers"]),
                      str(r["block_index"]), format_bytes(r["size_bytes"]),
                      format_age(r["age_s"]), str(r["hits"]))
    return table


def cluster_table(rows: list[dict[str, Any]], limit: int) -> Table:
    """``ls --cluster``: which live host holds which block, and for how long unless renewed."""
    full = " (limit reached: raise --limit)" if rows and len(rows) == limit else ""
    table = Table(title=f"{len(rows)} cluster entries{full}", box=None, pad_edge=False,
                  collapse_padding=True, header_style="bold")
    for header in ("key", "host", "tiers", "model", "block", "expires in"):
        table.add_column(header, no_wrap=header in ("key", "host"), overflow="fold")
    for r in rows:
        table.add_row(r["key"], r["host"], ",".join(r["tiers"]), r["model_id"],
                      str(r["block_index"]), f"{r['expires_in_s']:.1f}s")
    return table


def checks_table(checks: list["Check"]) -> Table:
    """``kvstore doctor``'s checks, one per row, the status in colour."""
    table = Table(title="kvstore doctor")
    for header in ("check", "status", "detail"):
        table.add_column(header)
    for c in checks:
        table.add_row(c.name, _STATUS_STYLE[c.status], c.detail)
    return table
