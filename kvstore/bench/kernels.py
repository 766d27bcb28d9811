"""GB/s of the Triton codec kernels (fp8_e4m3, nvfp4/mxfp4, int4/int2) against a device copy.

Each family's ``*_rows(nbytes)`` encodes and decodes a random bf16 canonical run of about
``nbytes`` on CUDA (32 layers, 8 kv heads, head_dim 128) and returns rows ``{"codec", "op",
"gbps", "copy_gbps", "ratio"}``: rates count bytes read plus bytes written, ratio = gbps /
copy_gbps, the copy of the same run measured in the same process. ``kvstore bench codecs``
prints them as its ``gpu-speed`` section.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvstore.errors import CodecError


def benchmark_kv(nbytes: int, device: str = "cuda") -> torch.Tensor:
    """A random bf16 canonical K/V run of about ``nbytes``: 32 layers, 8 kv heads, head_dim 128."""
    num_tokens = max(1, nbytes // (32 * 2 * 8 * 128 * 2))
    return torch.randn(32, 2, num_tokens, 8, 128, device=device, dtype=torch.bfloat16)


def copy_gbps(tensor: torch.Tensor) -> float:
    """Device-to-device copy rate of ``tensor`` in GB/s (bytes read + written)."""
    from triton.testing import do_bench

    dst = torch.empty_like(tensor)
    ms = do_bench(lambda: dst.copy_(tensor), return_mode="median")
    return 2 * tensor.numel() * tensor.element_size() / (ms * 1e6)


def _rows(codec: str, ops: dict[str, Callable[[], object]], moved: int, copy: float
          ) -> list[dict]:
    from triton.testing import do_bench

    rows = []
    for op, fn in ops.items():
        gbps = moved / (do_bench(fn, return_mode="median") * 1e6)
        rows.append({"codec": codec, "op": op, "gbps": gbps, "copy_gbps": copy,
                     "ratio": gbps / copy})
    return rows


def _need_cuda(what: str) -> None:
    if not torch.cuda.is_available():
        raise CodecError(f"{what} benchmark needs a CUDA device")


def fp8_rows(nbytes: int = 1 << 30) -> list[dict]:
    """Encode (hardware and integer rounding) and decode rates of fp8_e4m3."""
    from kvstore.codecs.triton.fp8 import decode_fp8, encode_fp8

    _need_cuda("fp8")
    kv = benchmark_kv(nbytes)
    copy = copy_gbps(kv)
    parts = encode_fp8(kv)
    packed = parts.codes.numel() + 2 * parts.scales.numel()
    out = torch.empty_like(kv)
    ops = {
        "encode": lambda: encode_fp8(kv, out=parts),
        "encode_int_round": lambda: encode_fp8(kv, out=parts, hw_round=False),
        "decode": lambda: decode_fp8(parts, out),
    }
    return _rows("fp8_e4m3", ops, kv.nbytes + packed, copy)


def fp4_rows(nbytes: int = 1 << 30) -> list[dict]:
    """Encode and decode rates of nvfp4 and mxfp4 (num_tokens a multiple of 16)."""
    from kvstore.codecs.triton import fp4

    _need_cuda("fp4")
    num_layers, num_kv_heads, head_dim = 32, 8, 128
    num_tokens = max(16, nbytes // (2 * num_layers * 2 * num_kv_heads * head_dim) // 16 * 16)
    x = torch.randn(num_layers, 2, num_tokens, num_kv_heads, head_dim, device="cuda",
                    dtype=torch.bfloat16)
    copy = copy_gbps(x)
    rows = []
    for name in ("nvfp4", "mxfp4"):
        encode, decode = getattr(fp4, f"{name}_encode"), getattr(fp4, f"{name}_decode")
        parts = encode(x)
        moved = x.numel() * x.element_size() + sum(t.numel() * t.element_size()
                                                   for t in parts.sections())
        out = torch.empty_like(x)
        ops = {"encode": lambda e=encode: e(x),
               "decode": lambda d=decode, p=parts, o=out: d(p, o)}
        rows += _rows(name, ops, moved, copy)
    return rows


def kivi_rows(nbytes: int = 1 << 30) -> list[dict]:
    """Encode and decode rates of int4 and int2 (group 32)."""
    from kvstore.codecs.triton.kivi import decode_kivi, encode_kivi

    _need_cuda("kivi")
    kv = benchmark_kv(nbytes)
    copy = copy_gbps(kv)
    rows = []
    for name, bits in (("int4", 4), ("int2", 2)):
        out = torch.empty_like(kv)
        parts = encode_kivi(kv, bits, 32)
        moved = kv.nbytes + sum(t.numel() * t.element_size() for t in parts.tensors())
        ops = {"encode": lambda b=bits: encode_kivi(kv, b, 32),
               "decode": lambda p=parts, o=out: decode_kivi(p, o)}
        rows += _rows(name, ops, moved, copy)
    return rows


# The gpu-speed section's kernel families, in the order it runs them.
FAMILIES: dict[str, Callable[[int], list[dict]]] = {
    "fp8": fp8_rows, "kivi": kivi_rows, "fp4": fp4_rows}

__all__ = ["FAMILIES", "benchmark_kv", "copy_gbps", "fp4_rows", "fp8_rows", "kivi_rows"]
