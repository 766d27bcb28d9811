"""Fixtures for the client tests: the daemon tests' temp root, small config, in-process daemon
and async client."""

from tests.server.conftest import aclient, config, daemon, root

__all__ = ["aclient", "config", "daemon", "root"]
