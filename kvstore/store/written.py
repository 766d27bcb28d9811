"""The commit's check and seal of a page a writer put into a reserved slot (``WrittenPage``)."""

from __future__ import annotations

import math
import struct

import numpy as np
import torch

from kvstore.codecs.base import bits_all_finite, blob_header, is_all_finite
from kvstore.codecs.raw import RawCodec
from kvstore.errors import CodecError, CorruptPage, InvalidArgument, shown
from kvstore.keys import Namespace
from kvstore.page import PageMeta, PageSeal, parse_page
from kvstore.store.held import ReservedSlot

# What decoding a garbage payload can raise: CodecError (a ValueError) for what the codecs
# check, the rest from torch and struct on what they do not.
_DECODE_FAILURES = (ValueError, RuntimeError, TypeError, IndexError, OverflowError, MemoryError,
                    struct.error)


class WrittenPage:
    """The commit's check of the page a writer put into its slot for ``reserved``, made on
    the tier's copy of it as the copy lands (``PageCheck``: no client can write the copy), and
    the seal of that copy: every checksum computed there (``PageSeal``), whatever the writer
    left in its slot's.

    Checks the length, header, key, parent, namespace, position, tenant, model and codec name,
    and requires every value of the payload, decoded under the reservation's codec into the
    namespace's shape and dtype, to be finite (a lossy tier's encoder refuses NaN and Inf, so
    such a page could never be demoted): a raw page's K/V on its bits, piece by piece as they
    land, any other decoded at the end. CorruptPage or InvalidArgument names the block.
    Blocking: the tier runs it in a thread.
    """

    __slots__ = ("_checked", "_ns", "_reserved", "_seal", "_section")

    def __init__(self, ns: Namespace, reserved: ReservedSlot) -> None:
        self._ns = ns
        self._reserved = reserved
        self._seal = PageSeal(reserved.key)
        # A raw page's K/V bits (start, end in the page), once its blob header is in; None
        # before, () for a page of another codec (decoded and checked at the end).
        self._section: tuple[int, int] | tuple[()] | None = None
        self._checked = 0

    def feed(self, view: memoryview, copied: int) -> None:
        self._seal.feed(view, copied)
        if self._seal.fields is None:
            return
        if self._section is None:
            self._section = self._raw_section(view, copied)
            if self._section is None:
                return
        if not self._section:
            return
        start, end = self._section
        itemsize = self._ns.spec.torch_dtype.itemsize
        upto = min(copied, end)
        upto -= (upto - start) % itemsize
        if upto > self._checked and self._ns.spec.dtype == "uint8":  # bytes: nothing to check
            self._checked = upto
        if upto > self._checked:
            bits = np.frombuffer(view[self._checked : upto], dtype=f"u{itemsize}")
            if not bits_all_finite(bits, self._ns.spec.torch_dtype):
                raise CorruptPage(f"page for key {self._reserved.key.hex()} decodes to NaN or "
                                  "Inf values")
            self._checked = upto

    def _raw_section(self, view: memoryview, copied: int) -> tuple[int, int] | tuple[()] | None:
        """Where a raw page's K/V lies, once its blob header is copied (None before)."""
        if not isinstance(self._reserved.link.codec, RawCodec):
            return ()
        payload = self._seal.payload_start
        try:
            head = blob_header(view[payload : max(payload, copied)])
        except CodecError as exc:
            raise self._undecodable(exc) from None
        if head is None:
            return None
        codec_id = self._seal.fields[2]  # type: ignore[index]
        if codec_id != RawCodec.codec_id:  # what the page says it is: not what was asked for
            raise InvalidArgument(f"page for key {self._reserved.key.hex()} is encoded with "
                                  f"codec id {codec_id}; the reservation asked for "
                                  f"{self._reserved.link.codec.name!r}")
        spec = self._ns.spec
        shape = spec.shape(spec.block_tokens)
        expected = math.prod(shape) * spec.torch_dtype.itemsize
        if (head.codec_id != RawCodec.codec_id or head.dtype != spec.torch_dtype
                or head.shape != shape or head.section_bytes != (expected,)):
            raise self._undecodable(CodecError(
                f"blob holds codec id {head.codec_id}, {head.shape} {head.dtype} in "
                f"sections of {head.section_bytes} bytes"))
        if payload + head.nbytes != len(view):
            raise self._undecodable(CodecError(
                f"blob of {head.nbytes} bytes in a {len(view) - payload}-byte payload"))
        start = payload + head.header_bytes
        self._checked = start
        return start, start + expected

    def finish(self, out: memoryview) -> PageMeta:
        self._seal.seal(out)
        key, ns, reserved = self._reserved.key, self._ns, self._reserved
        page = parse_page(out.toreadonly(), expected_key=key, is_trusted=True)
        meta = page.meta
        if (meta.namespace != ns.fingerprint or meta.block_index != reserved.block_index
                or meta.parent != reserved.parent):
            raise CorruptPage(f"page for key {key.hex()} names another namespace, position or "
                              "parent")
        if meta.tenant != ns.tenant or meta.model_id != ns.model_id:
            raise CorruptPage(f"page for key {key.hex()} names tenant/model "
                              f"{shown(meta.tenant)}/{shown(meta.model_id)}, reserved for "
                              f"{ns.tenant}/{ns.model_id}")
        codec = reserved.link.codec
        if meta.codec != codec.name:
            raise InvalidArgument(f"page for key {key.hex()} is encoded with "
                                  f"{shown(meta.codec)}; the reservation asked for "
                                  f"{codec.name!r}")
        if self._section == ():
            spec = ns.spec
            try:
                decoded = codec.decode(page.payload, out=torch.empty(
                    spec.shape(spec.block_tokens), dtype=spec.torch_dtype), verify=False)
            except _DECODE_FAILURES as exc:  # a garbage payload is refused, whatever it breaks
                raise self._undecodable(exc) from None
            if not is_all_finite(decoded):
                raise CorruptPage(f"page for key {key.hex()} decodes to NaN or Inf values")
        elif self._section is None or self._checked != self._section[1]:
            raise self._undecodable(CodecError("its blob ends inside its header"))
        return meta

    def _undecodable(self, exc: BaseException) -> CorruptPage:
        spec = self._ns.spec
        return CorruptPage(f"page for key {self._reserved.key.hex()} does not decode as "
                           f"{self._reserved.link.codec.name} K/V of shape "
                           f"{tuple(spec.shape(spec.block_tokens))} {spec.dtype}: {exc}")
