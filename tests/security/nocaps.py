"""Run a program with no capabilities at all: ``python nocaps.py PROGRAM ARGS...``.

Root's processes hold ``CAP_SYS_PTRACE``, which opens every process's /proc entries whatever
its dumpable flag; a test run as root runs the daemon and its attacker through this, so both
are processes of one uid without capabilities, as they would be in a deployment. Not root:
the program runs as it is. Exits 77 where the kernel refuses to drop them.
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys

PR_CAPBSET_DROP = 24
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
LINUX_CAPABILITY_VERSION_3 = 0x20080522
CANNOT_DROP = 77


class _Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _Data(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


def drop_all_capabilities() -> None:
    """Empty the bounding, ambient, inheritable, permitted and effective sets: the program
    exec'd next gets none back, not even as root."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in range(64):  # past the last capability the kernel knows: EINVAL, ignored
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() != errno.EINVAL:
            raise OSError(ctypes.get_errno(), f"PR_CAPBSET_DROP {cap}")
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    header, data = _Header(LINUX_CAPABILITY_VERSION_3, 0), (_Data * 2)()
    if libc.capset(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capset")


def main() -> None:
    if os.geteuid() == 0:
        try:
            drop_all_capabilities()
        except OSError as exc:
            print(f"cannot drop capabilities: {exc}", file=sys.stderr)
            sys.exit(CANNOT_DROP)
    os.execv(sys.argv[1], sys.argv[1:])


if __name__ == "__main__":
    main()
