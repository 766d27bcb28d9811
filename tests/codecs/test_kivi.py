"""int4 / int2 (KIVI): error bounds, packing, sizes, damage, the Triton kernels vs the reference."""

from __future__ import annotations

import math
import os
import struct

import pytest
import torch

from kvstore import codecs
from kvstore.codecs.base import framing_bytes, pack_blob
from kvstore.codecs.kivi import (
    Int2Codec,
    Int4Codec,
    decode_kivi_reference,
    encode_kivi_reference,
    group_params,
    pack,
    quantize,
    unpack,
)
from kvstore.codecs.parts import KiviParts
from kvstore.codecs.triton.common import HAS_TRITON, interpreter_enabled
from kvstore.errors import CodecError
from kvstore.spec import KVSpec

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernels = pytest.mark.skipif(
    not HAS_TRITON or (DEVICE == "cpu" and not interpreter_enabled()),
    reason="Triton kernels need CUDA, or TRITON_INTERPRET=1 in the environment for the CPU",
)
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
CODECS = {4: Int4Codec, 2: Int2Codec}


@pytest.fixture
def seed() -> int:
    """A fresh seed each run; assertion messages print it so a failure can be replayed."""
    value = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(value)
    return value


def kv_with_outliers(shape, dtype=torch.bfloat16, scale=20.0) -> torch.Tensor:
    """Random K/V whose K has a few outlier channels (x20), as KIVI observes in real K caches."""
    kv = torch.randn(shape)
    kv[:, 0, ..., torch.randperm(shape[-1])[:4]] *= scale
    return kv.to(dtype)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v per layer and head; q [L, Q, H, D], k and v [L, T, H, D]."""
    scores = torch.einsum("lqhd,lthd->lhqt", q, k) / math.sqrt(q.shape[-1])
    return torch.einsum("lhqt,lthd->lqhd", scores.softmax(-1), v)


def rel_l2(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return ((approx.double() - exact.double()).norm() / exact.double().norm()).item()


def _group_bound(x, x_hat, scale, bits, out_rounding):
    """Per element error bound of a group with stored fp16 (scale, zero) and range [lo, hi].

    Inside [zero, zero + levels * scale] rounding to the nearest code costs at most scale / 2.
    The zero point is min rounded to fp16 (2^-11 relative) and the scale is rounded to fp16 too
    (2^-11 relative, or 2^-25 absolute for fp16 subnormals), so values at the ends of the range
    can fall outside by those amounts and get clamped: 2^-10 * (|lo| + |hi|) + (levels + 1) *
    2^-24 covers both. Casting the decoded value to a 16-bit dtype adds half its ulp.
    """
    levels = 2**bits - 1
    span = x.abs().amax(dim=-1, keepdim=True)
    slack = 2.0**-10 * 2 * span + (levels + 1) * 2.0**-24
    return scale / 2 + slack + out_rounding * x_hat.abs()


@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_error_bound(bits, dtype, seed):
    layers, tokens, heads, dim, g = 2, 72, 2, 64, 32
    kv = kv_with_outliers((layers, 2, tokens, heads, dim), dtype)
    codec = CODECS[bits]()
    out = codec.decode(codec.encode(kv))
    assert out.dtype == dtype and out.shape == kv.shape
    parts = encode_kivi_reference(kv, bits, g)
    out_rounding = {torch.bfloat16: 2.0**-9, torch.float16: 2.0**-12, torch.float32: 2.0**-24}
    out_rounding = out_rounding[dtype]
    # K: groups of g tokens per channel; the trailing 8 tokens are the exact residual.
    k = kv[:, 0, :64].float().reshape(layers, 2, g, heads * dim).transpose(2, 3)
    k_hat = out[:, 0, :64].float().reshape(layers, 2, g, heads * dim).transpose(2, 3)
    k_scale = parts.k_meta[:, :, 0].float().unsqueeze(-1)
    k_bound = _group_bound(k, k_hat, k_scale, bits, out_rounding)
    assert bool(((k_hat - k).abs() <= k_bound).all()), f"seed {seed}"
    assert torch.equal(out[:, 0, 64:], kv[:, 0, 64:]), "residual tokens must be exact"
    v = kv[:, 1].float().reshape(layers, tokens, heads * dim // g, g)
    v_hat = out[:, 1].float().reshape(layers, tokens, heads * dim // g, g)
    v_scale = parts.v_meta[:, :, 0].float().unsqueeze(-1)
    v_bound = _group_bound(v, v_hat, v_scale, bits, out_rounding)
    assert bool(((v_hat - v).abs() <= v_bound).all()), f"seed {seed}"
    # Rounding errors are close to uniform on [-scale/2, scale/2], so the squared error sums
    # to about sum(scale^2) / 12 over thousands of elements (spread well under 10%): 1.15x
    # catches a bias (floor instead of round doubles the error) but not noise.
    expected = math.sqrt((parts.v_meta[:, :, 0].float() ** 2).sum().item() * g / 12)
    assert (v_hat - v).norm().item() <= 1.15 * expected + 1e-3, f"seed {seed}"


def test_residual_and_short_runs_are_exact():
    codec = Int2Codec(group_size=16)
    kv = torch.randn(1, 2, 3, 2, 16).to(torch.float16)  # shorter than the smallest group
    out = codec.decode(codec.encode(kv))
    assert torch.equal(out[:, 0], kv[:, 0])
    # 10 tokens under group 16: the run uses groups of 8, the 2 trailing K tokens stay exact.
    kv = torch.randn(1, 2, 10, 2, 16).to(torch.float16)
    blob = codec.encode(kv)
    assert codec.parse(blob)[0].group_size == 8
    assert torch.equal(codec.decode(blob)[:, 0, 8:], kv[:, 0, 8:])
    empty = torch.zeros(1, 2, 0, 2, 16)
    assert codec.decode(codec.encode(empty)).shape == empty.shape


def test_constant_groups_and_zeros():
    kv = torch.zeros(1, 2, 32, 2, 32)
    kv[0, 0, :, 1] = 3.25  # every K group of this head is constant: scale 0, exact zero point
    kv[0, 1, 5] = -1.5
    for codec in (Int4Codec(), Int2Codec()):
        out = codec.decode(codec.encode(kv))
        assert torch.equal(out, kv)


@pytest.mark.parametrize("bits", [4, 2])
def test_attention_output_error(bits, seed):
    kv = kv_with_outliers((2, 2, 128, 4, 128))
    out = CODECS[bits]().decode(CODECS[bits]().encode(kv)).float()
    k, v = kv[:, 0].float(), kv[:, 1].float()
    q = torch.randn(2, 64, 4, 128)
    exact = attention(q, k, v)
    # V alone: each output element is a convex combination of V rows, so it moves by at most
    # the same combination of the per-element V bounds (scale / 2 + fp16 slack + bf16 rounding).
    probs = (torch.einsum("lqhd,lthd->lhqt", q, k) / math.sqrt(128)).softmax(-1)
    scale = encode_kivi_reference(kv, bits, 32).v_meta[:, :, 0].float().unsqueeze(-1)
    grouped = (2, 128, 16, 32)  # [layers, tokens, groups of 32 channels, 32]
    v_err = _group_bound(v.reshape(grouped), out[:, 1].reshape(grouped), scale, bits, 2.0**-9)
    v_bound = torch.einsum("lhqt,lthd->lqhd", probs, v_err.reshape(v.shape)) + 1e-5
    assert bool(((attention(q, k, out[:, 1]) - exact).abs() <= v_bound).all()), f"seed {seed}"
    # K and V together on random data (no structure for the codes to exploit): measured over
    # 30 runs 0.138-0.167 relative L2 for int4 and 0.67-0.78 for int2 (the element error alone
    # is 0.078 and 0.39: uniform rounding of steps of range/15 and range/3 over groups of 32
    # Gaussians). The bounds leave about 1.5x and 1.3x for spread; a misplaced group or scale
    # gives errors above 1.
    limit = {4: 0.25, 2: 1.0}[bits]
    assert rel_l2(attention(q, out[:, 0], out[:, 1]), exact) <= limit, f"seed {seed}"


def _per_token_k(k: torch.Tensor, bits: int, g: int = 32) -> torch.Tensor:
    """The layout KIVI rejects for K: groups of g channels per token, same rounding."""
    grouped = k.reshape(*k.shape[:2], -1, g)
    scale, zero = group_params(grouped.amin(-1), grouped.amax(-1), bits)
    codes = quantize(grouped, scale.unsqueeze(-1), zero.unsqueeze(-1), bits).float()
    return (codes * scale.unsqueeze(-1).float() + zero.unsqueeze(-1).float()).reshape(k.shape)


@pytest.mark.parametrize("bits", [4, 2])
def test_per_channel_k_beats_per_token_on_outlier_channels(bits, seed):
    kv = kv_with_outliers((2, 2, 128, 4, 128))
    k, v = kv[:, 0].float(), kv[:, 1].float()
    per_channel = decode_kivi_reference(encode_kivi_reference(kv, bits, 32), torch.float32)[:, 0]
    per_token = _per_token_k(k, bits)
    # Measured over 30 runs: K error ratio (per-channel / per-token) 0.65-0.70 for int4 and
    # 0.70-0.86 for int2; attention error ratio for int4 0.36-0.47.
    assert rel_l2(per_channel, k) < rel_l2(per_token, k), f"seed {seed}"
    if bits == 4:
        q = torch.randn(2, 64, 4, 128)
        exact = attention(q, k, v)
        ratio = rel_l2(attention(q, per_channel, v), exact)
        ratio /= rel_l2(attention(q, per_token, v), exact)
        assert ratio < 0.75, f"seed {seed}"


def test_packing_puts_even_elements_in_low_bits():
    assert pack(torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8), 4).tolist() == [[0x21, 0x0F]]
    assert pack(torch.tensor([[1, 2, 3, 0]], dtype=torch.uint8), 2).tolist() == [[0x39]]
    codes = torch.randint(0, 4, (3, 16), dtype=torch.uint8)
    assert torch.equal(unpack(pack(codes, 2), 2).to(torch.uint8), codes)
    # Through the codec: one V group holding 0..15 quantises to codes 0..15 exactly.
    kv = torch.zeros(1, 2, 16, 1, 16)
    kv[0, 1, 0, 0] = torch.arange(16.0)
    parts = Int4Codec(group_size=16).parse(Int4Codec(group_size=16).encode(kv))[0]
    first_token = parts.v_codes.flatten()[:8].tolist()
    assert first_token == [0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]


@pytest.mark.parametrize("bits,expected", [(2, 0.375), (4, 0.625)])
def test_bytes_per_element_matches_blob(bits, expected):
    codec = CODECS[bits]()
    for block_tokens in (256, 48):  # 48 = one group of 32 plus 16 residual K tokens
        spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=64, block_tokens=block_tokens)
        block = torch.randn(spec.block_shape).to(spec.torch_dtype)
        assert codec.bytes_per_element(spec) == len(codec.encode(block)) / block.numel()
    big = KVSpec(num_layers=32, num_kv_heads=8, head_dim=128, block_tokens=256)
    framing = framing_bytes(5, 5, 4) / big.elements_per_block
    assert codec.bytes_per_element(big) == pytest.approx(expected + framing, rel=1e-12)
    assert CODECS[bits](group_size=64).bytes_per_element(big) == pytest.approx(
        bits / 8 + 4 / 64 + framing, rel=1e-12)


def test_group_size_is_recorded_and_validated():
    kv = torch.randn(1, 2, 40, 2, 32).to(torch.bfloat16)
    blob = Int4Codec(group_size=16).encode(kv)
    assert Int4Codec(group_size=16).parse(blob)[0].group_size == 16
    assert torch.equal(codecs.decode(blob), Int4Codec(group_size=16).decode(blob))
    assert codecs.decode(blob).shape == kv.shape
    for bad in (0, 3, 24, 512):
        with pytest.raises(CodecError, match="group_size"):
            Int4Codec(group_size=bad)
    with pytest.raises(CodecError, match="not a multiple of group_size"):
        Int2Codec(group_size=64).encode(torch.randn(1, 2, 64, 2, 32).to(torch.bfloat16))
    assert isinstance(codecs.get("int4"), Int4Codec) and codecs.get("int4").codec_id == 5
    assert isinstance(codecs.get("int2"), Int2Codec) and codecs.get("int2").codec_id == 6
    zblob = codecs.get("int2+zstd").encode(kv)
    assert torch.equal(codecs.decode(zblob), Int2Codec().decode(Int2Codec().encode(kv)))


def test_bad_inputs_and_blobs():
    codec = Int4Codec()
    kv = torch.randn(1, 2, 40, 2, 32)
    for bad, match in ((float("nan"), "2 non-finite"), (7e4, "2 values beyond fp16")):
        damaged = kv.clone()
        damaged[0, 0, 3, 1, 2] = damaged[0, 1, 39, 0, 0] = bad
        with pytest.raises(CodecError, match=match):
            codec.encode(damaged)
    with pytest.raises(CodecError, match="dtype"):
        codec.encode(kv.double())
    blob = codec.encode(kv)
    for cut in (len(blob) - 1, len(blob) // 2, 12):
        with pytest.raises(CodecError):
            codec.decode(blob[:cut])
    for pos in (6, 40, len(blob) // 2, len(blob) - 2):
        damaged_blob = bytearray(blob)
        damaged_blob[pos] ^= 0x20
        with pytest.raises(CodecError):
            codec.decode(bytes(damaged_blob))
    with pytest.raises(CodecError, match="codec id 6"):
        codec.decode(Int2Codec().encode(kv))
    sections, shape = encode_kivi_reference(kv, 4, 32).tensors(), tuple(kv.shape)
    with pytest.raises(CodecError, match="2 bits"):
        codec.decode(pack_blob(5, kv.dtype, shape, struct.pack("<BBH", 1, 2, 32), sections))
    with pytest.raises(CodecError, match="group size 24"):
        codec.decode(pack_blob(5, kv.dtype, shape, struct.pack("<BBH", 1, 4, 24), sections))
    with pytest.raises(CodecError, match="section holds"):
        codec.decode(pack_blob(5, kv.dtype, shape, struct.pack("<BBH", 1, 4, 16), sections))
    with pytest.raises(CodecError, match="sections"):
        codec.decode(pack_blob(5, kv.dtype, shape, struct.pack("<BBH", 1, 4, 32), sections[:4]))


# ---- Triton kernels against the reference (the interpreter on CPU, the real thing on CUDA) ----


@needs_kernels
@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads,dim,g", [(40, 3, 32, 16), (20, 2, 64, 8)])
def test_encode_kernels_match_reference_bit_for_bit(bits, dtype, tokens, heads, dim, g, seed):
    from kvstore.codecs.triton.kivi import encode_kivi

    kv = kv_with_outliers((2, 2, tokens, heads, dim), dtype)
    kv[1, 1, 3] = 0.5  # constant V groups: scale 0
    expected = encode_kivi_reference(kv, bits, g)
    parts = encode_kivi(kv.to(DEVICE), bits, g)
    for got, want in zip(parts.tensors(), expected.tensors(), strict=True):
        assert torch.equal(got.cpu(), want), f"seed {seed}"


@needs_kernels
@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_kernels_match_reference(bits, dtype, seed):
    from kvstore.codecs.triton.kivi import decode_kivi

    parts = encode_kivi_reference(kv_with_outliers((2, 2, 37, 3, 32), dtype), bits, 16)
    out = torch.full((2, 2, 37, 3, 32), float("nan"), dtype=dtype, device=DEVICE)
    decode_kivi(parts.to(torch.device(DEVICE)), out)
    _assert_close_to(out.cpu(), decode_kivi_reference(parts, dtype), seed)


def _assert_close_to(actual: torch.Tensor, expected: torch.Tensor, seed: int) -> None:
    """Exact on a GPU; in the interpreter float32 -> bf16 truncates instead of rounding to
    nearest, so a bf16 result may sit one ulp away (neighbouring bit patterns)."""
    if DEVICE == "cuda" or actual.dtype != torch.bfloat16:
        assert torch.equal(actual, expected), f"seed {seed}"
        return
    steps = (actual.view(torch.int16).int() - expected.view(torch.int16).int()).abs()
    assert bool(((steps <= 1) | (actual == expected)).all()), f"seed {seed}: {steps.max()}"


@needs_kernels
def test_kernel_wrappers_reject_bad_arguments():
    from kvstore.codecs.triton.kivi import decode_kivi, encode_kivi

    kv = torch.randn(1, 2, 16, 2, 16, device=DEVICE)
    with pytest.raises(CodecError, match="contiguous"):
        encode_kivi(kv.transpose(3, 4), 4, 16)
    with pytest.raises(CodecError, match="group size"):
        encode_kivi(kv, 3, 16)
    parts = encode_kivi(kv, 4, 16)
    bad = KiviParts(4, 16, parts.k_codes, parts.k_meta.float(), parts.k_residual, parts.v_codes,
                    parts.v_meta)
    with pytest.raises(CodecError, match="k_meta: dtype"):
        decode_kivi(bad, torch.empty_like(kv))
    with pytest.raises(CodecError, match="out: shape"):
        decode_kivi(parts, torch.empty(1, 2, 15, 2, 16, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not HAS_TRITON, reason="needs CUDA")
@pytest.mark.parametrize("bits", [4, 2])
def test_gpu_and_cpu_blobs_are_identical(bits, seed):
    codec = CODECS[bits]()
    kv = kv_with_outliers((4, 2, 80, 8, 128))
    gpu_blob = codec.encode(kv.cuda())
    assert gpu_blob == codec.encode(kv), f"seed {seed}"
    on_gpu = codec.decode(gpu_blob, out=torch.empty_like(kv, device="cuda"))
    assert torch.equal(on_gpu.cpu(), codec.decode(gpu_blob)), f"seed {seed}"


@pytest.mark.parametrize("name", ["int4", "int2"])
def test_one_page_shorter_than_a_group_still_compresses_k(name):
    """Regression: a 16-token page under the default group of 32 kept all of K as bf16
    residual (no compression of K at all); it now uses groups of 16."""
    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=32, block_tokens=16)
    kv = torch.randn(spec.block_shape).to(spec.torch_dtype)
    codec = codecs.get(name)
    blob = codec.encode(kv)
    bits = 4 if name == "int4" else 2
    # bits/8 + 4 bytes of scale and zero per 16-element group, plus framing: no bf16 residual.
    assert len(blob) / kv.numel() == codec.bytes_per_element(spec) < bits / 8 + 4 / 16 + 0.05
    rel = ((codec.decode(blob).float() - kv.float()).norm() / kv.float().norm()).item()
    # The same bounds as full groups: (max-min)/(2*(2^bits-1)) per element, ~0.1 / ~0.45 rel.
    assert rel < (0.15 if bits == 4 else 0.6)
