"""fp8 engine caches: the dtype names engines use, and their per-tensor scales bound into the
namespace so pages written under other scales are never read as this cache's.

An fp8 cache's pages are its bytes (a uint8 ``KVSpec``; ``kvstore.codecs.triton.passthrough``
moves them). What those bytes mean depends on two things the bytes do not say: the fp8 flavour
(e4m3 or e5m2: vLLM keeps both in uint8 tensors) and the scales the engine multiplies them by
(vLLM's ``layer._k_scale`` / ``_v_scale``, one float per layer and K/V). Both go into the
namespace fingerprint (``Fp8Cache.salt`` in ``extra_salt``), not into a scale part of each
page:

- a cache with other scales (another checkpoint, another calibration) keys other blocks, so a
  lookup never reports them as a hit; with a scale part per page the lookup would promise
  tokens that the load must then refuse (a device-side compare and a host sync before the
  engine may read the layer) or re-quantise (lossy);
- the pages stay the engine's bytes exactly, so loads and saves are plain byte copies;
- per-tensor scales are fixed for a cache's lifetime, so the namespace is built once.

Per-head or per-token scales live beside the values in the engine's memory and would be parts
of the page (``kvstore.groups`` "head"/"token" scales); this module covers per-tensor scales.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvstore.errors import InvalidArgument, shown
from kvstore.keys import Namespace
from kvstore.spec import KVSpec

# vLLM's cache_dtype names (its CacheDType) and the float8 flavour each stores.
FP8_CACHE_DTYPES: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
MAX_SCALES = 1 << 16  # two per layer of the deepest model, with room to spare
_SALT_TAG = "fp8"
_GROUP_SALT = "group/"  # how keys.Namespace.group salts a group's namespace


@dataclass(frozen=True, slots=True)
class Fp8Cache:
    """An fp8 engine cache's flavour and per-tensor scales.

    Args:
        dtype: a key of ``FP8_CACHE_DTYPES`` or a float8 torch dtype.
        scales: every per-tensor scale in layer order (K then V of each layer; an MLA
            latent: one per layer), as the engine applies them; empty: static scales that
            the namespace's model and revision fix (read from the checkpoint, or 1.0), for a
            process that holds no layers (an engine's scheduler) to key alike.
    """

    dtype: str | torch.dtype
    scales: tuple[float, ...]

    def __post_init__(self) -> None:
        name = self.dtype
        if isinstance(name, torch.dtype):
            name = {v: k for k, v in reversed(FP8_CACHE_DTYPES.items())}.get(name, name)
        if name not in FP8_CACHE_DTYPES:
            raise InvalidArgument(f"Fp8Cache.dtype must be one of {sorted(FP8_CACHE_DTYPES)} "
                                  f"(or a float8 torch dtype), got {shown(self.dtype)}")
        object.__setattr__(self, "dtype", name)
        scales = tuple(float(s) for s in self.scales)
        if len(scales) > MAX_SCALES:
            raise InvalidArgument(f"Fp8Cache.scales must hold at most {MAX_SCALES} floats, got "
                                  f"{len(scales)}")
        bad = [s for s in scales if not math.isfinite(s) or s <= 0]
        if bad:
            raise InvalidArgument(f"Fp8Cache.scales must be finite and positive, got {bad[0]}")
        object.__setattr__(self, "scales", scales)

    @property
    def torch_dtype(self) -> torch.dtype:
        return FP8_CACHE_DTYPES[self.dtype]  # type: ignore[index]

    @property
    def salt(self) -> str:
        """What the namespace's ``extra_salt`` carries: the flavour and a digest of the
        scales as float32 (what engines keep; a float64 that rounds alike is the same cache)."""
        flavour = "e5m2" if self.torch_dtype == torch.float8_e5m2 else "e4m3"
        if not self.scales:
            return f"{_SALT_TAG}/{flavour}/static"
        packed = struct.pack(f"<{len(self.scales)}f", *self.scales)
        return f"{_SALT_TAG}/{flavour}/{hashlib.blake2b(packed, digest_size=12).hexdigest()}"

    @classmethod
    def of_layers(cls, dtype: str | torch.dtype, layers: Sequence[object],
                  attrs: Sequence[str] = ("_k_scale_float", "_v_scale_float")) -> Fp8Cache:
        """The scales of engine layer objects (vLLM's attention layers keep them as
        ``_k_scale_float`` and ``_v_scale_float``; an MLA layer: pass ``("_k_scale_float",)``)."""
        scales = []
        for i, layer in enumerate(layers):
            for attr in attrs:
                value = getattr(layer, attr, None)
                if value is None:
                    raise InvalidArgument(f"engine layer {i} has no {attr}: its fp8 scale is "
                                          "unknown")
                scales.append(float(value))
        return cls(dtype, tuple(scales))

    def bind(self, ns: Namespace) -> Namespace:
        """``ns`` for this cache's pages: its spec's dtype uint8 (pages are bytes), the flavour
        and scales in its salt. A grouped namespace's spec is left as it is (its groups name
        their dtypes): bind it, then take its groups, whose keys then carry the salt."""
        spec = ns.spec
        if isinstance(spec, KVSpec) and spec.dtype != "uint8":
            spec = dataclasses.replace(spec, dtype="uint8")
        salt = f"{ns.extra_salt}/{self.salt}" if ns.extra_salt else self.salt
        return dataclasses.replace(ns, spec=spec, extra_salt=salt)

    def check(self, ns: Namespace) -> None:
        """InvalidArgument unless ``ns`` carries this cache's flavour and scales. A group's
        namespace (``Namespace.group``) passes: its salt is a hash of its parent's whole
        namespace, which is where ``bind`` puts them (so a ``GroupCache`` of the bound parent
        reads the same pages); that it was bound is the caller's to keep."""
        if ns.extra_salt.startswith(_GROUP_SALT):
            return
        if not ns.extra_salt.endswith(self.salt):
            raise InvalidArgument(f"namespace {ns.model_id!r} does not carry this fp8 cache's "
                                  f"dtype and scales ({self.salt}); build it with "
                                  "Fp8Cache.bind, so pages of other scales are never read")


def check_fp8(layout, ns: Namespace, fp8: Fp8Cache | None) -> Fp8Cache | None:
    """``fp8`` after checking it against an ``EngineLayout`` and its namespace: a one-byte
    cache needs one (and a float8 tensor's flavour must be its), a wider cache none."""
    if not layout.is_bytes:
        if fp8 is not None:
            raise InvalidArgument(f"fp8= is for fp8 engine caches; this one is {layout.dtype}")
        return None
    if fp8 is None:
        raise InvalidArgument(f"an engine cache of {layout.dtype} holds fp8 bytes: pass fp8="
                              "Fp8Cache(dtype, scales), so its pages are keyed by its scales")
    if layout.dtype != torch.uint8 and layout.dtype != fp8.torch_dtype:
        raise InvalidArgument(f"engine cache is {layout.dtype}, fp8= says {fp8.dtype}")
    fp8.check(ns)
    return fp8
