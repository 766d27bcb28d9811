"""kvstore.tiers.dram.lingering and ``SealedStep.retire``: a given-back step's memory is freed
whoever else holds it, except while a view of it is still read in this process."""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from kvstore.page import PUBLISHED_HEADER_BYTES, is_retired
from kvstore.tiers.dram.arena import SealedStep
from kvstore.tiers.dram.lingering import LingeringSteps

MiB = 1 << 20

# A process the tier never hears of: it is handed a step's descriptor over a Unix socket
# (SCM_RIGHTS), maps all of it, touches every page, then says how much memory the memfd holds
# whenever asked, and whether its header reads retired.
_HOLDER = textwrap.dedent("""
    import mmap, os, socket, sys
    conn = socket.socket(fileno=int(sys.argv[1]))
    _, (fd,), _, _ = socket.recv_fds(conn, 16, 1)
    size = os.fstat(fd).st_size
    mapped = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    sum(mapped[i] for i in range(0, size, mmap.PAGESIZE))
    while conn.recv(1):
        retired = mapped[8] == 1  # PUBLISHED_RETIRED
        conn.send(f"{os.fstat(fd).st_blocks * 512} {os.fstat(fd).st_size} {int(retired)}\\n"
                  .encode())
""")


def _step(name: str = "kvstore-dram.test", nbytes: int = 4 * MiB) -> SealedStep:
    step = SealedStep(name, nbytes)
    step.create()
    return step


def _ask(conn: socket.socket) -> tuple[int, int, bool]:
    conn.send(b"?")
    held, size, retired = conn.recv(64).split()
    return int(held), int(size), retired == b"1"


def test_a_given_back_step_is_freed_while_a_process_it_never_saw_maps_it() -> None:
    """Regression (issue 28): a step's descriptor passed on to another process kept its whole
    memory alive after the tier gave it back, outside the budget, since the tier could only
    look at the processes it had sent it to. Now the step is cut down to its header page: the
    other process still holds the descriptor and its mapping, and the kernel counts 4 KiB
    left in the memfd, not 4 MiB."""
    step = _step()
    mine, theirs = socket.socketpair()
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(theirs.fileno())],
                              pass_fds=[theirs.fileno()])
    theirs.close()
    try:
        socket.send_fds(mine, [b"x"], [step.client_fd])
        assert _ask(mine) == (4 * MiB, 4 * MiB, False)
        assert step.retire() is True
        held, size, retired = _ask(mine)
        assert (held, size, retired) == (PUBLISHED_HEADER_BYTES, PUBLISHED_HEADER_BYTES, True)
    finally:
        mine.close()
        holder.wait(timeout=30)


def test_a_step_read_here_stays_charged_until_its_last_view_goes() -> None:
    """A view taken here before the step went back (a reader of a page deleted meanwhile)
    keeps its memory: cutting it would kill the daemon with SIGBUS on the reader's next
    touch. It lingers, charged, and is freed on the next look after the view goes."""
    step = _step()
    view = step.view[PUBLISHED_HEADER_BYTES : PUBLISHED_HEADER_BYTES + 100]
    steps = LingeringSteps()
    assert step.retire() is False
    steps.add("dram.test", step, "acme")
    assert (len(steps), steps.nbytes, steps.nbytes_by_tenant()) == (1, 4 * MiB,
                                                                   {"acme": 4 * MiB})
    assert steps.try_free() == [] and step.held_bytes == 4 * MiB
    assert bytes(view) == bytes(100)  # still readable, as it was
    del view
    assert steps.try_free() == ["dram.test"] and step.held_bytes == -1  # cut and closed
    assert steps.forget(["dram.test", "dram.gone"]) == 4 * MiB
    assert (len(steps), steps.nbytes) == (0, 0)


def test_closing_lets_a_step_go_with_its_last_mapping() -> None:
    """Closing the tier (``free=False``) cuts nothing: a client may still read pages under its
    lease, and the memory goes with the last mapping of it, as any memfd's does."""
    step = _step()
    fd = os.dup(step.client_fd)
    try:
        assert step.retire(free=False) is True
        assert os.fstat(fd).st_blocks * 512 == 4 * MiB
        with mmap.mmap(fd, 0, prot=mmap.PROT_READ) as mapped:
            assert is_retired(mapped)
    finally:
        os.close(fd)


def test_a_clients_descriptor_cannot_shrink_grow_or_seal_a_step() -> None:
    """Without F_SEAL_SHRINK, a step's size is guarded by what a client holds: a read-only
    description (no ftruncate, no writable mapping, no seal added) of a memfd whose mode
    refuses another user a writable reopen."""
    step = _step()
    fd = step.client_fd
    try:
        with pytest.raises(OSError) as refused:
            os.ftruncate(fd, 0)
        assert refused.value.errno == errno.EINVAL
        with pytest.raises(PermissionError):
            mmap.mmap(fd, 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        with pytest.raises(PermissionError):
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
        assert os.fstat(fd).st_mode & 0o777 == 0o400
        assert os.fstat(fd).st_size == 4 * MiB
    finally:
        step.retire()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_another_user_cannot_reopen_a_step_writable() -> None:
    """A process of another uid holding the descriptor cannot reopen it writable through
    /proc/self/fd (which would let it shrink the step under the daemon's mapping)."""
    step = _step()
    try:
        script = textwrap.dedent(f"""
            import os
            os.setgid(65534); os.setuid(65534)
            try:
                os.open("/proc/self/fd/{step.client_fd}", os.O_RDWR)
            except PermissionError:
                print("refused")
        """)
        done = subprocess.run([sys.executable, "-c", script], pass_fds=[step.client_fd], check=True,
                              capture_output=True, text=True, timeout=30)
        assert done.stdout.strip() == "refused", done.stderr
    finally:
        step.retire()
