"""A process of the daemon's uid, without capabilities, gets nothing out of the daemon's
process: it cannot reopen the memfds that hold every tenant's pages through /proc/<pid>/fd,
list /proc/<pid>/map_files, read /proc/<pid>/environ, read or write the daemon's memory (/proc/<pid>/mem,
process_vm_readv/writev) or ptrace it, because the daemon makes itself non-dumpable before
its first memfd exists.

Regression: before that, such a process decoded another tenant's K/V from the reopened
memfds, mapped the staging regions writable, and wrote a forged page into published memory
that the victim was then served. ``test_a_dumpable_daemon_gives_itself_away`` runs the same
attacker against a daemon with ``server.dumpable = true`` (the old behaviour) and shows each
route working, so the refusals are the flag's doing and not the attacker's weakness.

Run as root (CI containers), the daemon and the attacker both run without capabilities
(``nocaps.py``): root's CAP_SYS_PTRACE would open everything regardless.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvstore.client import Client

from ..conftest import random_kv, random_tokens
from ..server.helpers import REPO_ROOT, DaemonProcess, small_config
from .nocaps import CANNOT_DROP

HERE = Path(__file__).resolve().parent
NOCAPS = (sys.executable, str(HERE / "nocaps.py"))
REFUSED = {"EACCES", "EPERM"}


def _yama_scope() -> int:
    """Yama's ptrace_scope (0 where Yama is absent): above 0, a process that is not the
    daemon's ancestor is refused ptrace, /proc/<pid>/mem and process_vm_* whatever the flag."""
    try:
        return int(Path("/proc/sys/kernel/yama/ptrace_scope").read_text())
    except (OSError, ValueError):
        return 0


def _start(root: Path, dumpable: bool) -> DaemonProcess:
    config = small_config(root)
    config = dataclasses.replace(
        config, server=dataclasses.replace(config.server, dumpable=dumpable))
    daemon = DaemonProcess(config, root, launcher=NOCAPS)
    try:
        daemon.wait_ready()
    except RuntimeError:
        if daemon.proc.returncode == CANNOT_DROP:
            pytest.skip(f"cannot drop capabilities here: {daemon.log()}")
        raise
    return daemon


def _victim_puts(daemon: DaemonProcess, ns) -> tuple[list[int], torch.Tensor]:
    """The victim's blocks, put zero-copy: written in a staging region, published in a
    sealed step of the daemon's DRAM tier."""
    tokens = random_tokens(64, seed=7)
    kv = random_kv(ns.spec, 64, seed=7)
    with Client(daemon.address) as victim:
        assert victim.put(ns, tokens, kv, zero_copy=True) == 64
    return tokens, kv


def _attack(pid: int, marker: bytes) -> dict:
    forged = bytes(b ^ 0xFF for b in marker)
    done = subprocess.run([*NOCAPS, sys.executable, str(HERE / "same_uid_attacker.py"),
                           str(pid), marker.hex(), forged.hex()],
                          check=False, cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=120)
    if done.returncode == CANNOT_DROP:
        pytest.skip(f"cannot drop capabilities here: {done.stderr}")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _marker(kv: torch.Tensor) -> bytes:
    """The first token's K of layer 0, all heads: bytes that appear verbatim in a raw page."""
    return kv[0, 0, 0].contiguous().view(torch.uint8).numpy().tobytes()


def test_a_same_uid_process_gets_nothing_out_of_the_daemon(root, ns):
    daemon = _start(root, dumpable=False)
    try:
        tokens, kv = _victim_puts(daemon, ns)
        report = _attack(daemon.proc.pid, _marker(kv))
        fd = report["fd"]
        assert (fd["memfds"], fd["kv_found"], fd["mapped_writable"]) == (0, False, 0), report
        assert set(fd["errors"]) & REFUSED, report  # the descriptors exist, opening is refused
        for route in ("map_files", "vm_readv", "vm_writev", "mem", "environ", "ptrace"):
            assert report[route].get("refused") in REFUSED, (route, report)
        with Client(daemon.address) as victim:  # and the victim still gets its own K/V
            assert torch.equal(victim.get(ns, tokens, zero_copy=True), kv)
        assert daemon.terminate() == 0
    finally:
        daemon.kill()


def test_a_dumpable_daemon_gives_itself_away(root, ns):
    """``server.dumpable = true``: what the daemon was before, and what the flag is for."""
    daemon = _start(root, dumpable=True)
    try:
        tokens, kv = _victim_puts(daemon, ns)
        report = _attack(daemon.proc.pid, _marker(kv))
        fd = report["fd"]
        assert fd["memfds"] >= 2 and fd["kv_found"], report  # another tenant's K/V, read
        assert fd["mapped_writable"] >= 1, report  # a staging region, writable
        assert report["map_files"]["entries"] > 0, report
        assert report["environ"]["variables"] > 0, report
        if _yama_scope() == 0:
            assert report["vm_readv"]["bytes"] == report["vm_writev"]["bytes"] == 64, report
            assert report["ptrace"] == {"seized": True}, report
            assert report["mem"]["forged"] >= 1, report
            with Client(daemon.address) as victim:  # the forged page is served as stored
                got = victim.get(ns, tokens, zero_copy=True)
            assert got is not None and not torch.equal(got, kv)
            assert torch.equal(got[0, 0, 0], kv[0, 0, 0].view(torch.int16).bitwise_not()
                               .view(kv.dtype))
    finally:
        daemon.kill()
