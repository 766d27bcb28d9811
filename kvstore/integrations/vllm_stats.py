"""The vLLM connector's stats: counters a worker reports each step, summed for vLLM's log."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

# The counters, each summed over steps and workers.
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
