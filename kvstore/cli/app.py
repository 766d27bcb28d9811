"""The typer apps and what every command shares: options, the error boundary, a client."""

import functools
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, TypeVar

import typer
from rich.console import Console

from kvstore.config import load_config
from kvstore.errors import KVStoreError, Unavailable

if TYPE_CHECKING:
    from kvstore.client import Client

app = typer.Typer(name="kvstore", no_args_is_help=True, add_completion=False,
                  help="Tiered KV-cache store for LLM serving: run the daemon and manage it.")
bench_app = typer.Typer(no_args_is_help=True,
                        help="Benchmarks: print a table and write JSON (bench/results/).")
app.add_typer(bench_app, name="bench")
console = Console()  # resolves sys.stdout at print time, so test runners capture it

CLI_TIMEOUT_S = 10.0  # an admin command waits this long for the daemon per call
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


def boundary(command: F) -> F:
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


def print_json(data: Any) -> None:
    """``data`` as indented JSON on stdout (values JSON lacks, as their ``str``)."""
    typer.echo(json.dumps(data, indent=2, default=str))
