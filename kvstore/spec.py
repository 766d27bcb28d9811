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
}
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
