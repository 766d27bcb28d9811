"""Device pool regions: a daemon exports a pool's memory once, a client maps it by its region.

A region names one pool: ``cuda-ipc:<device id>:<bytes>:<handle hex>`` for a GPU allocation
exported through a CUDA IPC memory handle (cupy's runtime), or ``host:<name>`` for a pool in
host memory, which only the process that made it can map (tests and in-process engines run the
GPU path's logic on it). Mapping is cached per region and process: a pool is opened once.

A GPU is named by its UUID (``device_id``: ``GPU-<uuid>``), never by its ordinal: the daemon and
an engine number their GPUs differently when their ``CUDA_VISIBLE_DEVICES`` differ. A region of
an older daemon names an ordinal, read as one of this process's. An engine on one GPU maps a
pool on another through peer access (NVLink or PCIe P2P), enabled once per pair of GPUs.
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
_BY_UUID: dict[str, torch.device] = {}  # device_id -> this process's device
_PEERS: set[tuple[int, int]] = set()  # (engine GPU, pool GPU) with peer access enabled
_LOCK = threading.Lock()
_DEVICES_LOCK = threading.Lock()  # taken inside _LOCK, never around it


@dataclass(frozen=True)
class Mapping:
    """A pool mapped in this process: its base address and size, and what keeps it mapped."""

    region: str
    base: int
    nbytes: int
    device: torch.device
    keep: object


def device_id(device: torch.device) -> str:
    """The name of ``device`` that every process agrees on: ``GPU-<uuid>`` for a GPU, else the
    device's own name (``cpu``, ``cpu:1``)."""
    if device.type != "cuda":
        return str(device)
    index = torch.cuda.current_device() if device.index is None else device.index
    uuid = str(torch.cuda.get_device_properties(index).uuid)
    return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"


def local_device(name: str) -> torch.device:
    """This process's device called ``name`` (a ``device_id``, or an ordinal from an older
    daemon); Unavailable if this process cannot see it."""
    if not name.startswith("GPU-"):
        try:
            return torch.device("cuda", int(name))
        except ValueError:
            raise InvalidArgument(f"malformed device name {shown(name, 48)}") from None
    with _DEVICES_LOCK:
        found = _BY_UUID.get(name)
        if found is None:
            for index in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
                device = torch.device("cuda", index)
                _BY_UUID.setdefault(device_id(device), device)
            found = _BY_UUID.get(name)
    if found is None:
        raise Unavailable(f"GPU {shown(name, 48)} is not visible to this process "
                          "(check CUDA_VISIBLE_DEVICES)")
    return found


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
    name = device_id(torch.device("cuda", device_index))
    region = f"cuda-ipc:{name}:{nbytes}:{bytes(handle).hex()}"
    # CUDA cannot open an IPC handle in the process that exported it: this process (a daemon
    # with an engine inside it) maps the pool directly.
    with _LOCK:
        _MAPPED[region] = Mapping(region, ptr, nbytes, torch.device("cuda", device_index), None)
    return region


def map_region(region: str, near: torch.device | None = None) -> Mapping:
    """Map the pool ``region`` names (once per process); InvalidArgument if it names none.

    ``near``: the GPU whose kernels will read and write the pool; when the pool lies on
    another GPU, peer access from ``near`` to it is enabled (Unavailable if the two GPUs have
    none)."""
    mapped = _map(region)
    if near is not None and near.type == "cuda" and mapped.device.type == "cuda":
        _enable_peer(near, mapped.device)
    return mapped


def _map(region: str) -> Mapping:
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
        name, nbytes, handle = rest.split(":")
        size, raw = int(nbytes), bytes.fromhex(handle)
    except ValueError:
        raise InvalidArgument(f"malformed CUDA pool region {shown(region, 48)}") from None
    try:
        import cupy
    except ImportError as exc:
        raise Unavailable(f"mapping a GPU pool needs cupy: {exc}") from None
    index = local_device(name).index
    with cupy.cuda.Device(index):
        try:
            ptr = cupy.cuda.runtime.ipcOpenMemHandle(raw)
        except cupy.cuda.runtime.CUDARuntimeError as exc:
            raise Unavailable(f"cannot open the GPU pool of region {shown(region, 48)}: "
                              f"{exc}") from None
    return Mapping(region, int(ptr), size, torch.device("cuda", index), "ipc")


def _enable_peer(near: torch.device, pool: torch.device) -> None:
    """Let kernels on GPU ``near`` reach memory on GPU ``pool`` (once per pair)."""
    if near.index == pool.index:
        return
    pair = (near.index, pool.index)
    with _LOCK:
        if pair in _PEERS:
            return
        import cupy

        runtime = cupy.cuda.runtime
        if not runtime.deviceCanAccessPeer(near.index, pool.index):
            raise Unavailable(f"GPU {near.index} has no peer access to GPU {pool.index}, where "
                              "the pool lies")
        with cupy.cuda.Device(near.index):
            try:
                runtime.deviceEnablePeerAccess(pool.index)
            except runtime.CUDARuntimeError as exc:
                if "PeerAccessAlreadyEnabled" not in str(exc):
                    raise Unavailable(f"cannot enable peer access from GPU {near.index} to "
                                      f"GPU {pool.index}: {exc}") from None
        _PEERS.add(pair)


def forget(region: str) -> None:
    """Drop this process's mapping of ``region`` (the pool's owner went away)."""
    with _LOCK:
        mapped = _MAPPED.pop(region, None)
    if mapped is not None and region.startswith("cuda-ipc:") and mapped.keep == "ipc":
        import cupy

        with cupy.cuda.Device(mapped.device.index):
            cupy.cuda.runtime.ipcCloseMemHandle(mapped.base)
