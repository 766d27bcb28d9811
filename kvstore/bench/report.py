"""Benchmark reports: one rich table on the console and one JSON file per ``kvstore bench`` run."""

from __future__ import annotations

import json
import os
import platform
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType
from typing import Any

from rich.console import Console
from rich.table import Table

RESULTS_DIR = Path("bench") / "results"  # relative to where the command runs
# What a bench prints in place of its PNG where matplotlib (the ``bench`` extra) is missing.
PLOT_HINT = 'no plot: matplotlib is not installed (pip install "kvstore[bench]" for the PNG)'


@dataclass(frozen=True, slots=True)
class Column:
    """One table column: the row key it shows, its header, and how floats are rounded."""

    key: str
    header: str
    digits: int = 2  # decimals for float cells
    justify: str = "right"  # "left" for text columns


@dataclass(frozen=True, slots=True)
class BenchReport:
    """The result of one benchmark run: parameters and rows of measurements."""

    name: str  # "tiers", "rpc", "codecs": also the JSON file prefix
    title: str
    columns: tuple[Column, ...]
    rows: tuple[Mapping[str, Any], ...]
    params: Mapping[str, Any] = field(default_factory=dict)
    notes: tuple[str, ...] = ()  # printed under the table and kept in the JSON
    # Rows with different values of this key print as separate tables (one per section).
    section_key: str | None = None

    def as_dict(self, command: str | None = None) -> dict[str, Any]:
        """The JSON document: what ran, where, when, with which parameters, and the rows."""
        return {
            "bench": self.name,
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "host": platform.node(),
            "command": command if command is not None else " ".join(sys.argv),
            "environment": environment(),
            "params": dict(self.params),
            "rows": [dict(row) for row in self.rows],
            "notes": list(self.notes),
        }


def environment() -> dict[str, Any]:
    """Versions and hardware facts that change what a number means."""
    import torch

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "cuda": torch.cuda.is_available(),
    }
    if info["cuda"]:
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def default_path(name: str, now: datetime | None = None) -> Path:
    """``bench/results/<name>-<YYYYmmdd-HHMMSS>.json`` (local time, one file per run)."""
    stamp = (now or datetime.now()).strftime("%Y%m%d-%H%M%S")
    return RESULTS_DIR / f"{name}-{stamp}.json"


def format_cell(value: Any, digits: int) -> str:
    """Table text of one value: floats rounded, booleans as yes/no, None as a dash."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def render_table(report: BenchReport) -> Table:
    """The report's rows as a rich table."""
    table = Table(title=report.title)
    for col in report.columns:
        table.add_column(col.header, justify=col.justify)
    for row in report.rows:
        table.add_row(*(format_cell(row.get(col.key), col.digits) for col in report.columns))
    return table


def render_tables(report: BenchReport) -> list[Table]:
    """One table, or with ``section_key`` one per section in first-seen order, each showing
    only the columns its rows fill."""
    if report.section_key is None:
        return [render_table(report)]
    sections: dict[Any, list[Mapping[str, Any]]] = {}
    for row in report.rows:
        sections.setdefault(row.get(report.section_key), []).append(row)
    return [render_table(replace(
        report, title=f"{report.title}: {name}", rows=tuple(rows), section_key=None,
        columns=tuple(c for c in report.columns if any(c.key in row for row in rows))))
        for name, rows in sections.items()]


def write_report(report: BenchReport, path: str | os.PathLike[str] | None = None, *,
                 console: Console | None = None, command: str | None = None,
                 extra: dict[str, object] | None = None) -> Path:
    """Print ``report`` as a table and write it as JSON.

    Args:
        report: what to show and store.
        path: JSON destination; None for ``default_path(report.name)``. Parents are created.
        console: where the table goes (stdout by default).
        command: the command line recorded in the JSON (default: ``sys.argv``).
        extra: more top-level JSON fields beside the report's (e.g. a benchmark's raw results).

    Returns:
        The path written.
    """
    console = console or Console()
    for table in render_tables(report):
        console.print(table)
    for note in report.notes:
        console.print(note)
    target = Path(path) if path is not None else default_path(report.name)
    target.parent.mkdir(parents=True, exist_ok=True)
    document = {**report.as_dict(command), **(extra or {})}
    target.write_text(json.dumps(document, indent=2) + "\n")
    console.print(f"results written to {target}")
    return target


def pyplot() -> ModuleType | None:
    """matplotlib's pyplot on its file-only Agg backend, or None where matplotlib is not
    installed (it comes with the ``bench`` extra; the tables and JSON need none of it)."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    return plt


def print_plot(console: Console, png: Path | None) -> None:
    """Say where the plot went, or in one line how to get it."""
    if png is None:
        console.print(PLOT_HINT, markup=False)
    else:
        console.print(f"plot written to {png}")


__all__ = ["PLOT_HINT", "BenchReport", "Column", "default_path", "environment", "format_cell",
           "print_plot", "pyplot", "render_table", "render_tables", "write_report"]
