"""Device pool regions: a daemon exports a pool's memory once, a client maps it by its region.

A region names one pool: ``cuda-ipc:<device>:<bytes>:<handle hex>`` for a GPU allocation
exported through a CUDA IPC memory handle (cupy's runtime), or ``host:<name>`` for a pool in
host memory, which only the process that made it can map (tests and in-process engines run the
GPU path's logic on it). Mapping is cached per region and process: a pool is opened once.
"""

from __future__ import annotations

import secrets
import threading
import weakref
from dataclasses import dataclass

import torch

from kvstore.errors import InvalidArgument, Unavailable, shown

_HOST_POOLS: weakref.WeakValueDictionary[str, torch.Tensor] = weakref.WeakValueDictionary()
_MAPPED: dict[str, Mapping] = {}
_LOCK = threading.Lock()


@dataclass(frozen=True)
class Mapping:
    """A pool mapped in this process: its base address and size, and what keeps it mapped."""

    region: str
    base: int
    nbytes: int
    device: torch.device
    keep: object


def export_host_pool(memory: torch.Tensor, name: str) -> str:
    """The region of a host-memory pool (this process only)."""
    region = f"host:{name}.{secrets.token_hex(8)}"
    _HOST_POOLS[region] = memory
    return region


def export_cuda_pool(ptr: int, nbytes: int, device_index: int) -> str:
    """The region of a device allocation at ``ptr`` (its start: IPC handles name allocations)."""
    import cupy

    with cupy.cuda.Device(device_index):
        handle = cupy.cuda.runtime.ipcGetMemHandle(ptr)
    region = f"cuda-ipc:{device_index}:{nbytes}:{bytes(handle).hex()}"
    # CUDA cannot open an IPC handle in the process that exported it: this process (a daemon
    # with an engine inside it) maps the pool directly.
    with _LOCK:
        _MAPPED[region] = Mapping(region, ptr, nbytes, torch.device("cuda", device_index), None)
    return region


def map_region(region: str) -> Mapping:
    """Map the pool ``region`` names (once per process); InvalidArgument if it names none."""
    with _LOCK:
        mapped = _MAPPED.get(region)
        if mapped is not None:
            return mapped
        kind, _, rest = region.partition(":")
        if kind == "host":
            memory = _HOST_POOLS.get(region)
            if memory is None:
                raise InvalidArgument(f"region {shown(region, 48)} is a host pool of another "
                                      "process (or gone): only its own process can map it")
            mapped = Mapping(region, memory.data_ptr(), memory.numel(), memory.device, memory)
        elif kind == "cuda-ipc":
            mapped = _open_cuda(region, rest)
        else:
            raise InvalidArgument(f"unknown pool region {shown(region, 48)}")
        _MAPPED[region] = mapped
        return mapped


def _open_cuda(region: str, rest: str) -> Mapping:
    try:
        device, nbytes, handle = rest.split(":")
        index, size, raw = int(device), int(nbytes), bytes.fromhex(handle)
    except ValueError:
        raise InvalidArgument(f"malformed CUDA pool region {shown(region, 48)}") from None
    try:
        import cupy
    except ImportError as exc:
        raise Unavailable(f"mapping a GPU pool needs cupy: {exc}") from None
    with cupy.cuda.Device(index):
        try:
            ptr = cupy.cuda.runtime.ipcOpenMemHandle(raw)
        except cupy.cuda.runtime.CUDARuntimeError as exc:
            raise Unavailable(f"cannot open the GPU pool of region {shown(region, 48)}: "
                              f"{exc}") from None
    return Mapping(region, int(ptr), size, torch.device("cuda", index), "ipc")


def forget(region: str) -> None:
    """Drop this process's mapping of ``region`` (the pool's owner went away)."""
    with _LOCK:
        mapped = _MAPPED.pop(region, None)
    if mapped is not None and region.startswith("cuda-ipc:") and mapped.keep == "ipc":
        import cupy

        with cupy.cuda.Device(mapped.device.index):
            cupy.cuda.runtime.ipcCloseMemHandle(mapped.base)
