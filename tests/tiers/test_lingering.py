"""kvstore.tiers.dram.lingering: which processes still hold a given-back step, read from /proc."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys

from kvstore.tiers.dram.lingering import Lingering, LingeringSteps, holders

MiB = 1 << 20


def _memfd(region: str) -> int:
    fd = os.memfd_create(f"kvstore-{region}")
    os.ftruncate(fd, MiB)
    return fd


def test_a_process_holds_a_step_while_it_maps_it_or_keeps_its_descriptor() -> None:
    me = os.getpid()
    fd = _memfd("dram.aaaa")
    mapped = mmap.mmap(fd, MiB, prot=mmap.PROT_READ)
    os.close(fd)  # mapped only
    other = _memfd("dram.bbbb")  # a descriptor only
    step = Lingering("dram.aaaa", MiB, "acme", {me})
    assert holders([step, Lingering("dram.bbbb", MiB, "acme", {me}),
                    Lingering("dram.aaaa0", MiB, "acme", {me})]) == {
        "dram.aaaa": {me}, "dram.bbbb": {me}, "dram.aaaa0": set()}  # names match whole
    mapped.close()
    os.close(other)
    assert holders([step, Lingering("dram.bbbb", MiB, "acme", {me})]) == {
        "dram.aaaa": set(), "dram.bbbb": set()}


def test_a_process_that_is_gone_holds_nothing() -> None:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    assert holders([Lingering("dram.cccc", MiB, "acme", {int(done.stdout)})]) == {
        "dram.cccc": set()}


def test_steps_come_back_once_nobody_holds_them() -> None:
    steps = LingeringSteps()
    steps.add("dram.1", MiB, "acme", {1, 2})
    steps.add("dram.2", 2 * MiB, "zeta", {3})
    assert (len(steps), steps.nbytes) == (2, 3 * MiB)
    assert steps.release({"dram.1": {2}, "dram.2": set()}) == 2 * MiB
    assert (len(steps), steps.nbytes) == (1, MiB)
    assert steps.snapshot()[0].pids == {2}  # what is left to look at next time
    assert steps.release({"dram.1": set(), "dram.9": set()}) == MiB
    assert len(steps) == 0
