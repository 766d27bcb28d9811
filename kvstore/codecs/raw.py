"""The identity codec: the tensor's bytes, framed and checksummed."""

from __future__ import annotations

import torch

from kvstore.codecs.base import (
    BlobPlan,
    Codec,
    check_kv_input,
    check_out,
    framing_bytes,
    section_tensor,
    unpack_blob,
)
from kvstore.errors import CodecError


class RawCodec(Codec):
    name = "raw"
    codec_id = 1
    lossless = True

    def prepare(self, kv: torch.Tensor) -> BlobPlan:
        # The section is ``kv`` itself, strides and all: written, it is copied exactly once.
        kv = check_kv_input(kv, self.name, takes_bytes=True)
        return BlobPlan(self.codec_id, kv.dtype, tuple(kv.shape), b"", [kv])

    def decode(self, blob, out=None, verify=True):
        parts = unpack_blob(blob, verify)
        if parts.codec_id != self.codec_id:
            raise CodecError(f"blob was written by codec id {parts.codec_id}, not {self.name}")
        src = section_tensor(parts.sections[0], parts.dtype, parts.shape)
        out = check_out(out, parts.dtype, parts.shape)
        out.copy_(src)
        return out

    def bytes_per_element(self, spec) -> float:
        numel = spec.num_layers * 2 * spec.block_tokens * spec.num_kv_heads * spec.head_dim
        return spec.element_bytes + framing_bytes() / numel
