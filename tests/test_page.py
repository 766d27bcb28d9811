import pytest
import torch

from kvstore import codecs
from kvstore.errors import CapacityError, CorruptPage
from kvstore.keys import BlockKey, Namespace
from kvstore.page import (
    HEADER_BYTES,
    KEY_SLICE,
    META_LEN_SLICE,
    PUBLISHED_HEADER_BYTES,
    PUBLISHED_MAGIC,
    PUBLISHED_RETIRED,
    PUBLISHED_STATE_OFFSET,
    PageMeta,
    decode_page,
    encode_page,
    is_published,
    is_retired,
    page_length,
    parse_page,
    verify_page,
)
from kvstore.spec import KVSpec

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


def test_an_unverified_page_is_checked_and_a_trusted_one_is_not_hashed_again():
    """verify_page checks the checksum of a page parsed from memory anyone could write, and
    accepts a page parsed as trusted (published memory, verified when the daemon put it there)
    as it is: the damage below is what a trusted page can never suffer."""
    buf = bytearray(encode_page(META, b"kv" * 500))
    page = parse_page(buf + b"trailing bytes", META.key)  # the header says where it ends
    assert not page.is_trusted and bytes(page.payload) == b"kv" * 500
    verify_page(page)
    buf[-1] ^= 0x01
    with pytest.raises(CorruptPage, match="checksum mismatch"):
        verify_page(parse_page(buf, META.key))
    trusted = parse_page(buf, META.key, is_trusted=True)
    assert trusted.is_trusted
    verify_page(trusted)
    with pytest.raises(CorruptPage, match="expected"):  # the header is still checked
        parse_page(buf, BlockKey(b"z" * 16), is_trusted=True)


def test_the_published_header_says_whether_a_region_was_given_back():
    region = bytearray(PUBLISHED_HEADER_BYTES + 4096)
    assert not is_published(region) and not is_retired(region)
    region[:PUBLISHED_STATE_OFFSET] = PUBLISHED_MAGIC
    assert is_published(region) and not is_retired(region)
    region[PUBLISHED_STATE_OFFSET] = PUBLISHED_RETIRED
    assert is_retired(region)
    assert not is_published(region[:PUBLISHED_HEADER_BYTES - 1])  # too short for a header


def _blob_sum_page() -> tuple[bytearray, int]:
    """A version 2 page (``write_page(aligned=True)``) of a raw bf16 block, and where its
    blob's first section starts."""
    import torch

    from kvstore.codecs import get as get_codec
    from kvstore.codecs.base import unpack_blob
    from kvstore.page import page_bytes, write_page

    payload = get_codec("raw").prepare(torch.randn(2, 2, 16, 2, 16).to(torch.bfloat16))
    buf = bytearray(page_bytes(payload, META))
    assert write_page(buf, META, payload, aligned=True) == len(buf)
    page = decode_page(buf, expected_key=META.key)
    section = unpack_blob(page.payload).sections[0]
    start = len(buf) - len(page.payload) + (len(page.payload) - section.nbytes - 8)
    return buf, start


def test_a_version_2_page_reads_back_with_its_first_section_aligned():
    from kvstore.page import PAGE_VERSION_BLOB_SUM, SECTION_ALIGN_BYTES

    buf, start = _blob_sum_page()
    assert buf[4] == PAGE_VERSION_BLOB_SUM and start % SECTION_ALIGN_BYTES == 0
    page = decode_page(buf, expected_key=META.key)
    assert page.meta == META  # the meta's padding is only whitespace
    # Version 1 pages still read: the same meta and payload framed the old way.
    old = encode_page(META, bytes(page.payload))
    assert old[4] == 1 and bytes(decode_page(old).payload) == bytes(page.payload)


@pytest.mark.parametrize("where", ["header", "meta", "blob header", "section", "blob sum"])
def test_any_flipped_byte_of_a_version_2_page_is_detected(where):
    """The page checksum no longer hashes the payload: damage to any of it must still be
    caught, through the blob's own checksum (or the page checksum over that sum)."""
    buf, start = _blob_sum_page()
    offset = {"header": 20, "meta": HEADER_BYTES + 2, "blob header": start - 3,
              "section": start + 1000, "blob sum": len(buf) - 2}[where]
    buf[offset] ^= 0x40
    with pytest.raises(CorruptPage):
        decode_page(buf, expected_key=META.key)


def test_a_pending_page_frames_the_same_bytes_wherever_it_is_written():
    """``PendingPage``: ``write_into`` a buffer and ``finished`` give the page
    ``write_page`` frames (version 2 by default, version 1 unpadded when not ``aligned``), and
    both decode to the K/V."""
    from kvstore.codecs import RawCodec, decode
    from kvstore.page import (
        PAGE_VERSION,
        PAGE_VERSION_BLOB_SUM,
        PendingPage,
        page_bytes,
        write_page,
    )

    kv = torch.randn(2, 2, 16, 4, 8).to(torch.bfloat16)
    for aligned, version in ((True, PAGE_VERSION_BLOB_SUM), (False, PAGE_VERSION)):
        page = PendingPage(META, RawCodec().prepare(kv), aligned=aligned)
        payload = RawCodec().prepare(kv)
        assert len(page) == page.nbytes == page_bytes(payload if aligned else payload.nbytes,
                                                      META)
        buf = bytearray(page.nbytes + 10)
        page.write_into(memoryview(buf))
        expected = bytearray(page.nbytes)
        write_page(expected, META, payload, aligned=aligned)
        assert bytes(buf[:page.nbytes]) == bytes(expected) == bytes(page.finished())
        assert expected[4] == version
        assert torch.equal(decode(decode_page(expected, META.key).payload), kv)
        with pytest.raises(CapacityError):
            page.write_into(memoryview(bytearray(page.nbytes - 1)))


def test_trusted_payload_reads_the_header_alone_and_still_checks_it():
    """``trusted_payload`` (pages in published memory) returns the payload ``parse_page``
    does, without the meta; a wrong key, a bad magic or a truncated page is still refused."""
    from kvstore.page import trusted_payload

    page = encode_page(META, b"payload bytes")
    assert bytes(trusted_payload(page, META.key)) == b"payload bytes"
    assert bytes(trusted_payload(page, META.key)) == bytes(parse_page(page, META.key).payload)
    with pytest.raises(CorruptPage, match="expected"):
        trusted_payload(page, BlockKey(b"x" * 16))
    with pytest.raises(CorruptPage, match="magic"):
        trusted_payload(b"XXXX" + page[4:], META.key)
    with pytest.raises(CorruptPage, match="truncated"):
        trusted_payload(page[:-1], META.key)


def test_the_exported_header_slices_find_the_key_and_meta_length():
    """client/staging.py reads many headers at once through these slices."""
    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, block_tokens=16)
    ns = Namespace(model_id="m", spec=spec, tenant="t")
    key = BlockKey(bytes(range(16)))
    meta = PageMeta.for_block(ns, key, None, 0, codecs.get("raw"))
    page = encode_page(meta, codecs.get("raw").encode(torch.zeros(spec.shape(spec.block_tokens),
                                                                  dtype=torch.bfloat16)))
    assert page[KEY_SLICE] == bytes(key)
    meta_len = int.from_bytes(page[META_LEN_SLICE], "little")
    assert decode_page(page).payload.nbytes == len(page) - HEADER_BYTES - meta_len
    assert (meta.namespace, meta.tenant, meta.model_id) == (ns.fingerprint, "t", "m")
