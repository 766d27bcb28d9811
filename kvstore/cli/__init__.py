"""The ``kvstore`` command: serve, stats, ls, evict, pin, doctor, bench and version."""

# Importing a command module registers its commands, and `kvstore --help` lists them in the
# order they registered: serve first, then the admin commands (the bench group comes last).
from kvstore.cli import serve  # noqa: F401

# isort: split
from kvstore.cli import admin, bench, deploy, health, pins  # noqa: F401
from kvstore.cli.app import app

__all__ = ["app", "main"]


def main() -> None:
    """Entry point of ``python -m kvstore``."""
    app(prog_name="kvstore")
