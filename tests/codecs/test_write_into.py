"""Blobs and pages written straight into a caller's buffer (``Codec.encode_into``,
``kvstore.page.write_page``) are byte for byte what the join-based framing wrote before, for
every codec: stored pages and SSD segments written by earlier builds still read."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch
import xxhash

from kvstore import codecs
from kvstore.codecs import base
from kvstore.codecs.fp4 import mxfp4_quantize_reference, nvfp4_quantize_reference
from kvstore.codecs.fp8 import PARAMS as FP8_PARAMS
from kvstore.codecs.fp8 import encode_fp8_reference
from kvstore.codecs.kivi import encode_kivi_reference
from kvstore.codecs.zstd import compress
from kvstore.errors import CapacityError, CodecError
from kvstore.keys import NO_PARENT, BlockKey
from kvstore.page import PageMeta, decode_page, encode_page, write_page

CHAINS = ["raw", "fp8_e4m3", "nvfp4", "mxfp4", "int4", "int2", "raw+zstd", "fp8_e4m3+zstd"]


# ------------------------------------------------ the framing as the join-based code wrote it


def _old_pack_blob(codec_id, dtype, shape, params, sections) -> bytes:
    """The blob framing before blobs were written in place (each section made contiguous,
    then everything joined), kept here as the format's reference."""
    views = []
    for s in sections:
        t = s.detach().cpu().contiguous().reshape(-1)
        views.append(memoryview(t.view(torch.uint8).numpy()))
    header = b"".join((
        struct.pack("<4sBBBB", b"KVCB", 1, codec_id, base.dtype_code(dtype), len(shape)),
        struct.pack(f"<{len(shape)}I", *shape),
        struct.pack("<H", len(params)),
        params,
        struct.pack("<B", len(views)),
        struct.pack(f"<{len(views)}Q", *(v.nbytes for v in views)),
    ))
    h = xxhash.xxh3_64(header)
    for v in views:
        h.update(v)
    return b"".join((header, *views, struct.pack("<Q", h.intdigest())))


def _old_encode_page(meta: PageMeta, payload: bytes) -> bytes:
    meta_bytes = json.dumps({"tenant": meta.tenant, "model": meta.model_id, "codec": meta.codec},
                            separators=(",", ":")).encode()
    header = bytearray(struct.pack("<4sHHI16s16s16sIQQ", b"KVPG", 1, meta.codec_id,
                                   meta.block_index, meta.namespace, meta.key,
                                   meta.parent or NO_PARENT, len(meta_bytes), len(payload), 0))
    h = xxhash.xxh3_64()
    for part in (header, meta_bytes, payload):
        h.update(part)
    struct.pack_into("<Q", header, 72, h.intdigest())  # the checksum field
    return b"".join((header, meta_bytes, payload))


def _old_blob(name: str, kv: torch.Tensor) -> bytes:
    """The blob of ``kv`` under codec chain ``name``, as the code before wrote it."""
    inner, _, stage = name.partition("+")
    shape, dtype = tuple(kv.shape), kv.dtype
    if inner == "raw":
        blob = _old_pack_blob(1, dtype, shape, b"", [kv])
    elif inner == "fp8_e4m3":
        parts = encode_fp8_reference(kv.contiguous())
        blob = _old_pack_blob(2, dtype, shape, FP8_PARAMS, [parts.codes, parts.scales])
    elif inner == "nvfp4":
        params = struct.pack("<BB", 16, 1)
        blob = _old_pack_blob(3, dtype, shape, params, nvfp4_quantize_reference(kv).sections())
    elif inner == "mxfp4":
        params = struct.pack("<B", 32)
        blob = _old_pack_blob(4, dtype, shape, params, mxfp4_quantize_reference(kv).sections())
    else:
        bits = {"int4": 4, "int2": 2}[inner]
        group = codecs.get(inner).group_for(shape[2])
        parts = encode_kivi_reference(kv.contiguous(), bits, group)
        params = struct.pack("<BBH", 1, bits, group)
        blob = _old_pack_blob({4: 5, 2: 6}[bits], dtype, shape, params, parts.tensors())
    return compress(blob) if stage else blob


# ---------------------------------------------------------------------------------- tests


def _run(dtype: torch.dtype, num_tokens: int = 64) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randn(3, 2, num_tokens, 2, 32, generator=g).to(dtype)


def _meta(codec: codecs.Codec, index: int) -> PageMeta:
    return PageMeta(key=BlockKey(bytes([index]) * 16), namespace=b"n" * 16,
                    parent=None if index == 0 else BlockKey(bytes([index - 1]) * 16),
                    block_index=index, tenant="acme", model_id="m", codec=codec.name,
                    codec_id=codec.codec_id)


@pytest.mark.parametrize("name", CHAINS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_page_written_in_place_matches_the_joined_page(name, dtype, monkeypatch):
    # Small pieces: sections split across several pieces and at odd byte counts.
    monkeypatch.setattr(base, "COPY_PIECE_BYTES", 1000)
    codec = codecs.get(name)
    run = _run(dtype)
    for index in range(2):
        block = run[:, :, index * 16 : (index + 1) * 16]  # a strided slice, as puts cut them
        assert not block.is_contiguous()
        old = _old_encode_page(_meta(codec, index), _old_blob(name, block))
        buf = bytearray(b"\xa5" * (len(old) + 100))
        assert write_page(buf, _meta(codec, index), codec.prepare(block)) == len(old)
        assert bytes(buf[: len(old)]) == old
        assert buf[len(old):] == b"\xa5" * 100  # nothing written past the page
        assert encode_page(_meta(codec, index), codec.encode(block)) == old
        page = decode_page(bytes(buf[: len(old)]), expected_key=_meta(codec, index).key)
        assert bytes(page.payload) == _old_blob(name, block)


@pytest.mark.parametrize("name", CHAINS)
def test_encode_into_writes_the_blob_and_refuses_a_short_buffer(name):
    codec = codecs.get(name)
    block = _run(torch.bfloat16)[:, :, 16:32]
    blob = codec.encode(block)
    out = bytearray(len(blob) + 7)
    assert codec.encode_into(block, memoryview(out)) == len(blob)
    assert bytes(out[: len(blob)]) == blob
    short = bytearray(len(blob) - 1)
    with pytest.raises(CodecError, match="does not fit"):
        codec.encode_into(block, memoryview(short))
    assert short == bytearray(len(blob) - 1)


def test_write_page_refuses_a_short_buffer_untouched():
    codec = codecs.get("raw")
    block = _run(torch.bfloat16)[:, :, :16]
    payload = codec.prepare(block)
    needed = len(encode_page(_meta(codec, 0), codec.encode(block)))
    buf = bytearray(needed - 1)
    with pytest.raises(CapacityError, match=f"page of {needed} bytes"):
        write_page(buf, _meta(codec, 0), payload)
    assert buf == bytearray(needed - 1)


def test_sections_copy_from_any_strides_and_any_device_dtype():
    """A section is copied in C order whatever its strides: a transposed tensor, a float8
    tensor (no numpy dtype of its own) and raw bytes."""
    t = torch.arange(24, dtype=torch.int16).reshape(4, 6).t()
    f8 = torch.linspace(-4, 4, 10).to(torch.float8_e4m3fn)
    for section, expected in ((t, t.contiguous().numpy().tobytes()),
                              (f8, f8.view(torch.uint8).numpy().tobytes()),
                              (b"abc", b"abc")):
        out = bytearray(len(expected) + 2)
        h = xxhash.xxh3_64()
        assert base.copy_section(memoryview(out), section, (h,)) == len(expected)
        assert bytes(out[: len(expected)]) == expected
        assert h.intdigest() == xxhash.xxh3_64_intdigest(expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_is_all_finite_reads_the_bits_of_any_float_dtype(dtype):
    t = _run(dtype)[:, :, 8:40]  # strided, as a block of a run
    assert base.is_all_finite(t)
    info = torch.finfo(dtype)
    edge = t.clone()
    edge[0, 0, 0, 0, :2] = torch.tensor([info.max, -info.max])  # the largest finite values
    assert base.is_all_finite(edge)
    for bad in (float("nan"), float("inf"), float("-inf")):
        damaged = t.clone()
        damaged[2, 1, 31, 1, 31] = bad
        assert not base.is_all_finite(damaged)
        assert not base.is_all_finite(damaged[:, :, 16:])
    assert base.is_all_finite(t[:, :, :0])


@pytest.mark.parametrize(("dtype", "nonfinite", "finite"), [
    (torch.bfloat16, (0x7FC0, 0x7F80, 0xFF80, 0x7F81, 0xFFC1),
     (0x0001, 0x8001, 0x007F, 0x7F7F, 0xFF7F, 0x8000)),
    (torch.float16, (0x7E00, 0x7C00, 0xFC00, 0x7C01, 0xFE01),
     (0x0001, 0x8001, 0x03FF, 0x7BFF, 0xFBFF, 0x8000)),
])
def test_bits_all_finite_knows_each_pattern_at_either_end(dtype, nonfinite, finite):
    """NaN, +Inf, -Inf, a signalling and a negative NaN are caught at the first and the last
    element; subnormals, -0 and the largest finite values of each sign pass."""
    bits = np.zeros(4096, dtype=np.uint16)
    bits[: len(finite)] = finite
    bits[-len(finite):] = finite
    assert base.bits_all_finite(bits, dtype)
    assert base.bits_all_finite(bits.view(np.int16), dtype)  # either integer view
    for pattern in nonfinite:
        for where in (0, -1):
            damaged = bits.copy()
            damaged[where] = pattern
            assert not base.bits_all_finite(damaged, dtype), (hex(pattern), where)
    assert base.bits_all_finite(bits[:0], dtype)


def test_bits_all_finite_refuses_bits_of_another_size():
    with pytest.raises(CodecError, match="bits of torch.float32"):
        base.bits_all_finite(np.zeros(4, dtype=np.uint16), torch.float32)
    with pytest.raises(CodecError, match="no bit-level finite check"):
        base.bits_all_finite(np.zeros(4, dtype=np.uint8), torch.float8_e4m3fn)
