"""Fixtures for the client tests: a short temp root, a small config, an in-process daemon."""

from __future__ import annotations

import shutil

import pytest

from kvstore.client import AsyncClient
from kvstore.server.daemon import serve
from tests.server.helpers import short_tmpdir, small_config


@pytest.fixture
def root():
    path = short_tmpdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def config(root):
    return small_config(root)


@pytest.fixture
async def daemon(config):
    d = await serve(config)
    yield d
    await d.stop(1.0)


@pytest.fixture
async def aclient(daemon):
    async with AsyncClient(daemon.unix_address) as client:
        yield client
