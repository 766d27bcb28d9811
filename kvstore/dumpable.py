"""Keep other processes of this uid out of this process: the kernel's "dumpable" flag.

A process of the same uid may otherwise, without any capability, reopen this process's
descriptors through ``/proc/<pid>/fd`` (the daemon's memfds: every tenant's pages, the staging
regions writable), read and write its memory through ``/proc/<pid>/mem``,
``process_vm_readv``/``process_vm_writev`` or ``ptrace``, and read ``/proc/<pid>/{maps,
map_files,environ}``. ``prctl(PR_SET_DUMPABLE, 0)`` makes the kernel refuse all of that to
processes without ``CAP_SYS_PTRACE``; it also turns off core dumps of this process and keeps
debuggers (gdb, py-spy) of the same uid from attaching. The flag lasts until ``execve``: forked
children inherit it, programs they exec start dumpable again.
"""

from __future__ import annotations

import ctypes
import os
import sys

from kvstore.errors import FailedPrecondition

# Linux's prctl options (include/uapi/linux/prctl.h).
PR_GET_DUMPABLE = 3
PR_SET_DUMPABLE = 4


def _prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    fn.restype = ctypes.c_int
    return fn


def is_dumpable() -> bool | None:
    """Whether processes of this uid may read this one's memory and descriptors through /proc
    and ptrace (None: not Linux, or libc has no prctl)."""
    prctl = _prctl()
    return None if prctl is None else prctl(PR_GET_DUMPABLE, 0, 0, 0, 0) == 1


def protect_process() -> bool:
    """Make this process non-dumpable (see the module docstring); whether it now is."""
    prctl = _prctl()
    if prctl is None:
        return False
    if prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        return False
    return is_dumpable() is False


PROTECT_ENV = "KVSTORE_CLIENT_PROTECT_PROCESS"  # "1": clients make their process non-dumpable


def protect_client_process(setting: bool | None) -> None:
    """A client's ``protect_process`` argument, applied: True makes the calling process
    non-dumpable, False leaves it as it is, None reads ``KVSTORE_CLIENT_PROTECT_PROCESS``.

    Off by default: the flag changes the whole host process (no core dumps, no same-uid
    debugger), and the daemon can no longer see through ``/proc/<pid>/{maps,fd}`` when this
    process let go of memory it was given back, so it takes that on trust.

    Raises:
        FailedPrecondition: protection was asked for and this platform cannot give it.
    """
    if setting is None:
        setting = os.environ.get(PROTECT_ENV, "").strip().lower() in ("1", "true", "yes")
    if setting and not protect_process():
        raise FailedPrecondition("protect_process: this platform cannot make the process "
                                 "non-dumpable (needs Linux prctl)")
