"""KV geometry: layers, kv heads, head dim, dtype and block size, and the canonical layout."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvstore.errors import InvalidArgument, shown

# Names are what configs, pages and the wire carry; torch dtypes are looked up from them.
DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    # The bytes of a cache group that is not one float dtype (kvstore.groups: fp8 engine
    # caches with their scales, recurrent states); only lossless codecs take it.
    "uint8": torch.uint8,
}
FLOAT_DTYPE_NAMES = ("bfloat16", "float16", "float32")
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}

MIN_BLOCK_TOKENS = 1
MAX_BLOCK_TOKENS = 1024


def dtype_name(dtype: torch.dtype) -> str:
    """The kvstore name of a torch dtype, or InvalidArgument if it is not a KV dtype."""
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise InvalidArgument(
            f"unsupported KV dtype {dtype}; expected one of {sorted(DTYPES)}"
        ) from None


@dataclass(frozen=True, slots=True)
class KVSpec:
    """Geometry of one model's KV cache as kvstore stores it.

    The canonical layout of a run of ``num_tokens`` tokens is
    ``[num_layers, 2, num_tokens, num_kv_heads, head_dim]`` where index 0 of dim 1 is K and
    index 1 is V. A block is ``block_tokens`` consecutive tokens of that layout.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_tokens: int
    dtype: str = "bfloat16"  # a name from DTYPES; a torch dtype is accepted and stored by name
    position_scheme: str = "rope"  # rope variant / position encoding id; part of the key

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 65536:
                raise InvalidArgument(f"KVSpec.{name} must be an int in [1, 65536], got {value!r}")
        bt = self.block_tokens
        if not isinstance(bt, int) or isinstance(bt, bool) or not (
            MIN_BLOCK_TOKENS <= bt <= MAX_BLOCK_TOKENS
        ):
            raise InvalidArgument(
                f"KVSpec.block_tokens must be an int in [{MIN_BLOCK_TOKENS}, {MAX_BLOCK_TOKENS}],"
                f" got {bt!r}"
            )
        if isinstance(self.dtype, torch.dtype):  # engines hand their cache's torch dtype
            object.__setattr__(self, "dtype", dtype_name(self.dtype))
        if self.dtype not in DTYPES:
            raise InvalidArgument(
                f"KVSpec.dtype must be one of {sorted(DTYPES)}, got {shown(self.dtype)}"
            )
        if not isinstance(self.position_scheme, str) or not self.position_scheme:
            raise InvalidArgument("KVSpec.position_scheme must be a non-empty string")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def element_bytes(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    def shape(self, num_tokens: int) -> tuple[int, int, int, int, int]:
        """Canonical shape for ``num_tokens`` tokens."""
        return (self.num_layers, 2, num_tokens, self.num_kv_heads, self.head_dim)

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        return self.shape(self.block_tokens)

    @property
    def elements_per_block(self) -> int:
        return self.num_layers * 2 * self.block_tokens * self.num_kv_heads * self.head_dim

    @property
    def block_bytes(self) -> int:
        """Uncompressed bytes of one block in the canonical layout."""
        return self.elements_per_block * self.element_bytes

    def check_kv(self, kv: Any, num_tokens: int | None = None) -> torch.Tensor:
        """Validate ``kv`` against this spec and return it; raise InvalidArgument naming the fault.

        Args:
            kv: candidate K/V tensor in the canonical layout.
            num_tokens: if given, the token count dim 2 must have.
        """
        if not isinstance(kv, torch.Tensor):
            raise InvalidArgument(f"kv must be a torch.Tensor, got {type(kv).__name__}")
        if kv.dtype != self.torch_dtype:
            raise InvalidArgument(f"kv dtype is {kv.dtype}, the namespace spec says {self.dtype}")
        expected = self.shape(kv.shape[2] if kv.dim() == 5 else -1)
        if kv.dim() != 5 or tuple(kv.shape) != expected:
            raise InvalidArgument(
                f"kv shape is {tuple(kv.shape)}, expected [num_layers={self.num_layers}, 2,"
                f" num_tokens, num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}]"
            )
        if num_tokens is not None and kv.shape[2] != num_tokens:
            raise InvalidArgument(f"kv holds {kv.shape[2]} tokens but {num_tokens} tokens were given")
        return kv

    def check_out(self, out: Any, num_tokens: int) -> torch.Tensor:
        """Validate ``out``, a get's caller-owned result buffer, and return its front view for
        the full blocks of ``num_tokens``; raise InvalidArgument naming the fault.

        It must be a C-contiguous CPU tensor of this spec's dtype, shaped ``[L, 2, T, H, D]``
        with ``T`` at least those blocks' tokens (a buffer sized for the longest prompt serves
        shorter ones).
        """
        if not isinstance(out, torch.Tensor):
            raise InvalidArgument(f"out must be a torch.Tensor, got {type(out).__name__}")
        if out.device.type != "cpu":
            raise InvalidArgument(f"out must be a CPU tensor, got one on {out.device}")
        if out.dtype != self.torch_dtype:
            raise InvalidArgument(f"out is {out.dtype}; the namespace's K/V are {self.torch_dtype}")
        need = num_tokens // self.block_tokens * self.block_tokens
        expected = self.shape(need)
        if (out.dim() != len(expected) or out.shape[:2] != expected[:2]
                or out.shape[3:] != expected[3:] or out.shape[2] < need):
            raise InvalidArgument(f"out has shape {tuple(out.shape)}; a get of {num_tokens} tokens "
                                  f"needs {tuple(expected)} (or more tokens on dim 2)")
        if not out.is_contiguous():
            raise InvalidArgument("out must be contiguous (C order), as torch.empty makes it")
        return out[:, :, :need]

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "block_tokens": self.block_tokens,
            "dtype": self.dtype,
            "position_scheme": self.position_scheme,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVSpec:
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise InvalidArgument(f"unknown KVSpec fields: {sorted(unknown)}")
        return cls(**data)


# Engine paged-cache layouts: the role of each dim of one layer's tensor. "kv" has size 2 (K
# then V), "block" is the engine's page, "token" a slot of a page, "kvdim" is K and V side by
# side in the last dim (2 * head_dim, K first). Shapes are logical: strides are read from the
# tensors, so an engine that permutes memory under the same shape is handled.
ENGINE_LAYOUTS: dict[str, tuple[str, ...]] = {
    "flash": ("kv", "block", "token", "head", "dim"),  # FlashAttention, vLLM: [2, nb, bs, H, D]
    "flash_hnd": ("kv", "block", "head", "token", "dim"),  # [2, nb, H, bs, D]
    "flashinfer": ("block", "kv", "token", "head", "dim"),  # FlashInfer: [nb, 2, bs, H, D]
    "flashinfer_hnd": ("block", "kv", "head", "token", "dim"),  # [nb, 2, H, bs, D]
    "fused_hnd": ("block", "head", "token", "kvdim"),  # [nb, H, bs, 2D]
    "fused_nhd": ("block", "token", "head", "kvdim"),  # [nb, bs, H, 2D]
}
ENGINE_DTYPES = (torch.bfloat16, torch.float16)
# fp8 engine caches (vLLM's cache_dtype fp8, fp8_e4m3, fp8_e5m2; kept in uint8 tensors on CUDA):
# stored as their bytes under a uint8 spec, moved bit for bit (kvstore.engine_fp8 binds the
# fp8 flavour and the scales into the namespace).
BYTE_ENGINE_DTYPES = (torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass(frozen=True)
class EngineLayout:
    """Where token t, head h of K or V of layer l in engine page p lives in an engine's cache.

    Element ``(l, kv, p, t, h, d)`` is at ``layer_ptrs[l] + (kv * kv_stride + p * block_stride
    + t * token_stride + h * head_stride + d) * element_size`` bytes; ``d`` is contiguous.
    Built by ``EngineLayout.of`` from the tensors an engine registers, which must outlive it.
    """

    name: str
    num_layers: int
    num_blocks: int
    block_tokens: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    layer_ptrs: tuple[int, ...]
    kv_stride: int
    block_stride: int
    token_stride: int
    head_stride: int
    tensors: tuple[torch.Tensor, ...]  # kept alive while the layout is in use

    @classmethod
    def of(cls, kv_caches: torch.Tensor | list[torch.Tensor] | tuple[torch.Tensor, ...]
           | dict[str, torch.Tensor], spec: KVSpec, layout: str | None = None) -> EngineLayout:
        """Read the layout of an engine's paged cache: a list (or name -> tensor dict, in
        layer order) of per-layer tensors, or one tensor with the layer dim first.

        ``layout`` names an entry of ``ENGINE_LAYOUTS``; None infers it from the shapes and the
        spec, and asks for it by name when two layouts fit (e.g. block_tokens == num_kv_heads).
        """
        if isinstance(kv_caches, dict):
            kv_caches = list(kv_caches.values())
        if isinstance(kv_caches, torch.Tensor):
            fused = kv_caches
            layers = [fused[i] for i in range(fused.shape[0])] if fused.dim() >= 1 else []
        elif isinstance(kv_caches, (list, tuple)):
            layers = list(kv_caches)
        else:
            raise InvalidArgument(f"kv_caches must be a tensor, a list of per-layer tensors or a "
                                  f"dict of them, got {type(kv_caches).__name__}")
        if len(layers) != spec.num_layers:
            raise InvalidArgument(f"kv_caches hold {len(layers)} layers, the spec says "
                                  f"{spec.num_layers}")
        first = layers[0]
        for i, t in enumerate(layers):
            if not isinstance(t, torch.Tensor):
                raise InvalidArgument(f"kv_caches[{i}] is a {type(t).__name__}, not a tensor")
            if t.shape != first.shape or t.stride() != first.stride() or t.dtype != first.dtype \
                    or t.device != first.device:
                raise InvalidArgument(f"kv_caches[{i}] has shape {tuple(t.shape)}, strides "
                                      f"{t.stride()}, {t.dtype} on {t.device}; layer 0 has "
                                      f"{tuple(first.shape)}, {first.stride()}, {first.dtype} "
                                      f"on {first.device}: every layer must match")
        if first.dtype in BYTE_ENGINE_DTYPES:
            if spec.dtype != "uint8":
                raise InvalidArgument(f"engine cache is {first.dtype}: its pages are bytes, so "
                                      f"the spec's dtype must be uint8, not {spec.dtype}")
        elif first.dtype not in ENGINE_DTYPES:
            raise InvalidArgument(f"engine cache dtype {first.dtype} is not supported; expected "
                                  f"one of {list(ENGINE_DTYPES + BYTE_ENGINE_DTYPES)}")
        elif first.dtype != spec.torch_dtype:
            raise InvalidArgument(f"engine cache is {first.dtype}, the spec says {spec.dtype}")
        if layout is None:
            fits = [n for n, roles in ENGINE_LAYOUTS.items() if _fits(roles, first.shape, spec)]
            if not fits:
                raise InvalidArgument(
                    f"engine cache layer shape {tuple(first.shape)} matches no known layout for "
                    f"block_tokens={spec.block_tokens}, num_kv_heads={spec.num_kv_heads}, "
                    f"head_dim={spec.head_dim}; known: {sorted(ENGINE_LAYOUTS)}")
            if len(fits) > 1:
                raise InvalidArgument(f"engine cache shape {tuple(first.shape)} fits layouts "
                                      f"{fits}: pass layout= to say which")
            layout = fits[0]
        roles = ENGINE_LAYOUTS.get(layout) if isinstance(layout, str) else None
        if roles is None:
            raise InvalidArgument(f"unknown engine layout {shown(layout)}; known: "
                                  f"{sorted(ENGINE_LAYOUTS)}")
        if not _fits(roles, first.shape, spec):
            raise InvalidArgument(f"engine cache shape {tuple(first.shape)} is not layout "
                                  f"{layout} {roles} for this spec")
        strides = dict(zip(roles, first.stride()))
        sizes = dict(zip(roles, first.shape))
        last = "kvdim" if "kvdim" in roles else "dim"
        if strides[last] != 1:
            raise InvalidArgument(f"engine cache's {last} dim must be contiguous (stride 1), "
                                  f"has stride {strides[last]}")
        kv_stride = spec.head_dim if last == "kvdim" else strides["kv"]
        return cls(
            name=layout, num_layers=spec.num_layers, num_blocks=sizes["block"],
            block_tokens=spec.block_tokens, num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim, dtype=first.dtype, device=first.device,
            layer_ptrs=tuple(t.data_ptr() for t in layers), kv_stride=kv_stride,
            block_stride=strides["block"], token_stride=strides["token"],
            head_stride=strides["head"], tensors=tuple(layers),
        )

    @property
    def is_bytes(self) -> bool:
        """Whether the cache holds one-byte elements (fp8), moved as bytes."""
        return self.dtype.itemsize == 1

    def check_block_ids(self, block_ids: torch.Tensor | list[int]) -> torch.Tensor:
        """``block_ids`` as a 1-D int64 CPU tensor, every id a page of the cache."""
        ids = torch.as_tensor(block_ids, dtype=torch.int64)
        if ids.dim() != 1:
            raise InvalidArgument(f"block_ids must be 1-D, got shape {tuple(ids.shape)}")
        if ids.numel():
            low, high = int(ids.min()), int(ids.max())
            if low < 0 or high >= self.num_blocks:
                raise InvalidArgument(f"block_ids span [{low}, {high}], the engine cache has "
                                      f"{self.num_blocks} pages")
        return ids.cpu()

    def block_view(self, layer: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one engine page of one layer as ``[block_tokens, heads, head_dim]`` views
        (for references and tests)."""
        t = self.tensors[layer]
        base = t.as_strided((2, self.block_tokens, self.num_kv_heads, self.head_dim),
                            (self.kv_stride, self.token_stride, self.head_stride, 1),
                            t.storage_offset() + block * self.block_stride)
        return base[0], base[1]


def _fits(roles: tuple[str, ...], shape: torch.Size, spec: KVSpec) -> bool:
    if len(roles) != len(shape):
        return False
    want = {"kv": 2, "token": spec.block_tokens, "head": spec.num_kv_heads,
            "dim": spec.head_dim, "kvdim": 2 * spec.head_dim}
    return all(role == "block" or want[role] == size for role, size in zip(roles, shape))
