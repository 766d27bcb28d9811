"""The self-describing stored page: a fixed header, a small JSON meta section and the payload.

Layout (little-endian)::

    magic "KVPG" | version u16 | codec_id u16 | block_index u32 | namespace fingerprint 16B |
    key 16B | parent key 16B (zeros for a first block) | meta_len u32 | payload_len u64 |
    checksum u64 | meta (JSON: tenant, model, codec chain) | payload (codec blob)

The checksum is xxh3-64 over the header (with the checksum field zero), meta and payload
(version 1). Version 2 (what ``write_page(aligned=True)`` frames a codec blob as) hashes the
payload once: the page checksum covers the header, the meta and the blob's own trailing
checksum, which covers every other byte of the blob, so a reader checks both and a writer
feeds each payload byte to one hash instead of two. Its meta may be padded with trailing
spaces (JSON ignores them) so the blob's first section lands on a ``SECTION_ALIGN_BYTES``
boundary. Readers take both versions.
Any reader can verify and decode a page without outside state. The checksum catches damage, not
forgery: whoever can write a page can recompute it. So the DRAM tier never serves a page from
memory a client can write: it keeps stored pages in published memory, memfds sealed against
every writer but the daemon's own mapping (``F_SEAL_FUTURE_WRITE``), each a region that starts
with a header page (``PUBLISHED_MAGIC``, and a state the daemon sets to retired before it gives
the region back, so a client drops its mapping). A page the daemon verified when it published it
there is returned *trusted* (``Page.is_trusted``): nobody can change it afterwards, so
``verify_page`` does not hash it again.
"""

from __future__ import annotations

import functools
import json
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

import xxhash

from kvstore.errors import CapacityError, CorruptPage
from kvstore.keys import NO_PARENT, BlockKey

if TYPE_CHECKING:
    from kvstore.codecs.base import Codec, Payload
    from kvstore.keys import Namespace

PAGE_MAGIC = b"KVPG"
PAGE_VERSION = 1  # the page checksum hashes the whole payload
PAGE_VERSION_BLOB_SUM = 2  # the page checksum covers the blob's own checksum (module docstring)
PAGE_VERSIONS = (PAGE_VERSION, PAGE_VERSION_BLOB_SUM)
_BLOB_SUM_BYTES = 8  # a codec blob ends with its xxh3-64 over everything before it
_HEADER = struct.Struct("<4sHHI16s16s16sIQQ")
HEADER_BYTES = _HEADER.size
# Where header fields sit, for readers that check many headers at once (client/staging.py):
KEY_SLICE = slice(28, 44)  # magic 4 + version 2 + codec_id 2 + block_index 4 + namespace 16
META_LEN_SLICE = slice(60, 64)  # ... + key 16 + parent 16
_CHECKSUM_OFFSET = HEADER_BYTES - 8
_CHECKSUM = struct.Struct("<Q")
_ZERO_CHECKSUM = bytes(_CHECKSUM.size)
MAX_META_BYTES = 64 * 1024
# Where an aligned page puts its payload's first section (from the page's start; slots start
# on 4 KiB boundaries). numpy reduces 2-byte-aligned bf16 bits with SIMD and misaligned ones
# without: a commit's NaN/Inf check of a 2 MiB raw page took 0.09 ms aligned against 0.14-0.20
# ms at the odd offset an unpadded page's section starts at (2-core box, 2026-12-01).
SECTION_ALIGN_BYTES = 64
# Published memory (see the module docstring): each region's first page is its header.
PUBLISHED_HEADER_BYTES = 4096
PUBLISHED_MAGIC = b"KVPUB\x00\x00\x01"
PUBLISHED_STATE_OFFSET = len(PUBLISHED_MAGIC)  # one byte: live or retired
PUBLISHED_LIVE = 0
PUBLISHED_RETIRED = 1
# The memfd seal that makes memory published (Linux 5.1+; Python 3.11's fcntl does not name it).
F_SEAL_FUTURE_WRITE = 0x0010


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

    @classmethod
    def for_block(cls, ns: Namespace, key: BlockKey, parent: BlockKey | None, block_index: int,
                  codec: Codec) -> PageMeta:
        """The meta of block ``block_index`` of a prefix in ``ns``, encoded with ``codec``."""
        return cls(key, ns.fingerprint, parent, block_index, ns.tenant, ns.model_id, codec.name,
                   codec.codec_id)


@dataclass(frozen=True, slots=True)
class Page:
    """A parsed page: its meta, a view of its payload and a view of the whole encoded page.

    ``decode_page`` returns it verified; ``parse_page`` (and a tier's ``read(key, verify=False)``)
    leaves the check to ``verify_page``, which must accept it before any of it is used. A page
    ``is_trusted`` when it lies in published memory: the daemon verified it when it put it
    there and nobody can change it since, so ``verify_page`` accepts it without hashing.
    """

    meta: PageMeta
    payload: memoryview
    data: memoryview  # header + meta + payload, e.g. to copy the page to another tier as is
    is_trusted: bool = False


def is_published(buf: bytes | bytearray | memoryview) -> bool:
    """Whether ``buf`` starts with the header page of a region of published memory."""
    view = memoryview(buf)
    return len(view) >= PUBLISHED_HEADER_BYTES and bytes(view[:PUBLISHED_STATE_OFFSET]) == \
        PUBLISHED_MAGIC


def is_retired(buf: bytes | bytearray | memoryview) -> bool:
    """Whether the region of published memory ``buf`` maps was given back by the daemon (its
    header says so): a client drops its mapping, or it keeps the memory alive."""
    return is_published(buf) and memoryview(buf)[PUBLISHED_STATE_OFFSET] == PUBLISHED_RETIRED


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


def write_page(out: memoryview | bytearray, meta: PageMeta, payload: Payload,
               aligned: bool = False, sums: bool = True) -> int:
    """Write the page of an encoded ``payload`` straight into the front of ``out`` (a slot, a
    reused write buffer); return the page's length.

    The same bytes as ``encode_page(meta, payload.to_bytes())``, in one pass: the header and
    meta go in front, the codec writes its blob behind them, and the page checksum is fed the
    blob piece by piece as it is written, then patched into the header. ``aligned`` (a codec
    blob not framed yet, a ``BlobPlan``; others are written as without it): a version 2 page,
    the payload hashed once, its meta padded so the blob's first section starts
    ``SECTION_ALIGN_BYTES``-aligned (size it with ``page_bytes(payload, meta)``).
    ``sums=False`` (an aligned page into a slot whose commit seals it, ``PageSeal``): no
    hashing at all, both checksums left zero.
    CapacityError, with nothing written, if ``out`` is too small.
    """
    blob_sum = aligned and _is_blob_plan(payload)
    meta_bytes = _aligned_meta(meta, payload) if blob_sum else _meta_bytes(meta)
    start = HEADER_BYTES + len(meta_bytes)
    total = start + payload.nbytes
    view = memoryview(out).cast("B")
    if view.nbytes < total:
        raise CapacityError(f"page of {total} bytes for key {bytes(meta.key).hex()} does not "
                            f"fit its {view.nbytes}-byte buffer")
    version = PAGE_VERSION_BLOB_SUM if blob_sum else PAGE_VERSION
    header = _header(meta, len(meta_bytes), payload.nbytes, version)
    h = xxhash.xxh3_64()
    h.update(header)
    h.update(meta_bytes)
    view[:HEADER_BYTES] = header
    view[HEADER_BYTES:start] = meta_bytes
    if blob_sum and not sums:
        payload.write_into(view[start:total], own_sum=False)  # type: ignore[call-arg]
        return total
    if blob_sum:  # the blob hashes itself; the page hash takes its sum
        payload.write_into(view[start:total])
        h.update(view[total - _BLOB_SUM_BYTES : total])
    else:
        payload.write_into(view[start:total], (h,))
    _CHECKSUM.pack_into(view, _CHECKSUM_OFFSET, h.intdigest())
    return total


class PageSeal:
    """A page's checksums, computed on a copy of it as the copy lands (a commit seals what a
    writer put into its slot this way: the checksums the writer left, if any, are ignored).

    ``feed(view, copied)``: the first ``copied`` bytes of ``view`` (the copy, exactly the
    page's length) are final; bytes not fed before go to the hashes while they are still in
    cache. The header is parsed once it is in: CorruptPage if it is damaged, names another
    key, or describes a page of another length than ``view``. ``seal(out)``, once all of it is
    fed: the blob's own checksum (a version 2 page) and the page checksum written into
    ``out``, the same memory as ``view`` and writable.
    """

    __slots__ = ("_hash", "_hash_end", "_hashed", "_key", "fields", "payload_start")

    def __init__(self, expected_key: bytes) -> None:
        self._key = expected_key
        self.fields: tuple | None = None  # the header's, once parsed
        self.payload_start = 0
        self._hashed = self._hash_end = 0
        self._hash = xxhash.xxh3_64()

    def feed(self, view: memoryview, copied: int) -> None:
        if self.fields is None:
            if copied < HEADER_BYTES:
                return
            self._start(view)
        end = min(copied, self._hash_end)
        if end > self._hashed:
            self._hash.update(view[self._hashed : end])
            self._hashed = end

    def _start(self, view: memoryview) -> None:
        view, fields = _parse_header(view, self._key)
        end = _page_end(fields)
        if end != len(view):  # the writer's header sized the copy; the copy's must agree
            raise CorruptPage(f"page for key {bytes(self._key).hex()} is {end} bytes; "
                              f"{len(view)} were copied")
        self.payload_start = HEADER_BYTES + fields[7]
        if fields[1] == PAGE_VERSION_BLOB_SUM:
            if fields[8] < _BLOB_SUM_BYTES:
                raise CorruptPage(f"page for key {bytes(self._key).hex()} holds a "
                                  f"{fields[8]}-byte payload, too short for a blob")
            self._hashed, self._hash_end = self.payload_start, end - _BLOB_SUM_BYTES
        else:  # version 1: one hash over the header (checksum zero), meta and payload
            self._hash.update(view[:_CHECKSUM_OFFSET])
            self._hash.update(_ZERO_CHECKSUM)
            self._hashed, self._hash_end = HEADER_BYTES, end
        self.fields = fields

    def seal(self, out: memoryview) -> None:
        fields = self.fields
        if fields is None or self._hashed != self._hash_end:
            raise CorruptPage(f"page for key {bytes(self._key).hex()} sealed before all of it "
                              "was copied")
        out = memoryview(out).cast("B")
        if fields[1] != PAGE_VERSION_BLOB_SUM:
            _CHECKSUM.pack_into(out, _CHECKSUM_OFFSET, self._hash.intdigest())
            return
        blob_end = self._hash_end
        _CHECKSUM.pack_into(out, blob_end, self._hash.intdigest())
        h = xxhash.xxh3_64()
        h.update(out[:_CHECKSUM_OFFSET])
        h.update(_ZERO_CHECKSUM)
        h.update(out[HEADER_BYTES : self.payload_start])
        h.update(out[blob_end : blob_end + _BLOB_SUM_BYTES])
        _CHECKSUM.pack_into(out, _CHECKSUM_OFFSET, h.intdigest())


class PendingPage:
    """A page not framed yet: its meta and its codec payload, written where it will live.

    ``write_into`` frames it straight into a tier's own memory (``write_page``, by default
    ``aligned``: the payload copied, or quantised, and hashed once, in one pass, and no
    finished page to copy again); ``finished`` frames it once into a buffer of its own, for a tier that takes only
    finished pages. The payload may be a view of the caller's K/V: a pending page lives only
    while the put that made it runs.
    """

    __slots__ = ("_finished", "aligned", "meta", "nbytes", "payload")

    def __init__(self, meta: PageMeta, payload: Payload, aligned: bool = True) -> None:
        self.meta = meta
        self.payload = payload
        self.aligned = aligned  # ``write_page``'s: a version 2 page (else 1, unpadded)
        self.nbytes = page_bytes(payload if aligned else payload.nbytes, meta)
        self._finished: memoryview | None = None

    def __len__(self) -> int:
        return self.nbytes

    def write_into(self, out: memoryview) -> None:
        """Frame the page at the front of ``out`` (at least ``nbytes`` long)."""
        written = write_page(out, self.meta, self.payload, aligned=self.aligned)
        if written != self.nbytes:  # a payload that changed size since it was measured
            raise CapacityError(f"page of key {bytes(self.meta.key).hex()} came out {written} "
                                f"bytes, not the {self.nbytes} it was sized as")

    def finished(self) -> memoryview:
        """The framed page in a buffer of its own (framed on the first call)."""
        if self._finished is None:
            buf = memoryview(bytearray(self.nbytes))
            self.write_into(buf)
            self._finished = buf
        return self._finished


def finished_page(page: bytes | memoryview | PendingPage) -> bytes | memoryview:
    """``page`` as bytes: a pending page framed into a buffer of its own, others as they are."""
    return page.finished() if isinstance(page, PendingPage) else page


def _is_blob_plan(payload: Payload) -> bool:
    from kvstore.codecs.base import BlobPlan  # codecs import page's neighbours, not page

    return isinstance(payload, BlobPlan)


def _meta_bytes(meta: PageMeta) -> bytes:
    return _meta_json(meta.tenant, meta.model_id, meta.codec)


def _aligned_meta(meta: PageMeta, payload: Payload) -> bytes:
    """The meta, padded with spaces so that ``payload``'s (a ``BlobPlan``'s) first section
    starts on a ``SECTION_ALIGN_BYTES`` boundary of the page."""
    meta_bytes = _meta_bytes(meta)
    lead = HEADER_BYTES + len(meta_bytes) + len(payload.header)  # type: ignore[attr-defined]
    return meta_bytes + b" " * (-lead % SECTION_ALIGN_BYTES)


@functools.lru_cache(maxsize=1024)
def _meta_json(tenant: str, model_id: str, codec: str) -> bytes:
    # The same few (tenant, model, codec) triples on every page: json.dumps cost about 30 us a
    # page, a tenth of writing a 2 MiB raw page.
    return json.dumps({"tenant": tenant, "model": model_id, "codec": codec},
                      separators=(",", ":")).encode()


def _header(meta: PageMeta, meta_len: int, payload_len: int, version: int = PAGE_VERSION
            ) -> bytes:
    """The fixed header with a zero checksum (the checksum is computed over it so)."""
    return _HEADER.pack(PAGE_MAGIC, version, meta.codec_id, meta.block_index,
                        meta.namespace, meta.key, meta.parent or NO_PARENT, meta_len,
                        payload_len, 0)


def page_bytes(payload: int | Payload, meta: PageMeta) -> int:
    """Size of the encoded page (header + meta + payload) for sizing slots: of an unpadded
    page given the payload's length, of an aligned one (``write_page(aligned=True)``) given
    the payload."""
    if isinstance(payload, int):
        return HEADER_BYTES + len(_meta_bytes(meta)) + payload
    if not _is_blob_plan(payload):
        return HEADER_BYTES + len(_meta_bytes(meta)) + payload.nbytes
    return HEADER_BYTES + len(_aligned_meta(meta, payload)) + payload.nbytes


def page_length(buf: bytes | bytearray | memoryview) -> int:
    """Total length of the page that starts at ``buf`` (from its header alone)."""
    view = memoryview(buf)
    if len(view) < HEADER_BYTES:
        raise CorruptPage(f"page truncated: {len(view)} bytes, header needs {HEADER_BYTES}")
    fields = _HEADER.unpack_from(view)
    if fields[0] != PAGE_MAGIC:
        raise CorruptPage(f"bad page magic {bytes(fields[0])!r}")
    return HEADER_BYTES + fields[7] + fields[8]


def decode_page(buf: bytes | bytearray | memoryview, expected_key: bytes | None = None
                ) -> Page:
    """Verify and parse a page; raise CorruptPage naming the first fault found. The returned
    payload is a view into ``buf`` (no copy)."""
    page = parse_page(buf, expected_key)
    verify_page(page)
    return page


def parse_page(buf: bytes | bytearray | memoryview, expected_key: bytes | None = None,
               is_trusted: bool = False) -> Page:
    """Parse a page without checking its checksum; CorruptPage if the header or meta is
    damaged.

    Cheap (no pass over the payload). Nothing in the returned page may be trusted, or leave
    the reader, before ``verify_page`` accepted it. ``is_trusted`` is for pages in published
    memory only (the module docstring): ``verify_page`` then accepts the page as it is.
    """
    return _make_page(*_parse_header(buf, expected_key), is_trusted)


def trusted_payload(buf: bytes | bytearray | memoryview, expected_key: bytes) -> memoryview:
    """The payload of the page of ``expected_key`` at ``buf`` in published memory (trusted:
    the module docstring), from its header alone: magic, version, key and lengths checked,
    the meta left unparsed (a reader that needs it calls ``parse_page``). CorruptPage names
    what is wrong."""
    view, fields = _parse_header(buf, expected_key)
    return view[HEADER_BYTES + fields[7] : _page_end(fields)]


def verify_page(page: Page) -> None:
    """Check a parsed page's checksum (one xxh3 pass) unless it is trusted; CorruptPage if it
    fails.

    Releases the GIL while hashing, so worker threads verify side by side. Hashing leaves the
    page in the CPU caches: copying its payload right after, on the same thread, costs about
    what the copy alone costs.
    """
    if not page.is_trusted:
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
    if version not in PAGE_VERSIONS:
        raise CorruptPage(f"unsupported page version {version}, this build reads "
                          f"{' and '.join(map(str, PAGE_VERSIONS))}")
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
    """xxh3 over the header (checksum field zero), meta and payload against the stored sum;
    for a version 2 page over the header, meta and the blob's sum, and the blob's sum over the
    rest of the blob."""
    (checksum,) = _CHECKSUM.unpack_from(data, _CHECKSUM_OFFSET)
    fields = _HEADER.unpack_from(data)
    h = xxhash.xxh3_64()
    h.update(data[:_CHECKSUM_OFFSET])
    h.update(_ZERO_CHECKSUM)
    if fields[1] != PAGE_VERSION_BLOB_SUM:
        h.update(data[HEADER_BYTES:])
        if h.intdigest() != checksum:
            raise CorruptPage(f"page checksum mismatch for key {bytes(key).hex()}")
        return
    payload_start = HEADER_BYTES + fields[7]
    if fields[8] < _BLOB_SUM_BYTES:
        raise CorruptPage(f"page for key {bytes(key).hex()} holds a {fields[8]}-byte payload, "
                          "too short for a blob")
    blob_end = len(data) - _BLOB_SUM_BYTES
    (blob_sum,) = _CHECKSUM.unpack_from(data, blob_end)
    h.update(data[HEADER_BYTES:payload_start])
    h.update(data[blob_end:])
    if h.intdigest() != checksum:
        raise CorruptPage(f"page checksum mismatch for key {bytes(key).hex()}")
    if xxhash.xxh3_64_intdigest(data[payload_start:blob_end]) != blob_sum:
        raise CorruptPage(f"page payload checksum mismatch for key {bytes(key).hex()}")


def _make_page(view: memoryview, fields: tuple, is_trusted: bool = False) -> Page:
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
                is_trusted=is_trusted)
