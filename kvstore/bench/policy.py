"""``kvstore bench policy``: replay request traces through a simulated tier chain driven by the
real policy code, and compare eviction and fetch policies by modelled time to first token.

The simulator keeps a clock (the trace's arrival times) and a chain of tiers of given
capacities (HBM-like, DRAM, SSD) under the store's rules (kvstore/store/placement.py): a new
block goes to the fastest tier that can make room, making room is atomic (the tier's
``EvictionOrder.evict``), a victim moves to the next tier down that admits it
(``AdmissionPolicy``) unless a faster tier holds it or the walk reaches a tier that does, or is
dropped; blocks fetched from below the first tier are copied into it; a put writes the blocks
not stored yet and then, into faster tiers whose admission ``lifts`` them, its copies of blocks
held only further down; only full blocks are stored. Each request is a
lookup (touching its matched chain in every tier), a fetch of the prefix its policy chooses
(``advise`` over ``PathModel``s and a ``PrefillModel``), a put and the put's touch.

Time to first token = the fetch of the chosen head, path after path, each behind what earlier
requests queued on it, + the prefill of the tail after it. Prefill itself is not queued (each
request is taken to have the engine to itself), and writes down the chain do not delay reads.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvstore.bench.traces import UNIT_TOKENS, Request, Trace, block_keys
from kvstore.errors import InvalidArgument
from kvstore.keys import BlockKey
from kvstore.policy import build_order
from kvstore.policy.admission import admission_for
from kvstore.policy.base import AdmissionPolicy, EvictionOrder
from kvstore.policy.cost import ModelProfile, PathModel, PrefillModel, advise
from kvstore.policy.heap import IndexedHeap, merge_ascending
from kvstore.policy.history import UseHistory
from kvstore.room import Footprint, RoomNeed


@dataclass(frozen=True, slots=True)
class TierProfile:
    """One tier of the simulated machine and its read path into the engine."""

    name: str
    read_bytes_per_s: float
    read_fixed_s: float
    admit_after_accesses: int = 0  # the frequency filter for blocks moving down (LRU, ARC)


# DESIGN.md "Measured ceilings" (H200 host): device copy ~4000 GB/s, pinned host -> device
# 55 GB/s, O_DIRECT disk read 2.0 GB/s; fixed costs per transfer: kernel launch, DMA submit,
# an NVMe read. SSD admission as the store's default (SsdConfig.admit_after_accesses).
H200_TIERS = (TierProfile("hbm", 4000e9, 5e-6), TierProfile("dram", 55e9, 20e-6),
              TierProfile("ssd", 2e9, 100e-6, admit_after_accesses=2))
# An 8B-class model (Llama-3-8B shape): 32 layers, 8 KV heads of 128, bf16 K and V.
MODEL_8B = ModelProfile(num_params=8e9, num_layers=32, hidden_size=4096, flops_per_s=4e14)
KV_BYTES_PER_TOKEN_8B = 2 * 32 * 8 * 128 * 2


@dataclass(frozen=True, slots=True)
class PolicySpec:
    """A policy under test: which eviction order every tier uses, and how much to fetch."""

    name: str
    order: str  # "lru", "arc", "value" or "oracle"
    fetch: str  # "advise", "all", "none" or "best" (the exact minimum)


POLICIES = (PolicySpec("kvstore", "value", "advise"), PolicySpec("lru", "lru", "advise"),
            PolicySpec("arc", "arc", "advise"), PolicySpec("always-fetch", "lru", "all"),
            PolicySpec("always-recompute", "lru", "none"),
            PolicySpec("oracle", "oracle", "best"))


class SimClock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


class FutureOrder(EvictionOrder):
    """Belady's order: the block used again furthest in the future goes first (ties: the
    deeper block), from a rank the simulator keeps up to date. Only the oracle uses it."""

    def __init__(self, rank: Callable[[BlockKey], float]) -> None:
        self._rank = rank
        self._footprints: dict[BlockKey, Footprint] = {}
        self._heaps: dict[int, IndexedHeap[BlockKey]] = {}

    def add(self, key: BlockKey, footprint: Footprint) -> None:
        self.remove(key)
        self._footprints[key] = footprint
        self._heaps.setdefault(footprint.size_class, IndexedHeap()).push(key, self._rank(key))

    def refile(self, key: BlockKey, footprint: Footprint) -> None:
        if key in self._footprints:
            self.add(key, footprint)

    def touch_chain(self, keys: Sequence[BlockKey], group: bytes | None = None) -> None:
        for key in keys:
            footprint = self._footprints.get(key)
            if footprint is not None:
                self._heaps[footprint.size_class].update(key, self._rank(key))

    def remove(self, key: BlockKey) -> None:
        footprint = self._footprints.pop(key, None)
        if footprint is not None:
            self._heaps[footprint.size_class].remove(key)

    def charge(self, key: BlockKey) -> int:
        footprint = self._footprints.get(key)
        return 0 if footprint is None else footprint.nbytes

    def coldest(self, nbytes: int, is_protected: Callable[[BlockKey], bool],
                size_class: int | None = None) -> list[BlockKey]:
        heaps = self._heaps.values() if size_class is None else [
            h for c, h in self._heaps.items() if c == size_class]
        victims, freed = [], 0
        for key in merge_ascending(heaps):
            if freed >= nbytes:
                break
            if not is_protected(key):
                victims.append(key)
                freed += self._footprints[key].nbytes
        return victims

    def __len__(self) -> int:
        return len(self._footprints)


@dataclass(slots=True)
class SimTier:
    profile: TierProfile
    capacity_bytes: int
    order: EvictionOrder
    admission: AdmissionPolicy
    path: PathModel
    held: dict[BlockKey, int] = field(default_factory=dict)  # key -> bytes
    used_bytes: int = 0
    busy_until_s: float = 0.0  # the read path is busy with earlier fetches until then
    bytes_read: int = 0
    bytes_written: int = 0
    hit_tokens: int = 0  # matched tokens this tier was the fastest holder of


@dataclass(frozen=True, slots=True)
class SimConfig:
    """What one simulation run models."""

    capacities_bytes: tuple[int, ...]  # per tier of ``tiers``
    tiers: tuple[TierProfile, ...] = H200_TIERS
    model: ModelProfile = MODEL_8B
    kv_bytes_per_token: int = KV_BYTES_PER_TOKEN_8B
    block_tokens: int = 512


class Simulator:
    """One policy over one trace (module docstring)."""

    def __init__(self, config: SimConfig, policy: PolicySpec, trace: Trace) -> None:
        if len(config.capacities_bytes) != len(config.tiers):
            raise InvalidArgument("one capacity per tier")
        if UNIT_TOKENS % config.block_tokens:
            raise InvalidArgument(f"block_tokens must divide 512, got {config.block_tokens}")
        self.config, self.policy = config, policy
        self.clock = SimClock()
        self.prefill = PrefillModel(config.model)
        self.block_bytes = config.block_tokens * config.kv_bytes_per_token
        self._requests = [(r, block_keys(r, config.block_tokens)) for r in trace.requests]
        self._next_use = self._future_uses() if policy.order == "oracle" else []
        self._rank: dict[BlockKey, float] = {}
        self.history = UseHistory()  # shared by the value orders of the chain, as in the store
        self.tiers = [self._tier(i, capacity) for i, capacity in
                      enumerate(config.capacities_bytes)]
        self._pinned: set[BlockKey] = set()
        self.ttft_s: list[float] = []
        self.num_tokens = self.matched_tokens = self.fetched_tokens = 0

    # ----------------------------------------------------------------------------- set-up

    def _tier(self, index: int, capacity: int) -> SimTier:
        profile = self.config.tiers[index]
        path = PathModel(profile.read_bytes_per_s, profile.read_fixed_s)
        if self.policy.order == "oracle":
            order: EvictionOrder = FutureOrder(lambda k: self._rank.get(k, 0.0))
        else:
            order = build_order(self.policy.order, self._saving(index, path), self.clock,
                                self.history, index)
        admission = admission_for(profile.admit_after_accesses, 1 << 16, self.policy.order)
        return SimTier(profile, capacity, order, admission, path)

    def _saving(self, index: int, path: PathModel) -> Callable[[Footprint, int | None], float]:
        """What a hit in tier ``index`` saves against the next tier down or recompute."""
        bt = self.config.block_tokens
        lower = self.config.tiers[index + 1] if index + 1 < len(self.config.tiers) else None
        lower_path = None if lower is None else PathModel(lower.read_bytes_per_s,
                                                          lower.read_fixed_s)

        def saved_s(footprint: Footprint, depth: int | None) -> float:
            recompute = self.prefill.time_s(bt, bt * (depth or 0))
            if lower_path is not None:
                recompute = min(recompute, lower_path.time_s(footprint.nbytes, queued=False))
            return recompute - path.time_s(footprint.nbytes, queued=False)

        return saved_s

    def _future_uses(self) -> list[list[int]]:
        """For each request and block, the index of the next request using it (or never)."""
        never = len(self._requests) + 1
        following: dict[BlockKey, int] = {}
        out: list[list[int]] = [[] for _ in self._requests]
        for i in range(len(self._requests) - 1, -1, -1):
            keys = self._requests[i][1]
            out[i] = [following.get(k, never) for k in keys]
            for k in keys:
                following[k] = i
        return out

    # ----------------------------------------------------------------------------- replay

    def run(self) -> dict[str, Any]:
        for i, (request, keys) in enumerate(self._requests):
            self.clock.now_s = request.arrival_s
            if self._next_use:
                for depth, (k, nxt) in enumerate(zip(keys, self._next_use[i])):
                    self._rank[k] = -(nxt + depth / 1e4)  # furthest first, deeper first
            self._serve(request, keys)
        return self.summary()

    def _serve(self, request: Request, keys: list[BlockKey]) -> None:
        bt = self.config.block_tokens
        matched = self._match(keys)
        self._touch(keys[:len(matched)])
        for tier in self.tiers:
            tier.admission.note(keys[:len(matched)])
        num_fetch = self._choose(request, matched)
        ttft = self._fetch(request.arrival_s, matched[:num_fetch], commit=True)
        ttft += self.prefill.time_s(request.input_tokens - num_fetch * bt,
                                    min(num_fetch * bt, request.input_tokens))
        self.ttft_s.append(ttft)
        self.num_tokens += request.input_tokens
        self.matched_tokens += len(matched) * bt
        self.fetched_tokens += num_fetch * bt
        for t in matched:
            self.tiers[t].hit_tokens += bt
        self._pinned = set(keys)
        for key, t in zip(keys[:num_fetch], matched):
            if t > 0:  # served from below the first tier: promoted
                self._write(0, key)
        for tier in self.tiers:
            tier.admission.note(keys)
        holders = [self._holder(key) for key in keys]
        for key, holder in zip(keys, holders):
            is_new = holder is None and self._keeps(key)
            if is_new and not any(self._write(t, key) for t in range(len(self.tiers))):
                break  # the blocks after this one could never be matched
        for key, holder in zip(keys, holders):  # the put's copies of blocks held further down
            if holder:
                any(self._write(t, key) for t in range(holder)
                    if self.tiers[t].admission.lifts(key))
        self._pinned = set()
        self._touch(keys[:len(self._match(keys))])

    def _holder(self, key: BlockKey) -> int | None:
        """The fastest tier holding ``key``, if any."""
        return next((t for t, tier in enumerate(self.tiers) if key in tier.held), None)

    def _match(self, keys: list[BlockKey]) -> list[int]:
        """The fastest tier holding each block of the longest stored prefix."""
        out = []
        for key in keys:
            tier = next((t for t, tier in enumerate(self.tiers) if key in tier.held), None)
            if tier is None:
                break
            out.append(tier)
        return out

    def _touch(self, chain: list[BlockKey]) -> None:
        for tier in self.tiers:
            tier.order.touch_chain(chain)

    # ----------------------------------------------------------------------------- fetching

    def _choose(self, request: Request, matched: list[int]) -> int:
        """How many matched blocks the policy fetches."""
        mode = self.policy.fetch
        if mode == "none" or not matched:
            return 0
        if mode == "all":
            return len(matched)
        bt = self.config.block_tokens
        if mode == "best":
            costs = [self._fetch(request.arrival_s, matched[:k], commit=False)
                     + self.prefill.time_s(request.input_tokens - k * bt,
                                           min(k * bt, request.input_tokens))
                     for k in range(len(matched) + 1)]
            return int(np.argmin(costs))
        now = request.arrival_s
        for tier in self.tiers:  # the advice sees what is queued on each path
            tier.path.queued_bytes = int(max(0.0, tier.busy_until_s - now)
                                         * tier.profile.read_bytes_per_s)
        paths = {tier.profile.name: tier.path for tier in self.tiers}
        advice = advise([self.tiers[t].profile.name for t in matched],
                        [self.block_bytes] * len(matched), bt, request.input_tokens, paths,
                        self.prefill)
        return advice.fetch_tokens // bt

    def _fetch(self, now: float, sources: list[int], commit: bool) -> float:
        """Seconds until the blocks from ``sources`` (a tier each) have arrived, path after
        path, fastest first, each behind its queue; with ``commit`` the paths are taken."""
        t = now
        for index, tier in enumerate(self.tiers):
            num_blocks = sources.count(index)
            if not num_blocks:
                continue
            nbytes = num_blocks * self.block_bytes
            start = max(t, tier.busy_until_s)
            t = start + tier.profile.read_fixed_s + nbytes / tier.profile.read_bytes_per_s
            if commit:
                tier.busy_until_s = t
                tier.bytes_read += nbytes
        return t - now

    # ----------------------------------------------------------------------------- placement

    def _keeps(self, key: BlockKey) -> bool:
        """The oracle stores only blocks it knows will be used again."""
        return self.policy.order != "oracle" or self._rank.get(key, 0.0) > -len(self._requests)

    def _write(self, index: int, key: BlockKey) -> bool:
        """Make room in tier ``index`` (atomically) and place ``key`` there."""
        tier = self.tiers[index]
        nbytes = self.block_bytes
        if key in tier.held:
            return True
        if nbytes > tier.capacity_bytes:
            return False
        need = tier.used_bytes + nbytes - tier.capacity_bytes
        if need > 0:
            victims = tier.order.evict(RoomNeed(need), self._pinned.__contains__)
            if victims is None:
                return False
            for victim in victims:
                self._give_up(index, victim)
        tier.held[key] = nbytes
        tier.used_bytes += nbytes
        tier.bytes_written += nbytes
        tier.order.add(key, Footprint(0, nbytes))
        return True

    def _give_up(self, index: int, key: BlockKey) -> None:
        """Remove ``key`` from tier ``index``, first moving it down to the next tier that
        admits it unless a faster tier holds it or a lower one is reached that does."""
        faster = any(key in t.held for t in self.tiers[:index])
        if not faster and self._keeps(key):
            self._pinned.add(key)  # the page outlives its copy down the chain
            for lower in range(index + 1, len(self.tiers)):
                if key in self.tiers[lower].held:
                    break
                if self.tiers[lower].admission.admits(key) and self._write(lower, key):
                    break
            self._pinned.discard(key)
        tier = self.tiers[index]
        tier.used_bytes -= tier.held.pop(key)
        tier.order.remove(key)

    # ----------------------------------------------------------------------------- results

    def summary(self) -> dict[str, Any]:
        ttft_ms = np.asarray(self.ttft_s) * 1e3
        total = max(self.num_tokens, 1)
        row: dict[str, Any] = {
            "num_requests": len(self.ttft_s),
            "ttft_mean_ms": float(ttft_ms.mean()) if ttft_ms.size else 0.0,
            "ttft_p50_ms": float(np.percentile(ttft_ms, 50)) if ttft_ms.size else 0.0,
            "ttft_p99_ms": float(np.percentile(ttft_ms, 99)) if ttft_ms.size else 0.0,
            "hit_rate": self.matched_tokens / total,
            "fetched_rate": self.fetched_tokens / total,
        }
        if self.policy.order == "value":  # what the value orders' shared history learned
            row["tau_s"] = self.history.tau_s
        for tier in self.tiers:
            name = tier.profile.name
            row[f"hit_rate_{name}"] = tier.hit_tokens / total
            row[f"read_gib_{name}"] = tier.bytes_read / 2**30
            row[f"written_gib_{name}"] = tier.bytes_written / 2**30
        return row


def simulate(trace: Trace, config: SimConfig,
             policies: Sequence[PolicySpec] = POLICIES) -> dict[str, dict[str, Any]]:
    """``{policy name: summary}`` for one trace at one set of capacities."""
    return {p.name: Simulator(config, p, trace).run() for p in policies}


def working_set_bytes(trace: Trace, config: SimConfig) -> int:
    """Bytes of the distinct full blocks the trace stores."""
    keys = {k for r in trace.requests for k in block_keys(r, config.block_tokens)}
    return len(keys) * config.block_tokens * config.kv_bytes_per_token


__all__ = ["H200_TIERS", "MODEL_8B", "POLICIES", "FutureOrder", "PolicySpec", "SimConfig",
           "Simulator", "TierProfile", "simulate", "working_set_bytes"]


# ------------------------------------------------------------------------------------ the bench

# Capacity points as fractions of a trace's distinct block bytes, per tier (HBM, DRAM, SSD):
# "tight" holds well under the working set even with SSD, "roomy" most of it below HBM.
CAPACITY_POINTS = {"tight": (0.04, 0.15, 0.6), "roomy": (0.1, 0.4, 1.5)}
# Sizes of the synthetic traces: the default run takes about a minute on the 2-core box.
FULL_SIZES: dict[str, dict[str, int]] = {
    "chat": {"num_sessions": 100}, "doc-qa": {"num_questions": 250},
    "agentic": {"num_tasks": 20}, "no-reuse": {"num_requests": 200}}
QUICK_SIZES: dict[str, dict[str, int]] = {
    "chat": {"num_sessions": 12}, "doc-qa": {"num_docs": 6, "num_questions": 30},
    "agentic": {"num_tasks": 3}, "no-reuse": {"num_requests": 20}}
COLUMNS = ("policy", "ttft_mean_ms", "ttft_p50_ms", "ttft_p99_ms", "hit_rate", "hit_rate_hbm",
           "hit_rate_dram", "hit_rate_ssd", "fetched_rate", "read_gib_hbm", "read_gib_dram",
           "read_gib_ssd", "written_gib_ssd")


def bench_traces(trace_files: Sequence[str] = (), quick: bool = False) -> list[Trace]:
    """The given Mooncake files, or else the synthetic traces."""
    from kvstore.bench import traces

    if trace_files:
        return [traces.load_mooncake(path) for path in trace_files]
    sizes = QUICK_SIZES if quick else FULL_SIZES
    return [make(**sizes[name]) for name, make in traces.SYNTHETIC.items()]


def run_policy_bench(trace_files: Sequence[str] = (), quick: bool = False,
                     block_tokens: int = 512) -> tuple[Any, dict[str, dict[str, Any]]]:
    """Every policy over every trace at every capacity point.

    Returns:
        The report (one table per trace and capacity) and ``{trace: {policy: summary}}``.
    """
    from kvstore.bench.report import BenchReport, Column

    results: dict[str, dict[str, Any]] = {}
    rows = []
    for trace in bench_traces(trace_files, quick):
        base = SimConfig(capacities_bytes=(0,) * len(H200_TIERS), block_tokens=block_tokens)
        working = working_set_bytes(trace, base)
        # Nothing is reused on a no-reuse stream: one capacity says all there is.
        points = list(CAPACITY_POINTS.items())[:1 if trace.name == "no-reuse" else None]
        for label, fractions in points:
            capacities = tuple(int(f * working) for f in fractions)
            name = f"{trace.name}/{label}"
            config = SimConfig(capacities_bytes=capacities, block_tokens=block_tokens)
            results[name] = simulate(trace, config)
            for policy, summary in results[name].items():
                rows.append({"trace": name, "policy": policy, **summary,
                             "capacities_gib": [round(c / 2**30, 1) for c in capacities]})
    columns = tuple(Column(key, key.replace("_", " "), 3 if "rate" in key else 1,
                           "left" if key == "policy" else "right") for key in COLUMNS)
    notes = (("TTFT is modelled: fetch of the chosen head over each tier's path (H200 links, "
              "queued behind earlier fetches) + prefill of the tail (8B model at 4e14 FLOP/s)."),
             ("Capacities per tier (HBM, DRAM, SSD) are fractions of each trace's distinct "
              f"block bytes: {CAPACITY_POINTS}."))
    report = BenchReport(name="policy", title="Eviction and fetch policies (modelled TTFT)",
                         columns=columns, rows=tuple(rows), section_key="trace", notes=notes,
                         params={"block_tokens": block_tokens, "quick": quick,
                                 "traces": list(trace_files) or "synthetic",
                                 "tiers": [t.name for t in H200_TIERS]})
    return report, results


def write_policy_report(report: Any, results: Mapping[str, Any], path: Any = None, *,
                        console: Any = None, command: str | None = None) -> Any:
    """Print the tables, write the JSON (the report plus ``{"traces": ...}``) and a PNG plot of
    hit rate and TTFT saved beside it (where matplotlib is installed; else a line says how)."""
    from rich.console import Console

    from kvstore.bench.report import print_plot, write_report

    console = console or Console()
    target = write_report(report, path, console=console, command=command,
                          extra={"traces": results})
    print_plot(console, plot(results, target.with_suffix(".png")))
    return target


def plot(results: Mapping[str, Mapping[str, Mapping[str, Any]]], path: Any) -> Any:
    """Two panels, a group of bars per trace and tier size, a bar per policy: token hit rate,
    and mean TTFT saved against recomputing every prompt (ms). Returns the path, or None where
    matplotlib is not installed."""
    from kvstore.bench.report import pyplot

    plt = pyplot()
    if plt is None:
        return None
    names = list(results)
    policies = list(next(iter(results.values()))) if results else []
    xs = np.arange(len(names))
    width = 0.8 / max(len(policies), 1)
    fig, (hits, saved) = plt.subplots(2, 1, figsize=(max(6.0, 1.4 * len(names)), 6.4),
                                      sharex=True)
    for i, policy in enumerate(policies):
        offset = xs - 0.4 + (i + 0.5) * width
        rows = [results[n][policy] for n in names]
        hits.bar(offset, [r["hit_rate"] for r in rows], width, label=policy)
        baseline = [results[n].get("always-recompute", r)["ttft_mean_ms"]
                    for n, r in zip(names, rows)]
        saved.bar(offset, [b - r["ttft_mean_ms"] for b, r in zip(baseline, rows)], width)
    hits.set_ylabel("token hit rate")
    hits.set_ylim(0, 1.2)  # room for the legend above the bars
    hits.legend(fontsize=7, ncol=6, loc="upper center")
    saved.set_ylabel("mean TTFT saved vs recompute (ms)")
    saved.set_xticks(xs, names, rotation=30, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
