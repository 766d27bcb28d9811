"""``kvstore bench engine``'s entry: options checked and turned into the run's settings, the
run, and its table, JSON and plot."""

from __future__ import annotations

from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from kvstore.bench.engine.configs import CONFIG_NAMES, CONFIGS, EngineOptions
from kvstore.bench.engine.run import default_python, run_engines
from kvstore.bench.engine.tables import build_report, plot
from kvstore.bench.engine.workloads import QUICK, WorkloadSize
from kvstore.bench.report import BenchReport
from kvstore.errors import KVStoreError


def run_engine_bench(*, python: Path | None = None, pythonpath: str = "", shape: str = "tiny",
                     device: str = "cpu", dtype: str | None = None, weights: str | None = None,
                     configs: tuple[str, ...] = (), quick: bool = False,
                     sizes: dict[str, int | None] | None = None,
                     engine_blocks: int | None = None, gpu_memory_utilization: float = 0.5,
                     interleave: bool | None = None,
                     extra_env: tuple[tuple[str, str], ...] = (), work_dir: Path | None = None,
                     keep_work_dir: bool = False) -> tuple[BenchReport, dict[str, Any]]:
    """Run every chosen configuration on every workload; the report and the JSON's extra
    fields. Bad options raise KVStoreError naming the option."""
    unknown = [c for c in configs if c not in CONFIG_NAMES]
    if unknown:
        raise KVStoreError(f"--config must be among {', '.join(CONFIG_NAMES)}, got "
                           f"{', '.join(unknown)}")
    chosen = tuple(c for c in CONFIGS if not configs or c.name in configs)
    try:
        size = replace(QUICK if quick else WorkloadSize(),
                       **{k: v for k, v in (sizes or {}).items() if v is not None})
        options = EngineOptions(
            python=python or default_python(), pythonpath=pythonpath, shape=shape,
            device=device, dtype=dtype or ("float32" if device == "cpu" else "bfloat16"),
            weights=weights or ("checkpoint" if device == "cpu" else "redraw"),
            engine_blocks=engine_blocks, gpu_memory_utilization=gpu_memory_utilization,
            extra_env=extra_env,
            interleave=device == "cpu" if interleave is None else interleave)
    except ValueError as exc:
        raise KVStoreError(str(exc)) from None
    out, facts = run_engines(chosen, options, size,
                             None if work_dir is None else str(work_dir), keep_work_dir)
    params = {"shape": shape, "device": device, "dtype": options.dtype,
              "weights": options.weights, "block_size": options.block_size,
              "max_model_len": options.model_len(size), "python": str(options.python),
              "pythonpath": pythonpath, "sizes": asdict(size), "quick": quick,
              "configs": [c.name for c in chosen], "interleave": options.interleave}
    return build_report(out, chosen, params, facts)


def write_engine_report(report: BenchReport, extra: dict[str, Any], path: Path | None = None,
                        *, console: Any = None, command: str | None = None) -> Path:
    """Print the tables, write the JSON (the report and every request's result) and a PNG
    beside it (where matplotlib is installed; else a line says how)."""
    from rich.console import Console

    from kvstore.bench.report import print_plot, write_report

    console = console or Console()
    target = write_report(report, path, console=console, command=command, extra=extra)
    print_plot(console, plot(report, target.with_suffix(".png")))
    return target


__all__ = ["run_engine_bench", "write_engine_report"]
