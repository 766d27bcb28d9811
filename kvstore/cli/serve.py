"""``kvstore serve``: run the daemon; its flags, env vars, file and ``--set`` onto one config."""

import dataclasses
from typing import Annotated, Any

import typer

from kvstore.cli.app import ConfigOpt, app, boundary, print_json
from kvstore.config import KVStoreConfig, load_config, parse_assignments, redact_url
from kvstore.errors import KVStoreError

# Each named `serve` flag sets one config field; its environment variable is that field's own.
SERVE_FLAGS: dict[str, tuple[str, str]] = {
    "socket": ("server", "socket_path"),
    "tcp": ("server", "tcp_address"),
    "metrics_port": ("server", "metrics_port"),
    "dram_capacity": ("dram", "capacity_bytes"),
    "ssd_path": ("ssd", "path"),
    "ssd_capacity": ("ssd", "capacity_bytes"),
    "remote_url": ("remote", "url"),
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
    """The config as a dict with token values and URL passwords hidden."""
    data = dataclasses.asdict(config)
    server = data["server"]
    server["tenant_tokens"] = dict.fromkeys(server["tenant_tokens"], "***")
    server["admin_token"] = "***" if server["admin_token"] else ""
    for settings in [data["remote"], *(link["settings"] for link in data["tiers"])]:
        if settings.get("url"):
            settings["url"] = redact_url(settings["url"])
    return data


def _field_option(section: str, field: str, help_text: str, kind: type = str) -> Any:
    return Annotated[kind | None, typer.Option(
        envvar=f"KVSTORE_{section.upper()}__{field.upper()}", show_default=False,
        help=f"{help_text} ({section}.{field})")]


@app.command()
@boundary
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
    remote_url: _field_option("remote", "url", "Shared tier last in the chain, "
                              "redis://[user:pass@]host:port (rediss:// for TLS)") = None,
    log_level: _field_option("server", "log_level", "DEBUG, INFO, WARNING or ERROR") = None,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Validate the configuration, print it as JSON and exit.")] = False,
) -> None:
    """Run the daemon in the foreground until SIGTERM or Ctrl-C.

    Precedence: defaults < --config file < KVSTORE_<SECTION>__<FIELD> variables < flags < --set.
    """
    flags = {"socket": socket, "tcp": tcp, "metrics_port": metrics_port,
             "dram_capacity": dram_capacity, "ssd_path": ssd_path,
             "ssd_capacity": ssd_capacity, "remote_url": remote_url, "log_level": log_level}
    cfg = load_config(config, None, serve_overrides(flags, assignments or []))
    if dry_run:
        print_json(redacted(cfg))
        return
    try:
        from kvstore.server.daemon import run_daemon
    except ImportError as exc:
        raise KVStoreError(f"the daemon is not available in this build: {exc}") from None
    raise typer.Exit(run_daemon(cfg))
