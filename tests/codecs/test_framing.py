"""The blob framing, raw and zstd: the lossless part of the codec contract."""

import pytest
import torch

from kvstore import codecs
from kvstore.errors import CodecError


def _kv(dtype=torch.bfloat16):
    return torch.randn(2, 2, 16, 2, 16).to(dtype)


@pytest.mark.parametrize("name", ["raw", "raw+zstd", "zstd", "raw+zstd:9"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_lossless_round_trip(name, dtype):
    kv = _kv(dtype)
    codec = codecs.get(name)
    blob = codec.encode(kv)
    assert torch.equal(codec.decode(blob), kv)
    assert torch.equal(codecs.decode(blob), kv)
    out = torch.empty_like(kv)
    assert codecs.decode(blob, out=out) is out and torch.equal(out, kv)


@pytest.mark.parametrize("name", ["raw", "raw+zstd"])
def test_damage_is_detected(name):
    blob = codecs.get(name).encode(_kv())
    for cut in (len(blob) - 1, len(blob) // 2, 3):
        with pytest.raises(CodecError):
            codecs.decode(blob[:cut])
    for pos in (0, 7, len(blob) // 2, len(blob) - 1):
        bad = bytearray(blob)
        bad[pos] ^= 0x10
        with pytest.raises(CodecError):
            codecs.decode(bytes(bad))
    with pytest.raises(CodecError, match="not a kvstore"):
        codecs.decode(b"GIF89a" + blob)


def test_unknown_names_and_bad_inputs():
    with pytest.raises(CodecError, match="unknown codec"):
        codecs.get("lz77")
    with pytest.raises(CodecError, match="only zstd"):
        codecs.get("raw+raw")
    with pytest.raises(CodecError, match="shape"):
        codecs.get("raw").encode(torch.zeros(3, 3))
    with pytest.raises(CodecError, match="dtype"):
        codecs.get("raw").encode(torch.zeros(1, 2, 1, 1, 1, dtype=torch.int32))
    with pytest.raises(CodecError, match="torch.Tensor"):
        codecs.get("raw").encode([1, 2])
    blob = codecs.get("raw").encode(_kv())
    with pytest.raises(CodecError, match="out has shape"):
        codecs.decode(blob, out=torch.empty(1))


def test_raw_bytes_per_element(spec):
    bpe = codecs.get("raw").bytes_per_element(spec)
    assert 2.0 < bpe < 2.1


def test_verify_false_skips_only_the_checksum():
    kv = _kv()
    blob = bytearray(codecs.get("raw").encode(kv))
    blob[-1] ^= 0xFF  # damage the checksum itself: the data is intact
    with pytest.raises(CodecError, match="checksum"):
        codecs.decode(bytes(blob))
    assert torch.equal(codecs.decode(bytes(blob), verify=False), kv)
    with pytest.raises(CodecError):  # framing is still checked
        codecs.decode(bytes(blob[:-3]), verify=False)


def _hostile_zstd(declared_bytes: int, frame: bytes) -> bytes:
    from kvstore.codecs.zstd import _HEADER, ZSTD_MAGIC

    return _HEADER.pack(ZSTD_MAGIC, declared_bytes) + frame


def test_zstd_refuses_a_hostile_declared_length_before_allocating():
    """A blob declaring 2**40 decompressed bytes used to reach zstd's allocation: it must fail
    with a CodecError naming the size, through every entry point."""
    import zstandard

    hostile = _hostile_zstd(1 << 40, zstandard.ZstdCompressor().compress(b"x" * 64))
    for decode in (lambda: codecs.decode(hostile), lambda: codecs.get("raw+zstd").decode(hostile)):
        with pytest.raises(CodecError, match=str(1 << 40)):
            decode()
    # The frame itself may declare the huge size (the kvstore header then claims less).
    big_frame = zstandard.ZstdCompressor().compress(b"\0" * (1 << 20))
    with pytest.raises(CodecError, match="frame declares"):
        codecs.decode(_hostile_zstd(64, big_frame))


def test_zstd_bound_follows_the_output_shape():
    """Decoding into ``out`` bounds the inner blob by out's size: a blob that would decompress to
    far more than the out tensor could ever need is refused before decompressing."""
    from kvstore.codecs.zstd import compress

    kv = _kv()
    inner = codecs.get("raw").encode(kv)
    blob = compress(inner + bytes(256 << 10))  # padded far past 2x out's bytes + framing slack
    out = torch.empty_like(kv)
    with pytest.raises(CodecError, match="more than"):
        codecs.decode(blob, out=out)
    good = codecs.get("raw+zstd").encode(kv)
    assert torch.equal(codecs.decode(good, out=out), kv)
