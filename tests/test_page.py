import pytest

from kvstore.errors import CorruptPage
from kvstore.keys import BlockKey
from kvstore.page import HEADER_BYTES, PageMeta, decode_page, encode_page, page_length

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
