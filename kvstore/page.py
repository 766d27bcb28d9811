"""The self-describing stored page: a fixed header, a small JSON meta section and the payload.

Layout (little-endian)::

    magic "KVPG" | version u16 | codec_id u16 | block_index u32 | namespace fingerprint 16B |
    key 16B | parent key 16B (zeros for a first block) | meta_len u32 | payload_len u64 |
    checksum u64 | meta (JSON: tenant, model, codec chain) | payload (codec blob)

The checksum is xxh3-64 over the header (with the checksum field zero), meta and payload.
Any reader can verify and decode a page without outside state. The checksum catches damage, not
forgery: whoever can write a page can recompute it. Where pages sit in memory that clients can
write (the DRAM arenas), the daemon also seals each page it stores there: a :class:`PageSealer`
makes a keyed MAC of the whole page under a secret only the daemon holds, and the daemon keeps
that tag in its own memory beside the page (a :class:`Seal`). A page read back is trusted only
if it still matches its tag, so a forged page, checksum recomputed, is never served.
"""

from __future__ import annotations

import functools
import hmac
import json
import secrets
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

import blake3
import xxhash

from kvstore.errors import CapacityError, CorruptPage
from kvstore.keys import NO_PARENT, BlockKey

if TYPE_CHECKING:
    from kvstore.codecs.base import Payload

PAGE_MAGIC = b"KVPG"
PAGE_VERSION = 1
_HEADER = struct.Struct("<4sHHI16s16s16sIQQ")
HEADER_BYTES = _HEADER.size
_CHECKSUM_OFFSET = HEADER_BYTES - 8
_CHECKSUM = struct.Struct("<Q")
_ZERO_CHECKSUM = bytes(_CHECKSUM.size)
MAX_META_BYTES = 64 * 1024
SEAL_KEY_BYTES = 32
TAG_BYTES = 16  # a 128-bit tag: a blind forgery succeeds with probability 2**-128


@dataclass(frozen=True, slots=True)
class PageMeta:
    """What a page says about its block besides the payload."""

    key: BlockKey
    namespace: bytes  # namespace fingerprint
    parent: BlockKey | None  # None for the first block of a prefix
    block_index: int  # position of the block in its prefix (0-based)
    tenant: str
    model_id: str
    codec: str  # codec chain name, e.g. "fp8_e4m3+zstd"
    codec_id: int = 0


@dataclass(frozen=True, slots=True)
class Page:
    """A parsed page: its meta, a view of its payload and a view of the whole encoded page.

    ``decode_page`` returns it verified; ``parse_page`` (and a tier's ``read(key, verify=False)``)
    leaves the check to ``verify_page``, which must accept it before any of it is used: against
    ``seal`` when the page came with one (it sits in memory clients can write), else its checksum.
    """

    meta: PageMeta
    payload: memoryview
    data: memoryview  # header + meta + payload, e.g. to copy the page to another tier as is
    seal: Seal | None = None


class PageSealer:
    """Makes and checks keyed MACs of whole pages under a secret that never leaves it.

    BLAKE3 in keyed mode is a PRF: without the secret, no writer can make a page match a tag,
    and a tag says nothing about the secret. The secret is random per sealer (per daemon run)
    and never stored anywhere. Thread-safe; hashing releases the GIL, so callers tag and check
    large pages on worker threads.
    """

    __slots__ = ("_key",)

    def __init__(self, key: bytes | None = None) -> None:
        if key is not None and len(key) != SEAL_KEY_BYTES:
            raise ValueError(f"a seal key is {SEAL_KEY_BYTES} bytes, got {len(key)}")
        self._key = secrets.token_bytes(SEAL_KEY_BYTES) if key is None else bytes(key)

    def __repr__(self) -> str:
        return "PageSealer(<secret>)"

    def tag(self, page: bytes | bytearray | memoryview) -> bytes:
        """The MAC of the page that starts at ``page`` (its header says where it ends)."""
        view = memoryview(page).cast("B")
        return blake3.blake3(view[:page_length(view)], key=self._key).digest(TAG_BYTES)

    def seal(self, page: bytes | bytearray | memoryview) -> Seal:
        """The seal to keep beside ``page`` (its tag under this sealer)."""
        return Seal(self, self.tag(page))


@dataclass(frozen=True, slots=True)
class Seal:
    """The tag its sealer made of a page when storing it, kept where no client can write."""

    sealer: PageSealer
    tag: bytes

    def check(self, page: Page) -> None:
        """CorruptPage unless ``page`` is, byte for byte, the page this seal was made of."""
        if not hmac.compare_digest(self.sealer.tag(page.data), self.tag):
            raise CorruptPage(f"page checksum mismatch for key {bytes(page.meta.key).hex()}: "
                              "the page fails its seal (keyed checksum), it changed after the "
                              "daemon stored it")


def encode_page(meta: PageMeta, payload: bytes | bytearray | memoryview) -> bytes:
    """Serialise ``payload`` with its header and checksum."""
    meta_bytes = _meta_bytes(meta)
    header = bytearray(_header(meta, len(meta_bytes), len(payload)))
    h = xxhash.xxh3_64()
    h.update(header)
    h.update(meta_bytes)
    h.update(payload)
    struct.pack_into("<Q", header, _CHECKSUM_OFFSET, h.intdigest())
    return b"".join((header, meta_bytes, payload))


def write_page(out: memoryview | bytearray, meta: PageMeta, payload: Payload) -> int:
    """Write the page of an encoded ``payload`` straight into the front of ``out`` (a slot, a
    reused write buffer); return the page's length.

    The same bytes as ``encode_page(meta, payload.to_bytes())``, in one pass: the header and
    meta go in front, the codec writes its blob behind them, and the page checksum is fed the
    blob piece by piece as it is written, then patched into the header. CapacityError, with
    nothing written, if ``out`` is too small.
    """
    meta_bytes = _meta_bytes(meta)
    start = HEADER_BYTES + len(meta_bytes)
    total = start + payload.nbytes
    view = memoryview(out).cast("B")
    if view.nbytes < total:
        raise CapacityError(f"page of {total} bytes for key {bytes(meta.key).hex()} does not "
                            f"fit its {view.nbytes}-byte buffer")
    header = _header(meta, len(meta_bytes), payload.nbytes)
    h = xxhash.xxh3_64()
    h.update(header)
    h.update(meta_bytes)
    view[:HEADER_BYTES] = header
    view[HEADER_BYTES:start] = meta_bytes
    payload.write_into(view[start:total], (h,))
    _CHECKSUM.pack_into(view, _CHECKSUM_OFFSET, h.intdigest())
    return total


def _meta_bytes(meta: PageMeta) -> bytes:
    return _meta_json(meta.tenant, meta.model_id, meta.codec)


@functools.lru_cache(maxsize=1024)
def _meta_json(tenant: str, model_id: str, codec: str) -> bytes:
    # The same few (tenant, model, codec) triples on every page: json.dumps cost about 30 us a
    # page, a tenth of writing a 2 MiB raw page.
    return json.dumps({"tenant": tenant, "model": model_id, "codec": codec},
                      separators=(",", ":")).encode()


def _header(meta: PageMeta, meta_len: int, payload_len: int) -> bytes:
    """The fixed header with a zero checksum (the checksum is computed over it so)."""
    return _HEADER.pack(PAGE_MAGIC, PAGE_VERSION, meta.codec_id, meta.block_index,
                        meta.namespace, meta.key, meta.parent or NO_PARENT, meta_len,
                        payload_len, 0)


def page_bytes(payload_len: int, meta: PageMeta) -> int:
    """Size of the encoded page (header + meta + payload) for sizing slots."""
    return HEADER_BYTES + len(_meta_bytes(meta)) + payload_len


def page_length(buf: bytes | bytearray | memoryview) -> int:
    """Total length of the page that starts at ``buf`` (from its header alone)."""
    view = memoryview(buf)
    if len(view) < HEADER_BYTES:
        raise CorruptPage(f"page truncated: {len(view)} bytes, header needs {HEADER_BYTES}")
    fields = _HEADER.unpack_from(view)
    if fields[0] != PAGE_MAGIC:
        raise CorruptPage(f"bad page magic {bytes(fields[0])!r}")
    return HEADER_BYTES + fields[7] + fields[8]


def decode_page(buf: bytes | bytearray | memoryview, expected_key: bytes | None = None,
                seal: Seal | None = None) -> Page:
    """Verify and parse a page; raise CorruptPage naming the first fault found.

    With ``seal`` the page must match it (which implies its checksum: only pages whose checksum
    held are ever sealed); without, its checksum must hold. The returned payload is a view into
    ``buf`` (no copy).
    """
    page = parse_page(buf, expected_key, seal)
    verify_page(page)
    return page


def parse_page(buf: bytes | bytearray | memoryview, expected_key: bytes | None = None,
               seal: Seal | None = None) -> Page:
    """Parse a page without checking its checksum or seal; CorruptPage if the header or meta is
    damaged.

    Cheap (no pass over the payload). Nothing in the returned page may be trusted, or leave
    the reader, before ``verify_page`` accepted it (against ``seal``, if given).
    """
    return _make_page(*_parse_header(buf, expected_key), seal)


def verify_page(page: Page) -> None:
    """Check a parsed page against its seal if it has one (one keyed BLAKE3 pass), else its
    checksum (one xxh3 pass); CorruptPage if it fails.

    Releases the GIL while hashing, so worker threads verify side by side. Hashing leaves the
    page in the CPU caches: copying its payload right after, on the same thread, costs about
    what the copy alone costs.
    """
    if page.seal is not None:
        page.seal.check(page)
    else:
        _check_sum(page.data, page.meta.key)


def _parse_header(buf: bytes | bytearray | memoryview, expected_key: bytes | None
                  ) -> tuple[memoryview, tuple]:
    view = memoryview(buf).cast("B")
    if len(view) < HEADER_BYTES:
        raise CorruptPage(f"page truncated: {len(view)} bytes, header needs {HEADER_BYTES}")
    fields = _HEADER.unpack_from(view)
    magic, version, key, meta_len = fields[0], fields[1], fields[5], fields[7]
    if magic != PAGE_MAGIC:
        raise CorruptPage(f"bad page magic {bytes(magic)!r}, expected {PAGE_MAGIC!r}")
    if version != PAGE_VERSION:
        raise CorruptPage(f"unsupported page version {version}, this build reads {PAGE_VERSION}")
    if meta_len > MAX_META_BYTES:
        raise CorruptPage(f"page meta length {meta_len} exceeds {MAX_META_BYTES}")
    end = _page_end(fields)
    if len(view) < end:
        raise CorruptPage(f"page truncated: {len(view)} bytes, header says {end}")
    if expected_key is not None and key != expected_key:
        raise CorruptPage(f"page holds key {key.hex()}, expected {bytes(expected_key).hex()}")
    return view, fields


def _page_end(fields: tuple) -> int:
    return HEADER_BYTES + fields[7] + fields[8]  # header + meta_len + payload_len


def _check_sum(data: memoryview, key: bytes) -> None:
    """xxh3 over the header (checksum field zero), meta and payload against the stored sum."""
    (checksum,) = _CHECKSUM.unpack_from(data, _CHECKSUM_OFFSET)
    h = xxhash.xxh3_64()
    h.update(data[:_CHECKSUM_OFFSET])
    h.update(_ZERO_CHECKSUM)
    h.update(data[HEADER_BYTES:])
    if h.intdigest() != checksum:
        raise CorruptPage(f"page checksum mismatch for key {bytes(key).hex()}")


def _make_page(view: memoryview, fields: tuple, seal: Seal | None = None) -> Page:
    (_, _, codec_id, block_index, namespace, key, parent, meta_len, _, _) = fields
    end = _page_end(fields)
    try:
        info = json.loads(bytes(view[HEADER_BYTES : HEADER_BYTES + meta_len]))
        meta = PageMeta(
            key=BlockKey(key),
            namespace=namespace,
            parent=None if parent == NO_PARENT else BlockKey(parent),
            block_index=block_index,
            tenant=info["tenant"],
            model_id=info["model"],
            codec=info["codec"],
            codec_id=codec_id,
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptPage(f"page meta unreadable for key {key.hex()}: {exc}") from None
    return Page(meta=meta, payload=view[HEADER_BYTES + meta_len : end], data=view[:end],
                seal=seal)
