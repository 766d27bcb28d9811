"""Fixtures for the security tests: the daemon tests' short temp root and small config."""

from tests.server.conftest import config, root

__all__ = ["config", "root"]
