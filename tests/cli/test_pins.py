"""kvstore pin add / rm / ls and evict --revision against a real daemon on a Unix socket."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from kvstore.client import Client
from kvstore.keys import Namespace
from kvstore.server.daemon import Daemon

from ..conftest import random_kv, random_tokens
from .helpers import invoke


def _files(tmp_path: Path, ns: Namespace, tokens: list[int]) -> tuple[str, str]:
    ns_file, tokens_file = tmp_path / "ns.json", tmp_path / "tokens.json"
    ns_file.write_text(json.dumps(ns.to_dict()))
    tokens_file.write_text(json.dumps(tokens))
    return str(ns_file), str(tokens_file)


def test_pin_add_ls_rm(daemon: Daemon, spec, tmp_path: Path) -> None:
    ns = Namespace(model_id="cli/pinned", spec=spec, tenant="pin-tenant")
    tokens = random_tokens(48, seed=7)
    with Client(daemon.unix_address) as client:
        client.put(ns, tokens, random_kv(spec, 48), zero_copy=False)
    ns_file, tokens_file = _files(tmp_path, ns, tokens)
    address = ("--address", daemon.unix_address)
    added = invoke("pin", "add", *address, "--namespace", ns_file, "--tokens", tokens_file,
                   "--ttl", "600")
    assert added.exit_code == 0, added.output
    assert "pinned 3 blocks" in added.stdout
    listed = invoke("pin", "ls", *address, "--tenant", "pin-tenant", "--json")
    rows = json.loads(listed.stdout)
    assert [(r["model_id"], r["num_blocks"]) for r in rows] == [("cli/pinned", 3)]
    assert "1 pins" in invoke("pin", "ls", *address, "--tenant", "pin-tenant").stdout
    removed = invoke("pin", "rm", *address, "--namespace", ns_file, "--tokens", tokens_file)
    assert removed.exit_code == 0 and "ended 1 pin" in removed.stdout


def test_pin_usage_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"model_id": "m"}')
    tokens = tmp_path / "tokens.json"
    tokens.write_text('["a"]')
    result = invoke("pin", "add", "--address", "unix:///nowhere.sock", "--namespace", str(bad),
                    "--tokens", str(tokens), "--ttl", "5")
    assert result.exit_code == 2 and "spec" in result.output


def test_evict_by_revision(daemon: Daemon, spec) -> None:
    old = Namespace(model_id="cli/rev", spec=spec, tenant="rev-tenant", revision="v1")
    new = dataclasses.replace(old, revision="v2")
    tokens = random_tokens(32, seed=8)
    with Client(daemon.unix_address) as client:
        for ns in (old, new):
            client.put(ns, tokens, random_kv(spec, 32), zero_copy=False)
        result = invoke("evict", "--address", daemon.unix_address, "--tenant", "rev-tenant",
                        "--revision", "v1", input="y\n")
        assert result.exit_code == 0, result.output
        assert "revision 'v1'" in result.output and "evicted 2 blocks" in result.stdout
        assert client.lookup(old, tokens).matched_tokens == 0
        assert client.lookup(new, tokens).matched_tokens == 32
