"""fp8_e4m3: K and V as float8 e4m3 codes with one bf16 scale per (token, kv head)."""

from __future__ import annotations

import struct

import torch

from kvstore.codecs.base import (
    BlobPlan,
    QuantizedCodec,
    check_kv_input,
    framing_bytes,
    section_tensor,
    unpack_blob,
)
from kvstore.codecs.parts import E4M3_MAX, MIN_SCALE, Fp8Parts
from kvstore.codecs.triton.common import check_finite, use_triton
from kvstore.errors import CodecError

FORMAT_VERSION = 1
# Scale layout 1 = per (token, kv head) for both K and V. Chosen by measurement on K with
# outlier channels (x20): relative L2 error 0.0171 against 0.0240 for per (channel, 32-token
# group) scales, attention-output error 0.050 against 0.067, at a quarter of the scale bytes.
SCALE_PER_TOKEN_HEAD = 1
_PARAMS = struct.Struct("<BB")  # format version, scale layout
PARAMS = _PARAMS.pack(FORMAT_VERSION, SCALE_PER_TOKEN_HEAD)
NUM_SECTIONS = 2


def row_scales(x: torch.Tensor) -> torch.Tensor:
    """bf16 scale per row of the last dim: amax / 448 rounded to nearest even bf16.

    bf16 rather than float32 halves the scale bytes; measured on K with outlier channels and
    on Gaussian V the error differs from float32 scales by under 0.5% (relative L2 0.01719 vs
    0.01715). Division by a tensor (not a Python scalar) keeps it IEEE-rounded on CUDA too.
    """
    amax = x.float().abs().amax(dim=-1)
    scales = (amax / torch.full_like(amax, E4M3_MAX)).to(torch.bfloat16)
    return scales.clamp_min(MIN_SCALE)


def encode_fp8_reference(kv: torch.Tensor) -> Fp8Parts:
    """Torch reference of the encode kernel, bit for bit: codes of clamp(x / scale, +-448)."""
    x = kv.float()
    scales = row_scales(x)
    inv = torch.reciprocal(scales.float())
    # Clamp first: torch turns values beyond +-448 into NaN where Triton saturates.
    y = (x * inv.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX)
    return Fp8Parts(y.to(torch.float8_e4m3fn).view(torch.uint8), scales)


def decode_fp8_reference(parts: Fp8Parts, dtype: torch.dtype) -> torch.Tensor:
    """Torch reference of the decode kernel: code * scale in float32, then cast to ``dtype``."""
    values = parts.codes.view(torch.float8_e4m3fn).float()
    return (values * parts.scales.float().unsqueeze(-1)).to(dtype)


class Fp8E4M3Codec(QuantizedCodec):
    """float8 e4m3 with a bf16 scale per (token, kv head): about 1 + 2/head_dim bytes/element.

    Inputs holding NaN or Inf are rejected with CodecError. CUDA tensors run the Triton kernels,
    CPU tensors the torch reference; both produce the same blob bytes.
    """

    name = "fp8_e4m3"
    codec_id = 2

    def prepare(self, kv: torch.Tensor) -> BlobPlan:
        kv = check_kv_input(kv, self.name)
        if kv.shape[-1] == 0:
            raise CodecError(f"{self.name}: head_dim must be positive, got shape {tuple(kv.shape)}")
        kv = check_finite(kv, self.name).contiguous()
        if use_triton(kv):
            from kvstore.codecs.triton.fp8 import encode_fp8

            parts = encode_fp8(kv)
        else:
            parts = encode_fp8_reference(kv)
        sections = [parts.codes, parts.scales]
        return BlobPlan(self.codec_id, kv.dtype, tuple(kv.shape), PARAMS, sections)

    def _reference_decode(self, parts: Fp8Parts, dtype: torch.dtype) -> torch.Tensor:
        return decode_fp8_reference(parts, dtype)

    def _kernel_decode(self, parts: Fp8Parts, out: torch.Tensor) -> None:
        from kvstore.codecs.triton.fp8 import decode_fp8

        decode_fp8(parts, out)

    def parse(self, blob, verify: bool = True) -> tuple[Fp8Parts, torch.dtype, tuple[int, ...]]:
        """Verify a blob and view its sections as CPU tensors (valid while the blob lives)."""
        parts = unpack_blob(blob, verify)
        if parts.codec_id != self.codec_id:
            raise CodecError(f"blob was written by codec id {parts.codec_id}, not {self.name}")
        if parts.params != PARAMS:
            raise CodecError(f"{self.name}: unsupported blob params {parts.params.hex()}")
        shape = parts.shape
        if len(shape) != 5 or shape[1] != 2 or len(parts.sections) != NUM_SECTIONS:
            raise CodecError(
                f"{self.name}: blob holds shape {shape} with {len(parts.sections)} sections"
            )
        codes = section_tensor(parts.sections[0], torch.uint8, shape)
        scales = section_tensor(parts.sections[1], torch.bfloat16, shape[:-1])
        return Fp8Parts(codes, scales), parts.dtype, shape

    def bytes_per_element(self, spec) -> float:
        numel = spec.num_layers * 2 * spec.block_tokens * spec.num_kv_heads * spec.head_dim
        num_scales = numel // spec.head_dim
        total = numel + 2 * num_scales + framing_bytes(5, NUM_SECTIONS, len(PARAMS))
        return total / numel
