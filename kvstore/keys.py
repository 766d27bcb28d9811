"""Namespaces and chained 128-bit block keys.

A namespace fingerprint hashes everything that changes the stored K/V (model and revision,
adapter, tenant, KV spec, tensor-parallel shard, extra salt). Block i's key hashes block i-1's
key with block i's tokens, so a key names a whole prefix, not just its own tokens. A block may
carry an extra (an image's hash and offset, a hash of prompt embeddings): it enters that
block's key and, through the chain, every later one; blocks without extras key as before.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NewType

import numpy as np
import torch

from kvstore.errors import InvalidArgument
from kvstore.groups import CacheGroup, CacheSpec
from kvstore.spec import KVSpec

BlockKey = NewType("BlockKey", bytes)
"""16 bytes: blake2b-128 of (parent key or namespace fingerprint, the block's tokens)."""

KEY_BYTES = 16
_KEY_PERSON = b"kvstore.key.v1"  # blake2b personalisation: domain-separates from other uses
_NS_PERSON = b"kvstore.ns.v1"
MAX_TOKEN_ID = 2**32 - 1
_TOKEN_DTYPE = np.dtype("<u4")  # the hashed byte form of token ids (every value in range)
MAX_NAME_CHARS = 256  # model ids, tenants, revisions: bounded so page meta stays small


@dataclass(frozen=True, slots=True)
class Namespace:
    """Everything that must match for two requests to share K/V blocks.

    ``spec`` is a ``KVSpec`` (a one-group attention cache, keyed and stored as it always was)
    or a ``CacheSpec`` of groups (``kvstore.groups``), whose pages are stored per group under
    ``group(i)``.
    """

    model_id: str
    spec: KVSpec | CacheSpec
    revision: str = "main"  # weights revision / checkpoint hash
    adapter_id: str = ""  # LoRA or other adapter; "" for the base model
    tenant: str = "default"
    tp_rank: int = 0
    tp_size: int = 1
    extra_salt: str = ""  # e.g. a hash of multimodal inputs
    fingerprint: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("model_id", "tenant"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise InvalidArgument(f"Namespace.{name} must be a non-empty string, got {value!r}")
        for name in ("model_id", "tenant", "revision", "adapter_id", "extra_salt"):
            value = getattr(self, name)
            if not isinstance(value, str) or len(value) > MAX_NAME_CHARS:
                raise InvalidArgument(
                    f"Namespace.{name} must be a string of at most {MAX_NAME_CHARS} characters")
        if not isinstance(self.spec, (KVSpec, CacheSpec)):
            raise InvalidArgument(f"Namespace.spec must be a KVSpec or CacheSpec, got "
                                  f"{type(self.spec).__name__}")
        if not (isinstance(self.tp_size, int) and self.tp_size >= 1):
            raise InvalidArgument(f"Namespace.tp_size must be an int >= 1, got {self.tp_size!r}")
        if not (isinstance(self.tp_rank, int) and 0 <= self.tp_rank < self.tp_size):
            raise InvalidArgument(
                f"Namespace.tp_rank must be in [0, tp_size={self.tp_size}), got {self.tp_rank!r}"
            )
        canonical = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        digest = hashlib.blake2b(canonical.encode(), digest_size=KEY_BYTES, person=_NS_PERSON)
        object.__setattr__(self, "fingerprint", digest.digest())

    @property
    def is_grouped(self) -> bool:
        """Whether the cache is a ``CacheSpec`` of groups (stored per group)."""
        return isinstance(self.spec, CacheSpec)

    @property
    def cache(self) -> CacheSpec:
        """The cache as groups (a ``KVSpec`` is one attention group)."""
        return self.spec if isinstance(self.spec, CacheSpec) else CacheSpec.of(self.spec)

    def group(self, index: int) -> Namespace:
        """The namespace group ``index``'s pages are keyed and stored in: its storage spec,
        and a salt binding the whole cache's fingerprint (without the TP rank for a
        replicated group, so every rank keys it alike) and the group's position. A ``KVSpec``
        namespace's only group is itself."""
        if not isinstance(self.spec, CacheSpec):
            if index != 0:
                raise InvalidArgument(f"a KVSpec namespace has one group, not group {index}")
            return self
        return _group_namespace(self, index)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model_id": self.model_id,
            "revision": self.revision,
            "adapter_id": self.adapter_id,
            "tenant": self.tenant,
            "spec": self.spec.to_dict(),
            "tp_rank": self.tp_rank,
            "tp_size": self.tp_size,
            "extra_salt": self.extra_salt,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Namespace:
        data = dict(data)
        spec = data.pop("spec", None)
        if not isinstance(spec, dict):
            raise InvalidArgument("Namespace needs a 'spec' mapping")
        unknown = set(data) - (set(cls.__dataclass_fields__) - {"fingerprint"})
        if unknown:
            raise InvalidArgument(f"unknown Namespace fields: {sorted(unknown)}")
        built = CacheSpec.from_dict(spec) if "groups" in spec else KVSpec.from_dict(spec)
        return cls(spec=built, **data)


_GROUP_PERSON = b"kvstore.group.v1"


@functools.lru_cache(maxsize=1024)
def _group_namespace(ns: Namespace, index: int) -> Namespace:
    cache: CacheSpec = ns.spec  # type: ignore[assignment]  # the caller checked
    if not 0 <= index < len(cache.groups):
        raise InvalidArgument(f"group {index} is out of range: the cache has "
                              f"{len(cache.groups)} groups")
    group: CacheGroup = cache.groups[index]
    whole = ns.to_dict()
    if group.is_replicated:
        # The same on every rank of any TP size (an MLA latent): keyed by what determines its
        # content, not by the rank or by how the other groups are sharded, so TP=8 stores one
        # copy and prefill and decode instances of different TP sizes share it.
        del whole["tp_rank"], whole["tp_size"]
        whole["spec"] = {"group": group.to_dict(), "block_tokens": cache.block_tokens,
                         "position_scheme": cache.position_scheme}
    canonical = json.dumps([whole, index], sort_keys=True, separators=(",", ":"))
    salt = hashlib.blake2b(canonical.encode(), digest_size=KEY_BYTES,
                           person=_GROUP_PERSON).hexdigest()
    rank, size = (0, 1) if group.is_replicated else (ns.tp_rank, ns.tp_size)
    return Namespace(model_id=ns.model_id, spec=cache.storage(index), revision=ns.revision,
                     adapter_id=ns.adapter_id, tenant=ns.tenant, tp_rank=rank, tp_size=size,
                     extra_salt=f"group/{index}/{salt}")


def token_array(tokens: Sequence[int] | np.ndarray | torch.Tensor) -> np.ndarray:
    """Validate token ids and return them as little-endian uint32 (the hashed byte form)."""
    if isinstance(tokens, torch.Tensor):
        if tokens.dim() != 1 or tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
            raise InvalidArgument(f"tokens must be a 1-D integer tensor, got {tokens.dtype} "
                                  f"with shape {tuple(tokens.shape)}")
        arr = tokens.detach().cpu().numpy()
    elif isinstance(tokens, np.ndarray):
        arr = tokens
    elif isinstance(tokens, (list, tuple, range)):
        try:
            arr = np.asarray(tokens)  # ints give an integer dtype; floats, bools, objects do not
        except (ValueError, TypeError, OverflowError):
            raise InvalidArgument("tokens must be a sequence of ints") from None
        if arr.size and (arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer)):
            raise InvalidArgument(f"tokens must be a sequence of ints, got {arr.dtype} values")
    else:
        raise InvalidArgument(f"tokens must be a sequence of ints, got {type(tokens).__name__}")
    if arr.size == 0:
        raise InvalidArgument("tokens is empty")
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise InvalidArgument(f"tokens must be a 1-D array of ints, got {arr.dtype} {arr.shape}")
    if arr.dtype != _TOKEN_DTYPE and (arr.min() < 0 or arr.max() > MAX_TOKEN_ID):
        raise InvalidArgument(f"token ids must be in [0, {MAX_TOKEN_ID}]")
    return np.ascontiguousarray(arr, dtype=_TOKEN_DTYPE)  # no copy when it already is


def block_keys(ns: Namespace, tokens: Sequence[int] | np.ndarray | torch.Tensor,
               extras: Sequence[bytes | None] | None = None) -> list[BlockKey]:
    """Chained keys of every full block of ``tokens`` under ``ns``; a trailing partial block
    has no key. ``extras[i]``, where given, enters block i's key (``bind_block_extras``)."""
    arr = token_array(tokens)
    if extras is not None:
        arr = bind_block_extras(arr, ns.spec.block_tokens, extras)
    return chain_keys(ns.fingerprint, memoryview(arr).cast("B"),
                      ns.spec.block_tokens * arr.itemsize)


# The key hasher, personalised once: each block copies it (a copy of the parameter block in C)
# instead of parsing digest_size and person again; on the 2-core box (2026-12-01) that halved
# hashing a 32k-token prefix. Never updated, so copying it from several threads is safe.
_KEY_HASHER = hashlib.blake2b(digest_size=KEY_BYTES, person=_KEY_PERSON)


def chain_keys(parent: bytes, data: memoryview, block_bytes: int) -> list[BlockKey]:
    """Keys of the full ``block_bytes`` blocks of ``data`` (token ids as little-endian uint32),
    chained from ``parent``: key_i = blake2b-128(key_{i-1} || block i), personalised.

    One pass over one buffer: per block a copy of the personalised hasher, two updates (the
    parent digest and a slice of ``data``, no copy) and the digest; nothing else per block.
    """
    if block_bytes <= 0:
        raise InvalidArgument(f"block_bytes must be > 0, got {block_bytes}")
    new_hasher = _KEY_HASHER.copy
    keys: list[BlockKey] = []
    append = keys.append
    for start in range(0, len(data) - block_bytes + 1, block_bytes):
        h = new_hasher()
        h.update(parent)
        h.update(data[start:start + block_bytes])
        parent = h.digest()
        append(parent)  # type: ignore[arg-type]  # a BlockKey is its 16 bytes
    return keys


# Token ids a block with an extra is keyed by have this bit set; real ids stay below it (no
# vocabulary comes near 2**31), so a derived block never equals a block of real tokens.
EXTRA_ID_BIT = 1 << 31
_EXTRA_PERSON = b"kvstore.extra.v1"
MIN_EXTRA_BLOCK_TOKENS = 4  # 31 bits per derived id: at least 124 bits name a derived block


def bind_block_extras(tokens: Sequence[int] | np.ndarray | torch.Tensor, block_tokens: int,
                      extras: Sequence[bytes | None]) -> np.ndarray:
    """``tokens`` with every full block i that has an extra (``extras[i]`` neither None nor
    empty) replaced by a derived block: ``block_tokens`` ids of shake-256(block i's tokens ||
    extras[i]) with ``EXTRA_ID_BIT`` set. Keys of the result bind each extra to its block.

    Keys are hashed from token ids wherever they are computed (the daemon hashes the ids a
    request carries), so an extra travels as the ids of the block it touches: nothing on the
    wire or in the daemon changes, and ``tokens`` without extras come back unchanged, keying
    byte for byte as before. Extras past the full blocks are ignored (a partial block has no
    key).

    Raises:
        InvalidArgument: a block has an extra and a real id of ``tokens`` has
            ``EXTRA_ID_BIT`` set, or ``block_tokens`` is below ``MIN_EXTRA_BLOCK_TOKENS``.
    """
    arr = token_array(tokens)
    marked = [i for i, extra in enumerate(extras[: arr.size // block_tokens]) if extra]
    if not marked:
        return arr
    if block_tokens < MIN_EXTRA_BLOCK_TOKENS:
        raise InvalidArgument(f"block extras need blocks of at least {MIN_EXTRA_BLOCK_TOKENS} "
                              f"tokens, got {block_tokens}")
    if int(arr.max()) >= EXTRA_ID_BIT:
        raise InvalidArgument(f"token ids must be below {EXTRA_ID_BIT} where blocks have extras")
    out = arr.copy()
    for i in marked:
        block = out[i * block_tokens:(i + 1) * block_tokens]
        h = hashlib.shake_256(_EXTRA_PERSON)
        h.update(block.tobytes())
        h.update(extras[i])  # type: ignore[arg-type]  # marked: bytes
        derived = np.frombuffer(h.digest(block.nbytes), dtype=_TOKEN_DTYPE)
        block[:] = derived | EXTRA_ID_BIT
    return out


_SNAPSHOT_PERSON = b"kvstore.snap.v1"


def snapshot_tokens(chain_key: bytes, block_tokens: int) -> np.ndarray:
    """The token ids of the one-block prefix that stores a window block or state snapshot
    (``kvstore.groups``) of the prefix whose group chain key is ``chain_key``: shake-256 of
    it, ``EXTRA_ID_BIT`` set (never ids of real tokens). Keyed under the group's namespace,
    the page names that whole prefix yet stands alone: no block before it need be stored."""
    if block_tokens < MIN_EXTRA_BLOCK_TOKENS:
        raise InvalidArgument(f"window and state groups need blocks of at least "
                              f"{MIN_EXTRA_BLOCK_TOKENS} tokens, got {block_tokens}")
    h = hashlib.shake_256(_SNAPSHOT_PERSON)
    h.update(chain_key)
    ids = np.frombuffer(h.digest(block_tokens * _TOKEN_DTYPE.itemsize), dtype=_TOKEN_DTYPE)
    return ids | np.uint32(EXTRA_ID_BIT)


def snapshot_keys(ns: Namespace, chain_keys_: Sequence[bytes]) -> list[BlockKey]:
    """The page keys of the snapshots (window blocks, state) at each of ``chain_keys_``,
    the group namespace ``ns``'s chain keys."""
    bt = ns.spec.block_tokens
    keys: list[BlockKey] = []
    for key in chain_keys_:  # chain_keys of one block, inlined: a lookup probes many
        h = _KEY_HASHER.copy()
        h.update(ns.fingerprint)
        h.update(snapshot_tokens(key, bt))
        keys.append(h.digest())  # type: ignore[arg-type]  # a BlockKey is its 16 bytes
    return keys


NO_PARENT = bytes(KEY_BYTES)  # how pages and indexes spell "the first block of a prefix"


def parse_key(text: str | bytes) -> BlockKey:
    """A BlockKey from 32 hex characters or 16 raw bytes; InvalidArgument otherwise."""
    if isinstance(text, bytes) and len(text) == KEY_BYTES:
        return BlockKey(text)
    shown = repr(text[:48])
    if len(text) != 2 * KEY_BYTES:
        raise InvalidArgument(f"malformed block key {shown}: expected {2 * KEY_BYTES} hex digits")
    try:
        raw = bytes.fromhex(text if isinstance(text, str) else text.decode())
    except (ValueError, UnicodeDecodeError):
        raise InvalidArgument(f"malformed block key {shown}: not hexadecimal") from None
    return BlockKey(raw)
