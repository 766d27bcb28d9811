"""kvstore.dumpable: a client makes its process non-dumpable only when asked to (an argument
or KVSTORE_CLIENT_PROTECT_PROCESS); each case runs in a fresh process, since the flag lasts
for the process's life."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvstore.dumpable import PROTECT_ENV

from .conftest import REPO_ROOT

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux prctl")


def _dumpable_after(client_code: str, env: dict[str, str] | None = None) -> str:
    code = ("from kvstore.client import AsyncClient, Client\n"
            "from kvstore.dumpable import is_dumpable\n"
            f"{client_code}\n"
            "print(is_dumpable())")
    environ = {k: v for k, v in os.environ.items() if k != PROTECT_ENV}
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                          text=True, check=False,
                          env={**environ, "PYTHONPATH": str(REPO_ROOT), **(env or {})})
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_client_leaves_its_process_alone_by_default():
    assert _dumpable_after("Client('unix:///tmp/none/kv.sock').close()") == "True"


@pytest.mark.parametrize("client", ["Client", "AsyncClient"])
def test_protect_process_makes_it_non_dumpable(client):
    assert _dumpable_after(f"{client}('unix:///tmp/none/kv.sock', protect_process=True)") \
        == "False"


def test_the_environment_turns_it_on_and_the_argument_wins():
    make = "Client('unix:///tmp/none/kv.sock'{}).close()"
    assert _dumpable_after(make.format(""), {PROTECT_ENV: "1"}) == "False"
    assert _dumpable_after(make.format(", protect_process=False"), {PROTECT_ENV: "1"}) == "True"
