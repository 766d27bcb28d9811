"""The engine bench's results as rows: TTFT percentiles and hits per configuration and
workload, ratios against no cache in the same run, outputs compared between cached paths; the
report, its JSON and a plot."""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvstore.bench.engine.configs import BASELINE, EngineConfig
from kvstore.bench.engine.run import RunResults
from kvstore.bench.report import BenchReport, Column

REFERENCE = "prefix"  # the cached path every other one is compared with
WORKLOAD_ORDER = ("chat", "docs", "overflow", "restart")
WHAT = {
    "chat": "multi-turn chat: each prompt the last one, an answer and a new message",
    "docs": "long documents, each asked several questions",
    "overflow": "more documents than the engine's cache holds, asked round-robin",
    "restart": "the documents again in a fresh engine, the daemon kept",
}

COLUMNS = (
    Column("config", "config", justify="left"),
    Column("ttft_p50_ms", "TTFT p50 ms", 1),
    Column("ttft_p90_ms", "TTFT p90 ms", 1),
    Column("speedup_p50", "x no-cache p50", 2),
    Column("hit_ttft_p50_ms", "hits: TTFT p50 ms", 1),
    Column("hit_speedup_p50", "hits: x no-cache", 2),
    Column("hit_tokens", "hit tokens/req", 0),
    Column("hit_pct", "hit %", 0),
    Column("requests", "reqs", 0),
    Column("outputs", "outputs vs prefix cache", justify="left"),
    Column("status", "status", justify="left"),
)


@dataclass(slots=True)
class Comparison:
    """One configuration's outputs against the reference's, request by request, where both
    served the same number of cached tokens (a tail computed against cached K/V rounds
    differently from a full prefill, so only cached paths are compared with each other)."""

    config: str
    compared: int = 0
    identical: int = 0  # greedy tokens equal
    first_diff: list[int] = field(default_factory=list)  # per differing request
    max_abs_dlogprob: float = 0.0  # over the tokens before the first difference

    def add(self, ours: Mapping[str, Any], ref: Mapping[str, Any]) -> None:
        self.compared += 1
        a, b = ours["tokens"], ref["tokens"]
        same = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        if same is None and len(a) == len(b):
            self.identical += 1
            upto = len(a)
        else:
            upto = same if same is not None else min(len(a), len(b))
            self.first_diff.append(upto)
        for x, y in zip(ours["logprobs"][:upto], ref["logprobs"][:upto], strict=False):
            self.max_abs_dlogprob = max(self.max_abs_dlogprob, abs(x - y))

    def summary(self) -> str:
        if not self.compared:
            return "no request hit on both"
        text = f"{self.identical}/{self.compared} same"
        if self.first_diff:
            text += (f"; {len(self.first_diff) / self.compared:.0%} differ, first at token "
                     f"{min(self.first_diff)} (median {statistics.median(self.first_diff):g})")
        return text + f"; max |dlogprob| {self.max_abs_dlogprob:.2g}"


def percentile(values: list[float], q: float) -> float:
    """The ``q``-quantile by linear interpolation (numpy's default)."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def _reference_for(out: RunResults, workload: str) -> list[dict[str, Any]]:
    """The reference's results for ``workload``; a fresh engine's run of the documents is
    compared with the reference's run of the same prompts."""
    mine = out.results.get(REFERENCE, {})
    return mine.get(workload) or (mine.get("docs", []) if workload == "restart" else [])


def compare_outputs(out: RunResults, configs: tuple[EngineConfig, ...]
                    ) -> dict[str, dict[str, Comparison]]:
    """Every configuration but the baseline and the reference against the reference, per
    workload and over all of them (``"all"``)."""
    found: dict[str, dict[str, Comparison]] = {}
    for config in configs:
        if config.name in (BASELINE, REFERENCE) or config.name not in out.results:
            continue
        total = Comparison(config.name)
        found[config.name] = {"all": total}
        for workload, results in out.results[config.name].items():
            comparison = found[config.name][workload] = Comparison(config.name)
            for ours, ref in zip(results, _reference_for(out, workload), strict=False):
                cached = ours["num_cached_tokens"]
                if cached and cached == ref["num_cached_tokens"]:
                    comparison.add(ours, ref)
                    total.add(ours, ref)
    return found


def _baseline(out: RunResults, workload: str) -> list[dict[str, Any]]:
    base = out.results.get(BASELINE, {})
    return base.get(workload) or (base.get("docs", []) if workload == "restart" else [])


def rows(out: RunResults, configs: tuple[EngineConfig, ...],
         comparisons: Mapping[str, Mapping[str, Comparison]]) -> list[dict[str, Any]]:
    """One row per workload and configuration, in the table's order."""
    found = []
    for workload in WORKLOAD_ORDER:
        if not any(workload in r for r in out.results.values()):
            continue
        prompts = out.prompt_tokens.get(workload, [])
        base = [r["ttft_s"] for r in _baseline(out, workload)]
        for config in configs:
            row: dict[str, Any] = {"workload": workload, "config": config.name,
                                   "what": config.what}
            results = out.results.get(config.name, {}).get(workload)
            if config.name in out.errors and not results:
                row["status"] = f"not run: {out.errors[config.name]}"
            elif not results and workload == "restart":
                row["status"] = "a fresh engine keeps nothing: as its docs row"
            elif not results:
                row["status"] = "no results"
            else:
                row.update(_stats(results, prompts, base))
                row["status"] = _ran(out, config)
                if workload in comparisons.get(config.name, {}):
                    row["outputs"] = comparisons[config.name][workload].summary()
            found.append(row)
    return found


def _ran(out: RunResults, config: EngineConfig) -> str:
    """"ok", or for a cache that served no hit anywhere while its engine's log names an
    error, that error."""
    served = sum(r["num_cached_tokens"] for results in out.results[config.name].values()
                 for r in results)
    cause = out.log_errors.get(config.name)
    if config.name != BASELINE and not served and cause:
        return f"ran, no hits; its log: {cause}"
    return "ok"


def _stats(results: list[dict[str, Any]], prompts: list[int], base: list[float]
           ) -> dict[str, Any]:
    ttft = [r["ttft_s"] for r in results]
    cached = [r["num_cached_tokens"] for r in results]
    stats = {"ttft_p50_ms": 1e3 * percentile(ttft, 0.5), "ttft_p90_ms": 1e3 * percentile(ttft, 0.9),
             "hit_tokens": statistics.fmean(cached), "requests": len(results),
             "hit_pct": 100.0 * sum(cached) / max(1, sum(prompts[:len(cached)])),
             "ttft_ms": [1e3 * t for t in ttft], "cached_tokens": cached}
    if base:
        stats["speedup_p50"] = percentile(base, 0.5) / percentile(ttft, 0.5)
    hits = [i for i, c in enumerate(cached) if c]
    if hits:  # the requests that hit, against the baseline's time for the same prompts
        stats["hit_ttft_p50_ms"] = 1e3 * percentile([ttft[i] for i in hits], 0.5)
        same = [base[i] for i in hits if i < len(base)]
        if same:
            stats["hit_speedup_p50"] = (percentile(same, 0.5)
                                        / percentile([ttft[i] for i in hits], 0.5))
    return stats


def build_report(out: RunResults, configs: tuple[EngineConfig, ...], params: dict[str, Any],
                 facts: dict[str, Any]) -> tuple[BenchReport, dict[str, Any]]:
    """The report and the JSON's extra fields (every request's result, the comparisons)."""
    comparisons = compare_outputs(out, configs)
    notes = [f"{name}: {WHAT[name]}" for name in WORKLOAD_ORDER]
    notes.append("kvstore and LMCache run with vLLM's prefix cache off (every hit is theirs); "
                 "offload runs under vLLM's prefix cache. Outputs: greedy tokens against the "
                 "prefix cache's on requests where both served the same cached tokens.")
    for name, error in out.errors.items():
        notes.append(f"{name} did not run: {error}")
    report = BenchReport(
        name="engine", title="TTFT on a real vLLM engine, per configuration",
        columns=COLUMNS, rows=tuple(rows(out, configs, comparisons)),
        params={**params, **facts}, notes=tuple(notes), section_key="workload")
    extra = {"comparisons": {name: {w: asdict(c) for w, c in per.items()}
                             for name, per in comparisons.items()},
             "errors": dict(out.errors), "log_errors": dict(out.log_errors),
             "init_s": dict(out.init_s),
             "results": out.results, "prompt_tokens": out.prompt_tokens}
    return report, extra


def plot(report: BenchReport, path: Path) -> Path | None:
    """TTFT p50 per workload, a bar per configuration (log scale). None without matplotlib."""
    from kvstore.bench.report import pyplot

    plt = pyplot()
    if plt is None:
        return None
    ran = [r for r in report.rows if "ttft_p50_ms" in r]
    workloads = [w for w in WORKLOAD_ORDER if any(r["workload"] == w for r in ran)]
    configs = list(dict.fromkeys(r["config"] for r in ran))
    width = 0.8 / max(1, len(configs))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.8 * len(workloads)), 4.0))
    for i, config in enumerate(configs):
        values = {r["workload"]: r["ttft_p50_ms"] for r in ran if r["config"] == config}
        xs = [j + i * width for j, w in enumerate(workloads) if w in values]
        ax.bar(xs, [values[w] for w in workloads if w in values], width, label=config)
    ax.set_xticks([j + width * (len(configs) - 1) / 2 for j in range(len(workloads))])
    ax.set_xticklabels(workloads)
    ax.set_yscale("log")
    ax.set_ylabel("TTFT p50 (ms)")
    ax.set_title(report.title)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
