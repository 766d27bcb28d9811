"""The commands that inspect and manage a daemon or this host: stats, ls, evict, doctor, version."""

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer
from rich.console import RenderableType
from rich.live import Live

from kvstore import __version__, keys
from kvstore.cli.app import (
    AddressOpt,
    ConfigOpt,
    JsonOpt,
    TokenOpt,
    app,
    boundary,
    connect,
    console,
    default_address,
    print_json,
    usage_error,
)
from kvstore.cli.render import block_row, blocks_table, checks_table, render_stats
from kvstore.config import load_config
from kvstore.errors import InvalidArgument, Unavailable


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
@boundary
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
                print_json(snapshot.as_dict())
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


@app.command("ls")
@boundary
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
    cluster: Annotated[bool, typer.Option(
        "--cluster", help="What every live host holds of --tenant's blocks, from the shared "
                          "tier's directory ([remote] in --config, or --remote-url).")] = False,
    config: ConfigOpt = None,
    remote_url: Annotated[str | None, typer.Option(
        envvar="KVSTORE_REMOTE__URL", show_default=False,
        help="The shared store for --cluster [default: remote.url]")] = None,
) -> None:
    """Stored blocks, most recently used first."""
    if cluster:
        _list_cluster(config, remote_url, tenant, limit, as_json)
        return
    with connect(address, token) as client:
        rows = [block_row(b) for b in client.list_blocks(tenant=tenant, model_id=model,
                                                          tier=tier, limit=limit)]
    if as_json:
        print_json(rows)
        return
    console.print(blocks_table(rows, limit))


def _list_cluster(config: Path | None, remote_url: str | None, tenant: str | None,
                  limit: int, as_json: bool) -> None:
    """``ls --cluster``: one tenant's directory entries, read straight from the shared store."""
    import asyncio
    import dataclasses

    from kvstore.cli.render import cluster_table
    from kvstore.tiers.remote.tier import RemoteTier

    if not tenant:
        usage_error("--cluster lists one tenant's blocks: give --tenant")
    remote = load_config(config).remote
    if remote_url:
        remote = dataclasses.replace(remote, url=remote_url)
    if not remote.url:
        usage_error("--cluster needs the shared store: --remote-url or remote.url in --config")

    async def read() -> list:
        tier = RemoteTier(dataclasses.replace(remote, directory=True))
        await tier.open()
        try:
            entries = await tier.cluster_entries(tenant, limit)
            problem = tier.health()
        finally:
            await tier.close()
        if problem:
            raise Unavailable(f"cannot read the cluster directory: {problem}")
        return entries

    rows = [{"key": e.key.hex(), "host": e.host, "tiers": list(e.tiers), "model_id": e.model_id,
             "block_index": e.block_index, "expires_in_s": round(e.expires_in_s, 1)}
            for e in asyncio.run(read())]
    if as_json:
        print_json(rows)
    else:
        console.print(cluster_table(rows, limit))


def parse_key(text: str) -> bytes:
    """A block key from its 32 hex digits (as ``kvstore ls`` prints it)."""
    try:
        return keys.parse_key(text.strip().lower())
    except InvalidArgument as exc:
        usage_error(f"--key: {exc}")


def describe_selection(tenant: str | None, model: str | None, keys: list[bytes],
                       everything: bool, revision: str | None = None,
                       adapter: str | None = None, namespace: bool = False) -> str:
    """What an evict will remove, in words, for the confirmation prompt."""
    if everything:
        return "every block"
    parts = [f"tenant {tenant!r}" if tenant else "", f"model {model!r}" if model else "",
             f"{len(keys)} listed key(s)" if keys else "",
             f"revision {revision!r}" if revision is not None else "",
             f"adapter {adapter!r}" if adapter is not None else "",
             "the namespace in --namespace" if namespace else ""]
    return "the blocks of " + " and ".join(p for p in parts if p)


@app.command()
@boundary
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
    revision: Annotated[str | None, typer.Option(
        show_default=False, help="Invalidate blocks of this weights revision (or epoch).")
    ] = None,
    adapter: Annotated[str | None, typer.Option(
        show_default=False, help="Invalidate blocks of this adapter (\"\": the base model).")
    ] = None,
    namespace: Annotated[Path | None, typer.Option(
        exists=True, dir_okay=False, metavar="JSON", show_default=False,
        help="Invalidate exactly this namespace's blocks (a Namespace as JSON).")] = None,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")
                   ] = False,
) -> None:
    """Remove blocks from every tier; the filters combine (a block must match all given).

    --revision, --adapter and --namespace invalidate: those blocks go even when pinned, and no
    lookup after this returns sees them."""
    from kvstore.cli.pins import read_namespace

    keys = [parse_key(k) for k in key or []]
    invalidates = revision is not None or adapter is not None or namespace is not None
    if everything and (tenant or model or keys or invalidates):
        usage_error("--all cannot be combined with other filters")
    if not (everything or tenant or model or keys or invalidates):
        usage_error("say what to evict: --tenant, --model, --key, --revision, --adapter, "
                    "--namespace or --all")
    ns = read_namespace(namespace) if namespace is not None else None
    target = address or default_address()
    if not yes:
        what = describe_selection(tenant, model, keys, everything, revision, adapter,
                                  ns is not None)
        typer.confirm(f"Evict {what} from {target}?", abort=True)
    with connect(target, token) as client:
        removed = client.evict(tenant=tenant, model_id=model, keys=keys or None,
                               everything=everything, revision=revision, adapter_id=adapter,
                               namespace=ns)
    typer.echo(f"evicted {removed} block{'s' if removed != 1 else ''}")


@app.command()
@boundary
def doctor(
    config: ConfigOpt = None,
    address: AddressOpt = None,
    token: TokenOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Check the host (torch, CUDA, shared memory, pinning, SSD directory) and the daemon.

    Exits 1 if a required check fails; optional ones (CUDA, cupy, ...) only warn.
    """
    from kvstore.cli.doctor import failed, run_checks

    cfg = load_config(config)
    checks = run_checks(cfg, address or f"unix://{cfg.server.socket_path}", token)
    if as_json:
        print_json([c.as_dict() for c in checks])
    else:
        console.print(checks_table(checks))
    if failed(checks):
        raise typer.Exit(1)


@app.command()
def version() -> None:
    """Print the kvstore version."""
    typer.echo(f"kvstore {__version__}")
