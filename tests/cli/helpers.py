"""The ``kvstore`` command through typer's CliRunner, and blocks put for it to list."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from kvstore.cli import app
from kvstore.client import Client
from kvstore.keys import Namespace
from kvstore.server.daemon import Daemon

from ..conftest import random_kv, random_tokens

REPO = Path(__file__).resolve().parents[2]
runner = CliRunner()


def invoke(*args: str, input: str | None = None, env: dict[str, str] | None = None):
    return runner.invoke(app, list(args), input=input, env=env, catch_exceptions=False)


def put_blocks(daemon: Daemon, spec, tenant: str, num_blocks: int, seed: int = 0) -> None:
    ns = Namespace(model_id="cli/model", spec=spec, tenant=tenant)
    tokens = random_tokens(num_blocks * spec.block_tokens, seed=seed)
    with Client(daemon.unix_address) as client:
        written = client.put(ns, tokens, random_kv(spec, len(tokens), seed), zero_copy=False)
    assert written == len(tokens)


def listed(daemon: Daemon, *filters: str) -> list[dict]:
    result = invoke("ls", "--address", daemon.unix_address, "--json", *filters)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)
