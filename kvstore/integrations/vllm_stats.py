"""The vLLM connector's stats: counters a worker reports each step, summed for vLLM's log."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

# The counters, each summed over steps and workers; each is also a Prometheus counter
# ``vllm:kvstore_<name>`` of vLLM's own metrics endpoint.
COUNTERS = ("hit_tokens", "loaded_blocks", "load_error_blocks", "saved_blocks", "saved_bytes",
            "dropped_saves", "failed_saves")


@dataclass
class KVStoreConnectorStats(KVConnectorStats):
    """vLLM 0.32's stats container (``get_kv_connector_stats`` on the worker, rebuilt by
    ``build_kv_connector_stats`` in the logging process): ``data`` maps each of ``COUNTERS``
    to an int."""

    def __post_init__(self) -> None:
        self.data = {name: int(self.data.get(name, 0)) for name in COUNTERS}

    def reset(self) -> None:
        self.data = dict.fromkeys(COUNTERS, 0)

    def aggregate(self, other: KVConnectorStats) -> KVStoreConnectorStats:
        for name in COUNTERS:
            self.data[name] += int(other.data.get(name, 0))
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())

    @classmethod
    def of(cls, data: dict[str, Any]) -> KVStoreConnectorStats | None:
        """Stats of ``data``; None where every counter is zero (nothing to report)."""
        stats = cls(data=dict(data))
        return None if stats.is_empty() else stats


class KVStorePromMetrics(KVConnectorPromMetrics):
    """The counters on vLLM's Prometheus endpoint, one per engine (vLLM's engine labels).
    vLLM's MultiConnector requires every child that reports stats to have these: without
    them its first stats report failed an assertion and ended the engine."""

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {}
        for name in COUNTERS:
            metric = self._counter_cls(name=f"vllm:kvstore_{name}",
                                       documentation=f"kvstore connector: {name}",
                                       labelnames=labelnames)
            self._counters[name] = {idx: metric.labels(*values)
                                    for idx, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, per_engine in self._counters.items():
            value = int(transfer_stats_data.get(name, 0) or 0)
            if value > 0 and engine_idx in per_engine:
                per_engine[engine_idx].inc(value)
