"""A cache made of groups: each group's kind, per-layer geometry and dtypes, and how one block of
it is laid out in a stored page.

Format (the contract every integration writes to):

- A model's cache is an ordered list of ``CacheGroup``s in a ``CacheSpec`` (with the block size
  and position scheme all groups share). A group has a kind, a layer count, and parts: named
  tensors per layer, each with a per-unit shape and a dtype. The unit is a token for
  ``attention`` (parts ``k`` and ``v``; K and V head dims may differ), ``latent`` (one vector
  per token, possibly in parts of different dtypes) and ``window`` (attention of
  ``window_tokens``); for ``state`` it is the sequence (a fixed-size recurrent state,
  snapshotted at block boundaries). A part with ``per_block`` set has no token dim: one value
  per layer and block (an fp8 cache's per-tensor or per-head scales). Layers that differ
  (a hybrid's layer types, head dims that vary per layer) are separate groups, never padding.
- The namespace fingerprints the whole list (``Namespace.to_dict``); a ``KVSpec`` is a
  one-group attention cache and keeps its own fingerprint and page bytes exactly.
- Each group is stored under a namespace of its own (``Namespace.group``), so keys carry the
  group; a replicated group (``is_replicated``: the same on every tensor-parallel rank, as an
  MLA latent is) is keyed without the rank or the TP size, so a TP group stores one copy that
  every rank loads, and instances of other TP sizes share it.
- A page holds one block of one group, in the canonical ``[L, 2, T, H, D]`` layout of the
  group's storage ``KVSpec`` (``CacheGroup.storage_spec``): a plain attention group (K and V
  alike, one float dtype) is exactly that layout; other groups whose parts share one float
  dtype store each token's row (the parts' elements, concatenated) split in two halves
  (``H = 1``, ``D = row / 2``), so lossy codecs apply to them too; everything else (fp8 engine
  caches with their scales, mixed dtypes, states) is stored as bytes (dtype ``uint8``), a
  block's bytes per layer padded to a whole ``[2, T, 1, D]``; lossy codecs refuse those.
- Attention and latent groups are stored as chained prefixes. Window and state groups are not
  prefixes: a window's blocks and a state snapshot are each stored as a one-block prefix of
  their own whose tokens are derived from the group's chain key at that block
  (``keys.snapshot_tokens``), so each names the whole prefix it belongs to and can be stored,
  found and dropped without the blocks before it.
- Lookup (``kvstore.store.groups``) reports the longest n (in blocks) at which every group is
  whole: every attention/latent block below n, the window blocks covering the last
  ``window_tokens`` tokens of n, and the state snapshot at n; a missing snapshot or window
  block falls back to the longest shorter n that is whole.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

from kvstore.errors import InvalidArgument, shown
from kvstore.spec import MAX_BLOCK_TOKENS, MIN_BLOCK_TOKENS, KVSpec

# Engine cache dtypes by name: floats the codecs re-encode, fp8 kept in uint8 by engines.
GROUP_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "uint8": torch.uint8,
    "int32": torch.int32,
}
FLOAT_DTYPES = ("bfloat16", "float16", "float32")  # what lossy codecs may re-encode
_NAMES = {v: k for k, v in GROUP_DTYPES.items()}
MAX_GROUPS = 64
MAX_PARTS = 16
MAX_PART_ELEMENTS = 1 << 28
MAX_HEAD_DIM = 65536  # KVSpec's bound on head_dim


class GroupKind(str, Enum):
    ATTENTION = "attention"  # K and V per layer, every block up to n
    LATENT = "latent"  # one vector per token per layer (MLA), every block up to n
    WINDOW = "window"  # attention of width window_tokens: the blocks of the last W tokens
    STATE = "state"  # a fixed-size recurrent state per sequence: the snapshot at n


TOKEN_KINDS = (GroupKind.ATTENTION, GroupKind.LATENT, GroupKind.WINDOW)


def window_blocks(n: int, window_tokens: int, block_tokens: int) -> range:
    """The blocks a window group needs for a prefix of ``n`` blocks: those holding any of its
    last ``window_tokens`` tokens."""
    first = max(0, n * block_tokens - window_tokens) // block_tokens
    return range(first, n)


def group_dtype(dtype: str | torch.dtype) -> str:
    """The name of a group dtype; InvalidArgument if it is none."""
    name = _NAMES.get(dtype) if isinstance(dtype, torch.dtype) else dtype
    if name not in GROUP_DTYPES:
        raise InvalidArgument(f"unsupported cache dtype {shown(dtype)}; expected one of "
                              f"{sorted(GROUP_DTYPES)}")
    return name


def _positive(owner: str, name: str, value: Any, high: int = 1 << 20) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= high:
        raise InvalidArgument(f"{owner}.{name} must be an int in [1, {high}], got {value!r}")


@dataclass(frozen=True, slots=True)
class CachePart:
    """One named tensor of a group, per layer: ``shape`` per token (or per sequence, in a
    state group; per block where ``per_block``) in ``dtype``."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "bfloat16"
    per_block: bool = False  # no token dim: one value per layer and block (fp8 scales)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not 1 <= len(self.name) <= 64:
            raise InvalidArgument(f"CachePart.name must be 1-64 characters, got {self.name!r}")
        shape = tuple(self.shape) if isinstance(self.shape, (list, tuple)) else None
        if shape is None or not 1 <= len(shape) <= 4:
            raise InvalidArgument(f"CachePart {self.name}: shape must be 1-4 ints, got "
                                  f"{self.shape!r}")
        for dim in shape:
            _positive(f"CachePart {self.name}", "shape", dim)
        if math.prod(shape) > MAX_PART_ELEMENTS:
            raise InvalidArgument(f"CachePart {self.name} has over {MAX_PART_ELEMENTS} elements")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "dtype", group_dtype(self.dtype))

    @property
    def torch_dtype(self) -> torch.dtype:
        return GROUP_DTYPES[self.dtype]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.torch_dtype.itemsize

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}
        if self.per_block:
            out["per_block"] = True
        return out


@dataclass(frozen=True, slots=True)
class CacheGroup:
    """One group of a model's cache (the module docstring says what each kind needs)."""

    kind: GroupKind
    num_layers: int
    parts: tuple[CachePart, ...]
    window_tokens: int = 0  # window groups: the attention width in tokens
    is_replicated: bool = False  # the same on every TP rank: keyed without the rank
    name: str = ""  # what the integration calls it (e.g. "sliding", "mamba"); fingerprinted

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "kind", GroupKind(self.kind))
        except ValueError:
            raise InvalidArgument(f"CacheGroup.kind must be one of "
                                  f"{[k.value for k in GroupKind]}, got {shown(self.kind)}") from None
        _positive("CacheGroup", "num_layers", self.num_layers, 65536)
        parts = tuple(self.parts) if isinstance(self.parts, (list, tuple)) else ()
        if not 1 <= len(parts) <= MAX_PARTS or not all(isinstance(p, CachePart) for p in parts):
            raise InvalidArgument(f"CacheGroup needs 1-{MAX_PARTS} CachePart parts")
        if len({p.name for p in parts}) != len(parts):
            raise InvalidArgument("CacheGroup part names must differ")
        object.__setattr__(self, "parts", parts)
        if self.kind is GroupKind.WINDOW:
            _positive("CacheGroup", "window_tokens", self.window_tokens, 1 << 24)
        elif self.window_tokens:
            raise InvalidArgument(f"CacheGroup.window_tokens is for window groups, not "
                                  f"{self.kind.value}")
        if self.kind is GroupKind.STATE and any(p.per_block for p in parts):
            raise InvalidArgument("a state group's parts are per sequence; per_block is for "
                                  "token groups")
        if self.kind in (GroupKind.ATTENTION, GroupKind.WINDOW) and \
                not {"k", "v"} <= {p.name for p in parts}:
            raise InvalidArgument(f"an {self.kind.value} group needs parts 'k' and 'v'")
        if not isinstance(self.name, str) or len(self.name) > 64:
            raise InvalidArgument("CacheGroup.name must be a string of at most 64 characters")

    # ------------------------------------------------------------------ constructors

    @classmethod
    def attention(cls, num_layers: int, num_kv_heads: int, head_dim: int,
                  dtype: str | torch.dtype = "bfloat16", *, v_head_dim: int | None = None,
                  window_tokens: int = 0, scales: str = "", name: str = "",
                  is_replicated: bool = False) -> CacheGroup:
        """K ``[H, head_dim]`` and V ``[H, v_head_dim]`` per token; ``window_tokens`` makes it
        a window group; ``scales`` (fp8 caches): "tensor", "head" or "token" float32 scales
        of K and V kept beside them."""
        parts = [CachePart("k", (num_kv_heads, head_dim), group_dtype(dtype)),
                 CachePart("v", (num_kv_heads, v_head_dim or head_dim), group_dtype(dtype))]
        parts += _scale_parts(scales, num_kv_heads, ("k_scale", "v_scale"))
        kind = GroupKind.WINDOW if window_tokens else GroupKind.ATTENTION
        return cls(kind, num_layers, tuple(parts), window_tokens, is_replicated, name)

    @classmethod
    def latent(cls, num_layers: int, parts: Sequence[tuple[str, int, str | torch.dtype]],
               *, scales: str = "", name: str = "", is_replicated: bool = True) -> CacheGroup:
        """One vector per token per layer in ``(name, elements, dtype)`` parts (DeepSeek:
        ``[("kv", 512, bf16), ("pe", 64, bf16)]``); replicated across TP ranks by default."""
        built = [CachePart(n, (e,), group_dtype(d)) for n, e, d in parts]
        built += _scale_parts(scales, 1, ("scale",))
        return cls(GroupKind.LATENT, num_layers, tuple(built), 0, is_replicated, name)

    @classmethod
    def state(cls, num_layers: int, parts: Mapping[str, tuple[Sequence[int], str | torch.dtype]],
              *, name: str = "", is_replicated: bool = False) -> CacheGroup:
        """A recurrent state per sequence: ``{name: (shape, dtype)}`` per layer (Mamba: conv
        and ssm states; a gated delta net: conv and recurrent states)."""
        built = tuple(CachePart(n, tuple(s), group_dtype(d)) for n, (s, d) in parts.items())
        return cls(GroupKind.STATE, num_layers, built, 0, is_replicated, name)

    # ------------------------------------------------------------------ geometry

    @property
    def is_prefix(self) -> bool:
        """Whether every block up to n is stored as a chained prefix (attention, latent)."""
        return self.kind in (GroupKind.ATTENTION, GroupKind.LATENT)

    @property
    def is_lossless_only(self) -> bool:
        """Whether lossy codecs must leave this group alone: states (an error compounds) and
        anything not bf16/fp16/fp32 (fp8 engine pages, with their scales)."""
        return self.kind is GroupKind.STATE or any(p.dtype not in FLOAT_DTYPES
                                                   for p in self.parts)

    @property
    def is_plain_kv(self) -> bool:
        """Whether this is exactly what a ``KVSpec`` describes: full attention, K and V of one
        shape and one float dtype, nothing beside them."""
        return self.kind is GroupKind.ATTENTION and self._layout() == "kv"

    def _token_parts(self) -> list[CachePart]:
        return [p for p in self.parts if not p.per_block]

    def _layout(self) -> str:
        """"kv" (canonical attention), "rows" (one float dtype, halves of a row) or "bytes"."""
        if self.kind is GroupKind.STATE or any(p.per_block for p in self.parts):
            return "bytes"
        dtypes = {p.dtype for p in self.parts}
        if len(dtypes) != 1 or next(iter(dtypes)) not in FLOAT_DTYPES:
            return "bytes"
        names = [p.name for p in self.parts]
        if names == ["k", "v"] and self.parts[0].shape == self.parts[1].shape \
                and len(self.parts[0].shape) == 2:
            return "kv"
        return "rows" if sum(p.numel for p in self.parts) % 2 == 0 else "bytes"

    def block_bytes_per_layer(self, block_tokens: int) -> int:
        """The group's bytes of one block and one layer, unpadded (a state: one snapshot)."""
        if self.kind is GroupKind.STATE:
            return sum(p.nbytes for p in self.parts)
        return sum(p.nbytes * (1 if p.per_block else block_tokens) for p in self.parts)

    def storage_spec(self, block_tokens: int, position_scheme: str = "rope") -> KVSpec:
        """The ``KVSpec`` of this group's pages (the module docstring's three layouts)."""
        layout = self._layout()
        if layout == "kv":
            k = self.parts[0]
            return KVSpec(self.num_layers, k.shape[0], k.shape[1], block_tokens, k.dtype,
                          position_scheme)
        if layout == "rows":
            row = sum(p.numel for p in self.parts)
            return KVSpec(self.num_layers, 1, row // 2, block_tokens, self.parts[0].dtype,
                          position_scheme)
        # A block's bytes per layer as [2, T, H, D] uint8, D within KVSpec's bound.
        half = -(-self.block_bytes_per_layer(block_tokens) // (2 * block_tokens))
        heads = -(-half // MAX_HEAD_DIM)
        return KVSpec(self.num_layers, heads, -(-half // heads), block_tokens, "uint8",
                      position_scheme)

    # ------------------------------------------------------------------ packing

    def pack(self, parts: Mapping[str, torch.Tensor], block_tokens: int) -> torch.Tensor:
        """The group's tensors as pages' canonical layout (``storage_spec``), every full block.

        ``parts[name]`` is ``[L, T, *shape]`` for a token part (T: the same for all, a
        multiple of ``block_tokens`` is stored; the rest is dropped), ``[L, num_blocks,
        *shape]`` for a ``per_block`` part, ``[L, *shape]`` for a state part (one snapshot:
        the result holds one block)."""
        tensors = self._checked(parts, block_tokens)
        layout = self._layout()
        num_layers = self.num_layers
        if layout == "kv":
            return torch.stack((tensors["k"], tensors["v"]), dim=1).contiguous()
        if layout == "rows":
            rows = torch.cat([tensors[p.name].reshape(num_layers, tensors[p.name].shape[1], -1)
                              for p in self.parts], dim=2)
            t = rows.shape[1]
            return rows.view(num_layers, t, 2, -1).permute(0, 2, 1, 3).unsqueeze(3).contiguous()
        return self._pack_bytes(tensors, block_tokens)

    def _pack_bytes(self, tensors: dict[str, torch.Tensor], block_tokens: int) -> torch.Tensor:
        spec = self.storage_spec(block_tokens)
        num_layers, bt = self.num_layers, block_tokens
        if self.kind is GroupKind.STATE:
            num_blocks = 1
            pieces = [_bytes(tensors[p.name]).reshape(num_layers, 1, -1) for p in self.parts]
        else:
            num_blocks = self._num_tokens(tensors) // bt
            pieces = []
            for p in self.parts:
                t = tensors[p.name][:, :num_blocks] if p.per_block else \
                    tensors[p.name][:, :num_blocks * bt]
                pieces.append(_bytes(t).reshape(num_layers, num_blocks, -1))
        flat = torch.cat(pieces, dim=2)
        h, d = spec.num_kv_heads, spec.head_dim
        padded = torch.zeros(num_layers, num_blocks, 2 * bt * h * d, dtype=torch.uint8)
        padded[:, :, :flat.shape[2]] = flat
        out = padded.view(num_layers, num_blocks, 2, bt, h, d).permute(0, 2, 1, 3, 4, 5)
        return out.reshape(num_layers, 2, num_blocks * bt, h, d)

    def unpack(self, stored: torch.Tensor, block_tokens: int) -> dict[str, torch.Tensor]:
        """``pack``'s inverse: the parts of ``stored`` (canonical layout of ``storage_spec``)."""
        layout = self._layout()
        num_layers = self.num_layers
        if layout == "kv":
            return {"k": stored[:, 0], "v": stored[:, 1]}
        if layout == "rows":
            t = stored.shape[2]
            rows = stored.squeeze(3).permute(0, 2, 1, 3).reshape(num_layers, t, -1)
            out, pos = {}, 0
            for p in self.parts:
                out[p.name] = rows[:, :, pos:pos + p.numel].reshape(num_layers, t, *p.shape)
                pos += p.numel
            return out
        bt = block_tokens
        num_blocks = stored.shape[2] // bt
        flat = stored.reshape(num_layers, 2, num_blocks, bt, -1).permute(0, 2, 1, 3, 4)
        flat = flat.reshape(num_layers, num_blocks, -1)
        out, pos = {}, 0
        for p in self.parts:
            if self.kind is GroupKind.STATE:
                n = p.nbytes
                out[p.name] = _typed(flat[:, 0, pos:pos + n], p).reshape(num_layers, *p.shape)
            elif p.per_block:
                n = p.nbytes
                out[p.name] = _typed(flat[:, :, pos:pos + n], p).reshape(
                    num_layers, num_blocks, *p.shape)
            else:
                n = p.nbytes * bt
                out[p.name] = _typed(flat[:, :, pos:pos + n], p).reshape(
                    num_layers, num_blocks * bt, *p.shape)
            pos += n
        return out

    def _num_tokens(self, tensors: Mapping[str, torch.Tensor]) -> int:
        token_parts = self._token_parts()
        return tensors[token_parts[0].name].shape[1] if token_parts else 0

    def _checked(self, parts: Mapping[str, torch.Tensor], block_tokens: int
                 ) -> dict[str, torch.Tensor]:
        if not isinstance(parts, Mapping) or set(parts) != {p.name for p in self.parts}:
            raise InvalidArgument(f"{self.label} takes parts {[p.name for p in self.parts]}, "
                                  f"got {sorted(parts) if isinstance(parts, Mapping) else parts}")
        out = {}
        num_tokens = None
        for p in self.parts:
            t = parts[p.name]
            if not isinstance(t, torch.Tensor) or t.dtype != p.torch_dtype:
                raise InvalidArgument(f"{self.label} part {p.name} must be a {p.dtype} tensor, "
                                      f"got {getattr(t, 'dtype', type(t).__name__)}")
            lead = 1 if self.kind is GroupKind.STATE else 2
            if t.dim() != lead + len(p.shape) or t.shape[0] != self.num_layers \
                    or tuple(t.shape[lead:]) != p.shape:
                raise InvalidArgument(f"{self.label} part {p.name} has shape {tuple(t.shape)}, "
                                      f"expected [{self.num_layers}"
                                      f"{', T' if lead == 2 else ''}, *{p.shape}]")
            if lead == 2 and not p.per_block:
                if num_tokens is not None and t.shape[1] != num_tokens:
                    raise InvalidArgument(f"{self.label} parts hold different token counts")
                num_tokens = t.shape[1]
            out[p.name] = t.detach().cpu()
        return out

    @property
    def label(self) -> str:
        return f"{self.kind.value} group {self.name!r}" if self.name else f"{self.kind.value} group"

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind.value, "num_layers": self.num_layers,
                               "parts": [p.to_dict() for p in self.parts]}
        if self.window_tokens:
            out["window_tokens"] = self.window_tokens
        if self.is_replicated:
            out["is_replicated"] = True
        if self.name:
            out["name"] = self.name
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CacheGroup:
        if not isinstance(data, Mapping):
            raise InvalidArgument("a cache group must be a mapping")
        unknown = set(data) - {"kind", "num_layers", "parts", "window_tokens", "is_replicated",
                               "name"}
        if unknown:
            raise InvalidArgument(f"unknown CacheGroup fields: {sorted(unknown)}")
        parts = data.get("parts")
        if not isinstance(parts, list) or len(parts) > MAX_PARTS:
            raise InvalidArgument(f"CacheGroup.parts must be a list of at most {MAX_PARTS}")
        try:
            built = tuple(CachePart(**p) for p in parts)
        except TypeError as exc:
            raise InvalidArgument(f"malformed CachePart: {exc}") from None
        return cls(data.get("kind"), data.get("num_layers"), built,
                   data.get("window_tokens", 0), bool(data.get("is_replicated", False)),
                   data.get("name", ""))


def _scale_parts(scales: str, num_heads: int, names: tuple[str, ...]) -> list[CachePart]:
    """fp8 scales as float32 parts: per tensor and per head once a block, per token per head."""
    if not scales:
        return []
    if scales == "tensor":
        return [CachePart(n, (1,), "float32", per_block=True) for n in names]
    if scales == "head":
        return [CachePart(n, (num_heads,), "float32", per_block=True) for n in names]
    if scales == "token":
        return [CachePart(n, (num_heads,), "float32") for n in names]
    raise InvalidArgument(f"scales must be '', 'tensor', 'head' or 'token', got {shown(scales)}")


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes per leading element: ``[dim0, dim1?, ...]`` as uint8, contiguous."""
    t = t.contiguous()
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else \
        t.reshape(-1).view(torch.uint8).reshape(*t.shape[:-1], -1)


def _typed(raw: torch.Tensor, part: CachePart) -> torch.Tensor:
    return raw.contiguous().view(part.torch_dtype)


@dataclass(frozen=True, slots=True)
class CacheSpec:
    """A model's whole cache: its groups, in order, and what all of them share."""

    groups: tuple[CacheGroup, ...]
    block_tokens: int
    position_scheme: str = "rope"
    _storage: tuple[KVSpec, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        groups = tuple(self.groups) if isinstance(self.groups, (list, tuple)) else ()
        if not 1 <= len(groups) <= MAX_GROUPS or not all(isinstance(g, CacheGroup)
                                                         for g in groups):
            raise InvalidArgument(f"CacheSpec needs 1-{MAX_GROUPS} CacheGroups")
        object.__setattr__(self, "groups", groups)
        bt = self.block_tokens
        if not isinstance(bt, int) or isinstance(bt, bool) or not (
                MIN_BLOCK_TOKENS <= bt <= MAX_BLOCK_TOKENS):
            raise InvalidArgument(f"CacheSpec.block_tokens must be an int in "
                                  f"[{MIN_BLOCK_TOKENS}, {MAX_BLOCK_TOKENS}], got {bt!r}")
        if any(not g.is_prefix for g in groups) and bt < 4:
            raise InvalidArgument("window and state groups need blocks of at least 4 tokens")
        if not isinstance(self.position_scheme, str) or not self.position_scheme \
                or len(self.position_scheme) > 256:
            raise InvalidArgument("CacheSpec.position_scheme must be a string of 1-256 "
                                  "characters")
        object.__setattr__(self, "_storage", tuple(
            g.storage_spec(bt, self.position_scheme) for g in groups))

    @classmethod
    def of(cls, spec: KVSpec) -> CacheSpec:
        """A ``KVSpec`` as the one-group attention cache it means."""
        group = CacheGroup.attention(spec.num_layers, spec.num_kv_heads, spec.head_dim,
                                     spec.dtype)
        return cls((group,), spec.block_tokens, spec.position_scheme)

    def storage(self, index: int) -> KVSpec:
        """The storage ``KVSpec`` of group ``index``'s pages."""
        return self._storage[index]

    def to_dict(self) -> dict[str, Any]:
        return {"groups": [g.to_dict() for g in self.groups], "block_tokens": self.block_tokens,
                "position_scheme": self.position_scheme}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CacheSpec:
        unknown = set(data) - {"groups", "block_tokens", "position_scheme"}
        if unknown:
            raise InvalidArgument(f"unknown CacheSpec fields: {sorted(unknown)}")
        groups = data.get("groups")
        if not isinstance(groups, list) or len(groups) > MAX_GROUPS:
            raise InvalidArgument(f"CacheSpec.groups must be a list of at most {MAX_GROUPS}")
        return cls(tuple(CacheGroup.from_dict(g) for g in groups), data.get("block_tokens"),
                   data.get("position_scheme", "rope"))
