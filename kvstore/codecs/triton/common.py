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
PAGED_CACHE_DTYPES = (torch.bfloat16, torch.float16)


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


def check_paged_target(
    kv_cache: object, block_table: object, run_shape: tuple[int, ...]
) -> int:
    """Check a paged cache and block table against a run of canonical shape ``run_shape``.

    ``kv_cache`` is ``[num_layers, 2, num_pages, page_tokens, num_kv_heads, head_dim]`` (bf16 or
    fp16, contiguous) and ``block_table`` int32 ``[num_blocks]`` with
    ``num_blocks * page_tokens == num_tokens`` and every entry in ``[0, num_pages)``.

    Returns:
        page_tokens.
    """
    num_layers, _, num_tokens, num_kv_heads, head_dim = run_shape
    if not isinstance(kv_cache, torch.Tensor) or kv_cache.dim() != 6:
        raise CodecError("kv_cache: expected [num_layers, 2, num_pages, page_tokens, heads, dim]")
    if kv_cache.dtype not in PAGED_CACHE_DTYPES or not kv_cache.is_contiguous():
        raise CodecError(f"kv_cache: must be contiguous bf16/fp16, is {kv_cache.dtype}")
    layers, two, num_pages, page_tokens, heads, dim = kv_cache.shape
    if (layers, two, heads, dim) != (num_layers, 2, num_kv_heads, head_dim):
        raise CodecError(f"kv_cache shape {tuple(kv_cache.shape)} does not fit a run {run_shape}")
    if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32:
        raise CodecError("block_table: expected an int32 tensor")
    if block_table.dim() != 1 or block_table.numel() * page_tokens != num_tokens:
        raise CodecError(
            f"block_table holds {block_table.numel()} pages of {page_tokens} tokens, "
            f"the run holds {num_tokens} tokens"
        )
    if block_table.device != kv_cache.device:
        raise CodecError(f"block_table on {block_table.device}, kv_cache on {kv_cache.device}")
    if block_table.numel():
        low, high = torch.stack(torch.aminmax(block_table)).tolist()  # one device sync
        if low < 0 or high >= num_pages:
            raise CodecError(
                f"block_table entries span [{low}, {high}], kv_cache has {num_pages} pages"
            )
    return page_tokens


def scatter_pages_reference(run: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor
                            ) -> None:
    """Torch reference of the paged store: token t of ``run`` goes to page
    ``block_table[t // page_tokens]``, slot ``t % page_tokens``; other pages stay untouched."""
    layers, two, _, page_tokens, heads, dim = kv_cache.shape
    blocks = run.reshape(layers, two, block_table.numel(), page_tokens, heads, dim)
    kv_cache[:, :, block_table.long()] = blocks.to(device=kv_cache.device, dtype=kv_cache.dtype)


def check_finite(kv: torch.Tensor, name: str) -> torch.Tensor:
    """Lossy codecs reject NaN/Inf inputs: a scale computed from them would poison a whole group."""
    bad = int((~torch.isfinite(kv)).sum())
    if bad:
        raise CodecError(f"{name}: input holds {bad} non-finite values (NaN or Inf)")
    return kv


def benchmark_kv(nbytes: int, device: str = "cuda") -> torch.Tensor:
    """A random bf16 canonical K/V run of about ``nbytes``: 32 layers, 8 kv heads, head_dim 128."""
    num_tokens = max(1, nbytes // (32 * 2 * 8 * 128 * 2))
    return torch.randn(32, 2, num_tokens, 8, 128, device=device, dtype=torch.bfloat16)


def copy_gbps(tensor: torch.Tensor) -> float:
    """Device-to-device copy rate of ``tensor`` in GB/s (bytes read + written), for benchmarks."""
    from triton.testing import do_bench

    dst = torch.empty_like(tensor)
    ms = do_bench(lambda: dst.copy_(tensor), return_mode="median")
    return 2 * tensor.numel() * tensor.element_size() / (ms * 1e6)


__all__ = [
    "HAS_TRITON",
    "PAGED_CACHE_DTYPES",
    "benchmark_kv",
    "check_finite",
    "check_paged_target",
    "check_same_device",
    "check_tensor",
    "copy_gbps",
    "interpreter_enabled",
    "kernels_runnable",
    "on_device",
    "scatter_pages_reference",
    "tl",
    "triton",
    "use_triton",
]
