"""The ``kvstore`` command: serve, stats, ls, evict, doctor, bench and version."""

import dataclasses
import functools
import importlib
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, TypeVar

import typer
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table

from kvstore import __version__
from kvstore.config import KVStoreConfig, load_config, parse_assignments, parse_size
from kvstore.doctor import format_bytes
from kvstore.errors import KVStoreError, Unavailable

if TYPE_CHECKING:
    from kvstore.api import StoreStats
    from kvstore.bench.report import BenchReport
    from kvstore.client import Client

app = typer.Typer(name="kvstore", no_args_is_help=True, add_completion=False,
                  help="Tiered KV-cache store for LLM serving: run the daemon and manage it.")
bench_app = typer.Typer(no_args_is_help=True,
                        help="Benchmarks: print a table and write JSON (bench/results/).")
app.add_typer(bench_app, name="bench")
console = Console()  # resolves sys.stdout at print time, so test runners capture it

CLI_TIMEOUT_S = 10.0  # an admin command waits this long for the daemon per call
KEY_HEX_CHARS = 32  # a BlockKey is 16 bytes
F = TypeVar("F", bound=Callable[..., Any])

AddressOpt = Annotated[str | None, typer.Option(
    "--address", envvar="KVSTORE_ADDRESS", show_default=False,
    help="Daemon address, unix:///path or host:port [default: unix://<server.socket_path>]")]
TokenOpt = Annotated[str | None, typer.Option(
    "--token", envvar="KVSTORE_TOKEN", show_default=False,
    help="Bearer token of a tenant or the admin (required over TCP).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]
ConfigOpt = Annotated[Path | None, typer.Option(
    "--config", "-c", envvar="KVSTORE_CONFIG", dir_okay=False, show_default=False,
    help="TOML config file with dram, ssd and server tables.")]


def _boundary(command: F) -> F:
    """Turn a KVStoreError into ``error: <message>`` on stderr and exit code 1."""

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except KVStoreError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1) from None

    return run  # type: ignore[return-value]


def usage_error(message: str) -> NoReturn:
    """A command-line mistake typer cannot see by itself: message and exit code 2."""
    typer.echo(f"error: {message} (see --help)", err=True)
    raise typer.Exit(2)


def default_address(environ: dict[str, str] | None = None) -> str:
    """``unix://`` + the configured socket path (``KVSTORE_SERVER__SOCKET_PATH`` applies)."""
    return f"unix://{load_config(None, environ).server.socket_path}"


@contextmanager
def connect(address: str | None, token: str | None) -> Iterator["Client"]:
    """A client of the daemon; Unavailable names the address and how to start a daemon."""
    from kvstore.client import Client

    target = address or default_address()
    try:
        with Client(target, token=token, timeout_s=CLI_TIMEOUT_S) as client:
            yield client
    except Unavailable as exc:
        raise Unavailable(f"cannot reach the kvstore daemon at {target} ({exc}); start one "
                          "with `kvstore serve`, or point --address at it") from None


def _print_json(data: Any) -> None:
    typer.echo(json.dumps(data, indent=2, default=str))


# ----------------------------------------------------------------------------------- serve

# Each named `serve` flag sets one config field; its environment variable is that field's own.
SERVE_FLAGS: dict[str, tuple[str, str]] = {
    "socket": ("server", "socket_path"),
    "tcp": ("server", "tcp_address"),
    "metrics_port": ("server", "metrics_port"),
    "dram_capacity": ("dram", "capacity_bytes"),
    "ssd_path": ("ssd", "path"),
    "ssd_capacity": ("ssd", "capacity_bytes"),
    "log_level": ("server", "log_level"),
}


def serve_overrides(flags: dict[str, Any], assignments: list[str]) -> dict[str, dict[str, Any]]:
    """The config overrides of ``serve``'s flags, then its ``--set`` items (which win)."""
    out: dict[str, dict[str, Any]] = {}
    for name, value in flags.items():
        if value is not None:
            section, field = SERVE_FLAGS[name]
            out.setdefault(section, {})[field] = value
    for section, fields in parse_assignments(assignments).items():
        out.setdefault(section, {}).update(fields)
    return out


def redacted(config: KVStoreConfig) -> dict[str, Any]:
    """The config as a dict with token values hidden."""
    data = dataclasses.asdict(config)
    server = data["server"]
    server["tenant_tokens"] = dict.fromkeys(server["tenant_tokens"], "***")
    server["admin_token"] = "***" if server["admin_token"] else ""
    return data


def _field_option(section: str, field: str, help_text: str, kind: type = str) -> Any:
    return Annotated[kind | None, typer.Option(
        envvar=f"KVSTORE_{section.upper()}__{field.upper()}", show_default=False,
        help=f"{help_text} ({section}.{field})")]


@app.command()
@_boundary
def serve(
    config: ConfigOpt = None,
    assignments: Annotated[list[str] | None, typer.Option(
        "--set", metavar="SECTION.FIELD=VALUE", show_default=False,
        help="Set any config field, e.g. dram.codec=fp8_e4m3 (repeatable; wins over the flags "
             "below).")] = None,
    socket: _field_option("server", "socket_path", "Unix socket path") = None,
    tcp: _field_option("server", "tcp_address", "Also listen on host:port (needs tokens)") = None,
    metrics_port: _field_option("server", "metrics_port", "Prometheus port, 0 off", int) = None,
    dram_capacity: _field_option("dram", "capacity_bytes", "DRAM tier size, e.g. 8GiB") = None,
    ssd_path: _field_option("ssd", "path", "SSD tier directory") = None,
    ssd_capacity: _field_option("ssd", "capacity_bytes", "SSD tier size, e.g. 200GiB") = None,
    log_level: _field_option("server", "log_level", "DEBUG, INFO, WARNING or ERROR") = None,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Validate the configuration, print it as JSON and exit.")] = False,
) -> None:
    """Run the daemon in the foreground until SIGTERM or Ctrl-C.

    Precedence: defaults < --config file < KVSTORE_<SECTION>__<FIELD> variables < flags < --set.
    """
    flags = {"socket": socket, "tcp": tcp, "metrics_port": metrics_port,
             "dram_capacity": dram_capacity, "ssd_path": ssd_path,
             "ssd_capacity": ssd_capacity, "log_level": log_level}
    cfg = load_config(config, None, serve_overrides(flags, assignments or []))
    if dry_run:
        _print_json(redacted(cfg))
        return
    try:
        from kvstore.server.daemon import run_daemon
    except ImportError as exc:
        raise KVStoreError(f"the daemon is not available in this build: {exc}") from None
    raise typer.Exit(run_daemon(cfg))


# ------------------------------------------------------------------------------ stats, ls

def _ratio(num: float, den: float) -> str:
    return f"{num / den:.1%}" if den else "-"


_TIER_ROWS = ("capacity_bytes", "used_bytes", "num_blocks", "hits", "misses", "bytes_written",
              "bytes_read", "evictions", "corrupt", "rejected")


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


def _number(value: Any, name: str) -> str:
    if value is None:
        return "-"
    if name.endswith("_bytes"):
        return format_bytes(int(value))
    return str(int(value)) if float(value).is_integer() else f"{value:.3g}"


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
    data = stats.as_dict()
    tiers = data.pop("tiers")
    return Group(tier_table(tiers), request_table(data))


def _watch(render: Callable[[], RenderableType], interval_s: float) -> None:
    """Redraw ``render()`` every ``interval_s`` until Ctrl-C."""
    with Live(render(), console=console, auto_refresh=False) as live:
        try:
            while True:
                time.sleep(interval_s)
                live.update(render(), refresh=True)
        except KeyboardInterrupt:
            return


@app.command()
@_boundary
def stats(
    address: AddressOpt = None,
    token: TokenOpt = None,
    tenant: Annotated[str | None, typer.Option(help="Only this tenant's blocks and requests.",
                                               show_default=False)] = None,
    as_json: JsonOpt = False,
    watch: Annotated[float | None, typer.Option(
        "--watch", min=0.1, metavar="SECONDS", show_default=False,
        help="Refresh every SECONDS until Ctrl-C (with --json: one JSON line each time).")] = None,
) -> None:
    """Capacity, use and hit rates per tier, and request counters."""
    with connect(address, token) as client:
        if watch is None:
            snapshot = client.stats(tenant)
            if as_json:
                _print_json(snapshot.as_dict())
            else:
                console.print(render_stats(snapshot))
        elif as_json:
            try:
                while True:
                    typer.echo(json.dumps(client.stats(tenant).as_dict(), default=str))
                    time.sleep(watch)
            except KeyboardInterrupt:
                return
        else:
            _watch(lambda: render_stats(client.stats(tenant)), watch)


def format_age(seconds: float) -> str:
    """``75`` -> ``1m15s``: the two largest units."""
    whole = int(seconds)
    for unit, size, sub, sub_size in (("d", 86400, "h", 3600), ("h", 3600, "m", 60),
                                      ("m", 60, "s", 1)):
        if whole >= size:
            return f"{whole // size}{unit}{(whole % size) // sub_size}{sub}"
    return f"{seconds:.1f}s"


def block_row(info: Any) -> dict[str, Any]:
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


@app.command("ls")
@_boundary
def list_blocks(
    address: AddressOpt = None,
    token: TokenOpt = None,
    tenant: Annotated[str | None, typer.Option(show_default=False, help="Only this tenant.")
                      ] = None,
    model: Annotated[str | None, typer.Option(show_default=False, help="Only this model id.")
                     ] = None,
    tier: Annotated[str | None, typer.Option(show_default=False,
                                             help="Only blocks held by this tier (dram, ssd).")
                    ] = None,
    limit: Annotated[int, typer.Option(min=0, help="At most this many blocks.")] = 1000,
    as_json: JsonOpt = False,
) -> None:
    """Stored blocks, most recently used first."""
    with connect(address, token) as client:
        rows = [block_row(b) for b in client.list_blocks(tenant=tenant, model_id=model,
                                                          tier=tier, limit=limit)]
    if as_json:
        _print_json(rows)
        return
    console.print(blocks_table(rows, limit))


# ----------------------------------------------------------------------------------- evict

def parse_key(text: str) -> bytes:
    """A block key from its 32 hex digits (as ``kvstore ls`` prints it)."""
    text = text.strip().lower()
    if len(text) != KEY_HEX_CHARS:
        usage_error(f"--key {text!r}: a block key is {KEY_HEX_CHARS} hex digits")
    try:
        return bytes.fromhex(text)
    except ValueError:
        usage_error(f"--key {text!r} is not hexadecimal")


def describe_selection(tenant: str | None, model: str | None, keys: list[bytes],
                       everything: bool) -> str:
    """What an evict will remove, in words, for the confirmation prompt."""
    if everything:
        return "every block"
    parts = [f"tenant {tenant!r}" if tenant else "", f"model {model!r}" if model else "",
             f"{len(keys)} listed key(s)" if keys else ""]
    return "the blocks of " + " and ".join(p for p in parts if p)


@app.command()
@_boundary
def evict(
    address: AddressOpt = None,
    token: TokenOpt = None,
    tenant: Annotated[str | None, typer.Option(show_default=False,
                                               help="Blocks of this tenant.")] = None,
    model: Annotated[str | None, typer.Option(show_default=False,
                                              help="Blocks of this model id.")] = None,
    key: Annotated[list[str] | None, typer.Option(
        show_default=False, metavar="HEX", help="A block key (repeatable), as `ls` shows it.")
    ] = None,
    everything: Annotated[bool, typer.Option("--all", help="Every block.")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")
                   ] = False,
) -> None:
    """Remove blocks from every tier; the filters combine (a block must match all given)."""
    keys = [parse_key(k) for k in key or []]
    if everything and (tenant or model or keys):
        usage_error("--all cannot be combined with --tenant, --model or --key")
    if not (everything or tenant or model or keys):
        usage_error("say what to evict: --tenant, --model, --key or --all")
    target = address or default_address()
    if not yes:
        what = describe_selection(tenant, model, keys, everything)
        typer.confirm(f"Evict {what} from {target}?", abort=True)
    with connect(target, token) as client:
        removed = client.evict(tenant=tenant, model_id=model, keys=keys or None,
                               everything=everything)
    typer.echo(f"evicted {removed} block{'s' if removed != 1 else ''}")


# ---------------------------------------------------------------------- doctor, version

_STATUS_STYLE = {"ok": "[green]ok[/]", "warn": "[yellow]warn[/]", "fail": "[red]FAIL[/]"}


@app.command()
@_boundary
def doctor(
    config: ConfigOpt = None,
    address: AddressOpt = None,
    token: TokenOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Check the host (torch, CUDA, shared memory, pinning, SSD directory) and the daemon.

    Exits 1 if a required check fails; optional ones (CUDA, cupy, ...) only warn.
    """
    from kvstore.doctor import failed, run_checks

    cfg = load_config(config)
    checks = run_checks(cfg, address or f"unix://{cfg.server.socket_path}", token)
    if as_json:
        _print_json([c.as_dict() for c in checks])
    else:
        table = Table(title="kvstore doctor")
        for header in ("check", "status", "detail"):
            table.add_column(header)
        for c in checks:
            table.add_row(c.name, _STATUS_STYLE[c.status], c.detail)
        console.print(table)
    if failed(checks):
        raise typer.Exit(1)


@app.command()
def version() -> None:
    """Print the kvstore version."""
    typer.echo(f"kvstore {__version__}")


# ----------------------------------------------------------------------------------- bench

JsonPathOpt = Annotated[Path | None, typer.Option(
    "--json", dir_okay=False, show_default=False,
    help="Where to write the JSON results [default: bench/results/<bench>-<date>.json]")]


def _size_option(value: str, name: str) -> int:
    try:
        return parse_size(value, name)
    except KVStoreError as exc:
        usage_error(str(exc))


def _publish(report: "BenchReport", path: Path | None) -> None:
    from kvstore.bench.report import write_report

    try:
        write_report(report, path, console=console)
    except OSError as exc:
        raise KVStoreError(f"cannot write the results to {exc.filename}: {exc.strerror}"
                           ) from None


def load_runner(module: str, function: str, command: str) -> Callable[..., Any]:
    """``module.function``, imported on use; KVStoreError if this build lacks it."""
    try:
        return getattr(importlib.import_module(module), function)
    except ModuleNotFoundError as exc:
        if exc.name and module.startswith(exc.name):
            raise KVStoreError(f"`{command}` needs {module}, which is not part of this "
                               "build") from None
        raise KVStoreError(f"`{command}` cannot load {module}: {exc}") from None
    except AttributeError:
        raise KVStoreError(f"`{command}`: {module} has no {function}()") from None


@bench_app.command("tiers")
@_boundary
def bench_tiers(
    total_bytes: Annotated[str, typer.Option(help="Bytes each pass moves, e.g. 256MiB.")
                           ] = "1GiB",
    ssd_path: Annotated[Path | None, typer.Option(
        file_okay=False, show_default=False,
        help="Directory for the SSD tier and dd [default: ssd.path]")] = None,
    json_path: JsonPathOpt = None,
    repeat: Annotated[int, typer.Option(min=1, help="Passes; the table shows the best.")] = 3,
    queue_depth: Annotated[int, typer.Option(min=1, help="SSD puts in flight.")] = 16,
    tier: Annotated[list[str] | None, typer.Option(
        show_default=False, help="Only this tier (dram or ssd; repeatable).")] = None,
) -> None:
    """Put/get GB/s of the DRAM and SSD tiers (2 MiB blocks) against memcpy and dd O_DIRECT."""
    from kvstore.bench.tiers import TIERS, run_tier_bench

    report = run_tier_bench(_size_option(total_bytes, "--total-bytes"),
                            ssd_path if ssd_path is not None else load_config().ssd.path,
                            tuple(tier or TIERS), repeat, queue_depth)
    _publish(report, json_path)


@bench_app.command("rpc")
@_boundary
def bench_rpc(
    total_bytes: Annotated[str, typer.Option(help="Bytes each put/get measurement moves.")
                           ] = "256MiB",
    lookup_repeats: Annotated[int, typer.Option(min=1, help="Timed Lookups per prefix.")] = 200,
    small_call_s: Annotated[float, typer.Option(
        "--small-call-seconds", min=0.1, help="Seconds per small-call measurement.")] = 2.0,
    concurrency: Annotated[int, typer.Option(min=1, help="Small calls in flight.")] = 32,
    json_path: JsonPathOpt = None,
) -> None:
    """Put/get GB/s and call latency through a fresh daemon, against a bare gRPC echo."""
    run = load_runner("kvstore.bench.rpc", "run_rpc_bench", "kvstore bench rpc")
    _publish(run(total_bytes=_size_option(total_bytes, "--total-bytes"),
                 lookup_repeats=lookup_repeats, small_call_s=small_call_s,
                 concurrency=concurrency), json_path)


@bench_app.command("codecs")
@_boundary
def bench_codecs(
    quick: Annotated[bool, typer.Option(help="Small shapes, one repeat (seconds on a CPU).")
                     ] = False,
    real: Annotated[bool, typer.Option(help="Also measure real K/V captured from a model.")
                    ] = True,
    gpu: Annotated[bool | None, typer.Option(
        "--gpu/--no-gpu", show_default=False,
        help="Run the GPU sections [default: when CUDA is available]")] = None,
    minilm_dir: Annotated[Path | None, typer.Option(
        file_okay=False, show_default=False,
        help="Model files for the real K/V [default: $KVSTORE_MINILM_DIR]")] = None,
    codec: Annotated[list[str] | None, typer.Option(
        show_default=False, help="Only this codec chain (repeatable), e.g. fp8_e4m3+zstd.")
    ] = None,
    json_path: JsonPathOpt = None,
) -> None:
    """Size, error and encode/decode speed of each codec (kvstore.bench.codecs)."""
    run = load_runner("kvstore.bench.codecs", "run_codec_bench", "kvstore bench codecs")
    options: dict[str, Any] = {"quick": quick, "real": real, "gpu": gpu,
                               "minilm_dir": minilm_dir}
    if codec:
        options["codec_names"] = tuple(codec)
    _publish(run(**options), json_path)


def main() -> None:
    """Entry point of ``python -m kvstore``."""
    app(prog_name="kvstore")


if __name__ == "__main__":
    main()
