"""Codecs for stored pages: ``get(name)`` for a chain such as ``fp8_e4m3+zstd``, ``decode(blob)``
for any blob. Lossy codecs register themselves in ``_REGISTRY`` by name and id."""

from __future__ import annotations

import importlib

import torch

from kvstore.codecs.base import BLOB_MAGIC, Codec
from kvstore.codecs.raw import RawCodec
from kvstore.codecs.zstd import ZSTD_MAGIC, ZstdStage, bound_for, decompress
from kvstore.errors import CodecError

# name -> "module:Class"; imported lazily so a missing optional dependency only hurts its codec.
_CODEC_CLASSES: dict[str, str] = {
    "raw": "kvstore.codecs.raw:RawCodec",
    "fp8_e4m3": "kvstore.codecs.fp8:Fp8E4M3Codec",
    "nvfp4": "kvstore.codecs.fp4:NvFp4Codec",
    "mxfp4": "kvstore.codecs.fp4:MxFp4Codec",
    "int4": "kvstore.codecs.kivi:Int4Codec",
    "int2": "kvstore.codecs.kivi:Int2Codec",
}
_CODEC_IDS: dict[int, str] = {1: "raw", 2: "fp8_e4m3", 3: "nvfp4", 4: "mxfp4", 5: "int4", 6: "int2"}


def names() -> list[str]:
    """Base codec names that can start a chain."""
    return list(_CODEC_CLASSES)


def _base(name: str) -> Codec:
    target = _CODEC_CLASSES.get(name)
    if target is None:
        raise CodecError(f"unknown codec {name!r}; known: {names()} (optionally '+zstd')")
    module, _, cls = target.partition(":")
    try:
        return getattr(importlib.import_module(module), cls)()
    except (ImportError, AttributeError) as exc:
        raise CodecError(f"codec {name!r} is not available in this build: {exc}") from None


def get(name: str) -> Codec:
    """A codec chain by name: ``raw``, ``fp8_e4m3``, ``int4+zstd``, ``zstd`` (= ``raw+zstd``)."""
    if not isinstance(name, str) or not name:
        raise CodecError(f"codec name must be a non-empty string, got {name!r}")
    stages = name.split("+")
    if stages[0] == "zstd":
        stages.insert(0, "raw")
    codec = _base(stages[0])
    for stage in stages[1:]:
        level = 3
        if stage.startswith("zstd"):
            suffix = stage[4:]
            if suffix:
                if not suffix.startswith(":") or not suffix[1:].lstrip("-").isdigit():
                    raise CodecError(f"bad zstd stage {stage!r}; use zstd or zstd:LEVEL")
                level = int(suffix[1:])
            codec = ZstdStage(codec, level=level)
        else:
            raise CodecError(f"codec {stage!r} cannot follow {codec.name!r}: only zstd can")
    return codec


def decode(blob: bytes | bytearray | memoryview, out: torch.Tensor | None = None,
           verify: bool = True) -> torch.Tensor:
    """Decode the blob of any codec or chain (``verify=False``: see ``Codec.decode``)."""
    view = memoryview(blob).cast("B")
    magic = bytes(view[:4])
    if magic == ZSTD_MAGIC:
        return decode(decompress(view, bound_for(out)), out, verify)
    if magic != BLOB_MAGIC:
        raise CodecError(f"not a kvstore blob (magic {magic!r})")
    if len(view) < 6:
        raise CodecError(f"blob truncated: {len(view)} bytes")
    codec_id = view[5]  # the codec's own decode verifies the checksum
    name = _CODEC_IDS.get(codec_id)
    if name is None:
        raise CodecError(f"blob names unknown codec id {codec_id}")
    return _base(name).decode(view, out, verify)


__all__ = ["Codec", "RawCodec", "ZstdStage", "decode", "get", "names"]
