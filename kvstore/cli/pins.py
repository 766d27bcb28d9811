"""``kvstore pin``: pin a stored prefix for a while, end pins, list them."""

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from kvstore.cli.app import (
    AddressOpt,
    JsonOpt,
    TokenOpt,
    app,
    boundary,
    connect,
    console,
    print_json,
    usage_error,
)
from kvstore.cli.doctor import format_bytes
from kvstore.errors import KVStoreError
from kvstore.keys import Namespace

pin_app = typer.Typer(no_args_is_help=True, help=(
    "TTL pins: keep a stored prefix (a system prompt) in the cache until its time runs out, "
    "within the tenant's pin budget (quota.pin_bytes); pins survive a daemon restart."))
app.add_typer(pin_app, name="pin")

NamespaceOpt = Annotated[Path, typer.Option(
    "--namespace", exists=True, dir_okay=False, metavar="JSON",
    help="The prefix's namespace as JSON (Namespace.to_dict: model_id, revision, adapter_id, "
         "tenant, spec, tp_rank, tp_size, extra_salt).")]
TokensOpt = Annotated[Path, typer.Option(
    "--tokens", exists=True, dir_okay=False, metavar="JSON",
    help="The prefix's token ids as a JSON list.")]


def read_namespace(path: Path) -> Namespace:
    """A namespace from a JSON file; usage error naming the file when it is not one."""
    try:
        return Namespace.from_dict(json.loads(path.read_text()))
    except (ValueError, TypeError, KVStoreError) as exc:
        usage_error(f"--namespace {path}: {exc}")


def read_tokens(path: Path) -> list[int]:
    """Token ids from a JSON list; usage error naming the file when it is not one."""
    try:
        tokens = json.loads(path.read_text())
    except ValueError as exc:
        usage_error(f"--tokens {path}: {exc}")
    if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
        usage_error(f"--tokens {path}: expected a JSON list of token ids")
    return tokens


def pin_row(pin: Any) -> dict[str, Any]:
    return {"tenant": pin.tenant, "model_id": pin.model_id, "key": pin.key.hex(),
            "num_blocks": pin.num_blocks, "size_bytes": pin.size_bytes,
            "expires_in_s": round(pin.expires_in_s, 1)}


@pin_app.command("add")
@boundary
def add(
    namespace: NamespaceOpt,
    tokens: TokensOpt,
    ttl: Annotated[float, typer.Option("--ttl", min=0.001, metavar="SECONDS",
                                       help="How long the pin lasts.")],
    address: AddressOpt = None,
    token: TokenOpt = None,
) -> None:
    """Pin the stored prefix of --tokens; pinning it again sets its time anew."""
    ns, ids = read_namespace(namespace), read_tokens(tokens)
    with connect(address, token) as client:
        pin = client.pin(ns, ids, ttl)
    if not pin.num_blocks:
        typer.echo("nothing of that prefix is stored: nothing pinned")
        return
    typer.echo(f"pinned {pin.num_blocks} blocks ({format_bytes(pin.size_bytes)}) for "
               f"{pin.expires_in_s:.0f} s")


@pin_app.command("rm")
@boundary
def remove(
    namespace: NamespaceOpt,
    tokens: TokensOpt,
    address: AddressOpt = None,
    token: TokenOpt = None,
) -> None:
    """End the pins of every prefix of --tokens."""
    ns, ids = read_namespace(namespace), read_tokens(tokens)
    with connect(address, token) as client:
        ended = client.unpin(ns, ids)
    typer.echo(f"ended {ended} pin{'s' if ended != 1 else ''}")


@pin_app.command("ls")
@boundary
def list_pins(
    address: AddressOpt = None,
    token: TokenOpt = None,
    tenant: Annotated[str | None, typer.Option(show_default=False, help="Only this tenant.")
                      ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Pins, soonest to expire first."""
    with connect(address, token) as client:
        rows = [pin_row(p) for p in client.list_pins(tenant)]
    if as_json:
        print_json(rows)
        return
    table = Table(title=f"{len(rows)} pins")
    for column in ("tenant", "model", "last block", "blocks", "size", "expires in"):
        table.add_column(column)
    for r in rows:
        table.add_row(r["tenant"], r["model_id"], r["key"], str(r["num_blocks"]),
                      format_bytes(r["size_bytes"]), f"{r['expires_in_s']:.0f} s")
    console.print(table)
