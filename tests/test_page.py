import pytest

from kvstore.errors import CorruptPage
from kvstore.keys import BlockKey
from kvstore.page import (
    HEADER_BYTES,
    TAG_BYTES,
    PageMeta,
    PageSealer,
    Seal,
    decode_page,
    encode_page,
    page_length,
    parse_page,
    verify_page,
)

META = PageMeta(key=BlockKey(b"k" * 16), namespace=b"n" * 16, parent=BlockKey(b"p" * 16),
                block_index=3, tenant="acme", model_id="m", codec="raw", codec_id=1)


def test_round_trip():
    payload = bytes(range(256)) * 10
    buf = encode_page(META, payload)
    page = decode_page(buf, expected_key=META.key)
    assert page.meta == META and bytes(page.payload) == payload
    assert page_length(buf) == len(buf)


def test_first_block_has_no_parent():
    meta = PageMeta(key=BlockKey(b"k" * 16), namespace=b"n" * 16, parent=None, block_index=0,
                    tenant="t", model_id="m", codec="raw")
    assert decode_page(encode_page(meta, b"x")).meta.parent is None


@pytest.mark.parametrize("offset", [0, 5, 20, HEADER_BYTES - 1, HEADER_BYTES + 3, -1])
def test_any_flipped_byte_is_detected(offset):
    buf = bytearray(encode_page(META, b"payload" * 100))
    buf[offset] ^= 0x40
    with pytest.raises(CorruptPage):
        decode_page(buf, expected_key=META.key)


def test_wrong_key_truncation_and_version():
    buf = encode_page(META, b"abc" * 50)
    with pytest.raises(CorruptPage, match="expected"):
        decode_page(buf, expected_key=BlockKey(b"z" * 16))
    with pytest.raises(CorruptPage, match="truncated"):
        decode_page(buf[:-1])
    with pytest.raises(CorruptPage, match="truncated"):
        decode_page(buf[:10])
    bad = bytearray(buf)
    bad[4] = 9
    with pytest.raises(CorruptPage, match="version"):
        decode_page(bad)


def _forge(buf: bytes, payload: bytes) -> bytes:
    """Another payload under the same header fields, its plain checksum recomputed, as a
    writer with access to the page's memory could make it."""
    return encode_page(decode_page(buf).meta, payload)


def test_a_sealed_page_verifies_against_its_seal():
    sealer = PageSealer()
    buf = encode_page(META, b"kv" * 500)
    seal = sealer.seal(buf)
    assert len(seal.tag) == TAG_BYTES and "secret" in repr(sealer)
    assert bytes(decode_page(buf, META.key, seal).payload) == b"kv" * 500
    page = parse_page(buf + b"trailing bytes", META.key, seal)  # the header says where it ends
    assert page.seal is seal
    verify_page(page)


def test_a_forged_page_with_a_recomputed_checksum_fails_its_seal():
    sealer = PageSealer()
    buf = encode_page(META, b"a" * 1000)
    seal = sealer.seal(buf)
    forged = _forge(buf, b"b" * 1000)
    assert decode_page(forged).meta == META  # the plain checksum is fooled
    with pytest.raises(CorruptPage, match="fails its seal"):
        decode_page(forged, META.key, seal)
    with pytest.raises(CorruptPage, match="fails its seal"):
        verify_page(parse_page(forged, META.key, seal))
    with pytest.raises(CorruptPage, match="fails its seal"):  # a tag made under another secret
        decode_page(buf, META.key, Seal(sealer, PageSealer().tag(buf)))


@pytest.mark.parametrize("offset", [0, 20, HEADER_BYTES - 1, HEADER_BYTES + 3, -1])
def test_any_flipped_byte_breaks_the_seal(offset):
    sealer = PageSealer(bytes(range(32)))
    buf = encode_page(META, b"payload" * 100)
    seal = sealer.seal(buf)
    damaged = bytearray(buf)
    damaged[offset] ^= 0x01
    with pytest.raises(CorruptPage):
        decode_page(damaged, META.key, seal)


def test_a_seal_key_has_32_bytes():
    with pytest.raises(ValueError, match="32 bytes"):
        PageSealer(b"short")
