"""Shared plumbing for the Triton codec kernels: availability, interpreter mode, tensor checks."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from kvstore.errors import CodecError

try:  # triton is optional: without it every codec falls back to its torch reference
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = None
    tl = None

HAS_TRITON = triton is not None


def interpreter_enabled() -> bool:
    """True when Triton runs kernels on the CPU through its interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "") == "1"


def kernels_runnable(device: torch.device) -> bool:
    """Whether a Triton kernel can run on tensors of ``device`` in this process."""
    if not HAS_TRITON:
        return False
    return device.type == "cuda" or (device.type == "cpu" and interpreter_enabled())


def use_triton(tensor: torch.Tensor) -> bool:
    """The codecs' dispatch rule: the Triton path for CUDA tensors, the torch reference else."""
    return HAS_TRITON and tensor.is_cuda


def check_tensor(
    tensor: object,
    name: str,
    dtypes: tuple[torch.dtype, ...],
    shape: tuple[int, ...] | None = None,
    ndim: int | None = None,
) -> torch.Tensor:
    """Check a kernel argument: a contiguous tensor of an allowed dtype and shape on a device
    where kernels run. Raises CodecError naming ``name`` and what is wrong."""
    if not isinstance(tensor, torch.Tensor):
        raise CodecError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in dtypes:
        raise CodecError(f"{name}: dtype {tensor.dtype}, expected one of {list(dtypes)}")
    if shape is not None and tuple(tensor.shape) != tuple(shape):
        raise CodecError(f"{name}: shape {tuple(tensor.shape)}, expected {tuple(shape)}")
    if ndim is not None and tensor.dim() != ndim:
        raise CodecError(f"{name}: {tensor.dim()} dims ({tuple(tensor.shape)}), expected {ndim}")
    if not tensor.is_contiguous():
        raise CodecError(f"{name}: must be contiguous, has strides {tensor.stride()}")
    if not kernels_runnable(tensor.device):
        raise CodecError(
            f"{name}: Triton kernels cannot run on {tensor.device} here "
            "(need CUDA, or TRITON_INTERPRET=1 for CPU tensors, and triton installed)"
        )
    return tensor


def check_same_device(**tensors: torch.Tensor) -> torch.device:
    """All named tensors on one device; returns it."""
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise CodecError(f"kernel arguments on different devices: {devices}")
    return next(iter(devices.values()))


@contextlib.contextmanager
def on_device(device: torch.device) -> Iterator[None]:
    """Make ``device`` current while launching, so kernels run on the tensors' own GPU."""
    if device.type == "cuda":
        with torch.cuda.device(device):
            yield
    else:
        yield


def check_finite(kv: torch.Tensor, name: str) -> torch.Tensor:
    """Lossy codecs reject NaN/Inf inputs: a scale computed from them would poison a whole group."""
    bad = int((~torch.isfinite(kv)).sum())
    if bad:
        raise CodecError(f"{name}: input holds {bad} non-finite values (NaN or Inf)")
    return kv


__all__ = [
    "HAS_TRITON",
    "check_finite",
    "check_same_device",
    "check_tensor",
    "interpreter_enabled",
    "kernels_runnable",
    "on_device",
    "tl",
    "triton",
    "use_triton",
]
