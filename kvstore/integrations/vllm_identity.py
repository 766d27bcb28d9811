"""What a vLLM request's K/V depends on beyond its token ids, as kvstore namespaces and keys.

vLLM 0.32 keys a prefix-cache block by its parent, its token ids and the block's extra keys
(``vllm/v1/core/kv_cache_utils.py``, ``generate_block_hash_extra_keys``): the LoRA adapter
(name and path), the cache salt (first block), each multimodal item touching the block (its
identifier and its offset from the block's start) and a hash of the block's prompt embeddings.
Two requests share a kvstore block only where vLLM would share it:

- per request, in the namespace: the cache salt (``extra_salt``) and the LoRA adapter
  (``adapter_id``: its name, id and path);
- per block, in the key chain: every other extra key vLLM computes for the block, taken from
  vLLM's own function and encoded canonically, enters that block's key
  (``kvstore.keys.bind_block_extras``), so a block before an image is shared and every block
  from the image's first on is not.

A request with an extra this module cannot encode (a type it does not know) raises
``Unexpressible``: the connector then neither loads nor saves it. Requests with neither
multimodal items nor prompt embeddings key exactly as before this module existed.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

import numpy as np
from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

from kvstore.errors import InvalidArgument
from kvstore.keys import EXTRA_ID_BIT, bind_block_extras, token_array

if TYPE_CHECKING:
    from vllm.lora.request import LoRARequest
    from vllm.v1.request import Request

# Extra keys vLLM tags with these are the same on every block of a request: the namespace
# binds them, so the key chain does not repeat them.
_NAMESPACE_TAGS = ("lora", "cache_salt")
_MAX_LITERAL_SALT_CHARS = 128  # longer salts enter the namespace as their sha-256
_MAX_ADAPTER_LABEL_CHARS = 128  # an adapter's name is kept readable up to this length


class Unexpressible(InvalidArgument):
    """The request's K/V depends on something kvstore's keys cannot bind: it is not cached."""


def salt_suffix(cache_salt: str | None) -> str:
    """The namespace's ``extra_salt`` part for ``cache_salt``; "" without one (vLLM ignores an
    empty salt too). Literal where short, its sha-256 otherwise, so any salt fits the
    namespace; the two spellings differ right after ``salt``, so they never collide."""
    if not cache_salt:
        return ""
    if len(cache_salt) <= _MAX_LITERAL_SALT_CHARS:
        return f"/salt={cache_salt}"
    return f"/salt-sha256={hashlib.sha256(cache_salt.encode()).hexdigest()}"


def adapter_id(lora: LoRARequest | None) -> str:
    """The namespace's ``adapter_id``: "" for the base model; else the adapter's name (for
    ``evict(adapter_id=...)`` and stats) and a digest of its name, id and path. vLLM binds the
    name and path (a name re-pointed at another adapter shares nothing); the id is bound too,
    which only ever shares less."""
    if lora is None:
        return ""
    digest = hashlib.blake2b(
        encode_extra((lora.lora_name, lora.lora_int_id, lora.lora_path or "")),
        digest_size=16).hexdigest()
    label = lora.lora_name if len(lora.lora_name) <= _MAX_ADAPTER_LABEL_CHARS else ""
    return f"{label}@{digest}"


def encode_extra(value: Any) -> bytes:
    """A canonical, self-delimiting byte form of an extra key built of None, ints, strings,
    bytes, tuples and lists; Unexpressible for anything else (a float, an object), since
    nothing guarantees its form names its content."""
    if value is None:
        return b"n"
    if type(value) is int:
        return b"i%d;" % value
    if type(value) is str:
        data = value.encode()
        return b"s%d:" % len(data) + data
    if type(value) is bytes:
        return b"b%d:" % len(value) + value
    if type(value) in (tuple, list):
        return b"t%d:" % len(value) + b"".join(encode_extra(v) for v in value)
    raise Unexpressible(f"vLLM block extra key of type {type(value).__name__} ({value!r:.80}) "
                        f"has no canonical form")


_FEW_TOKENS = 256  # new tokens checked in Python (a decode step's block) rather than numpy
_HEADROOM = 4096  # output tokens a request's id buffer has room for from the start


class BlockIdentity:
    """The ids a request's blocks are keyed by in kvstore, extended as the request grows."""

    def __init__(self, request: Request, block_size: int) -> None:
        self._request = request
        self._block_size = block_size
        self.adapter_id = adapter_id(request.lora_request)  # the namespace's; see adapter_id
        # Only multimodal items and prompt embeddings give blocks their own extras in 0.32.
        self._has_extras = bool(request.mm_features) or request.prompt_embeds is not None
        self._extras: list[bytes | None] = []
        self._mm_index = 0  # vLLM's cursor into the request's multimodal items
        # The request's token ids checked so far, in a buffer that doubles as they grow: each
        # call converts and checks only the tokens it has not seen (at 32k tokens a full
        # conversion took 1.4 ms, and a scheduler step asks for every request completing a
        # block).
        self._ids = np.empty(0, dtype=np.uint32)
        self._num_ids = 0

    def tokens(self, num_tokens: int) -> np.ndarray:
        """The ids keying the request's first ``num_tokens`` tokens (full blocks bound to
        their extras; the ids vLLM hashes: prompt-embedding positions are 0).

        Raises:
            Unexpressible: an extra key has no canonical form, or a token id reaches the
                range derived blocks use.
        """
        ids = self._checked(num_tokens)
        if not self._has_extras:
            return ids
        self._extend(num_tokens // self._block_size)
        return bind_block_extras(ids, self._block_size, self._extras)

    def _checked(self, num_tokens: int) -> np.ndarray:
        """The first ``num_tokens`` ids as a read-only uint32 view; only those not seen before
        are converted and checked."""
        have = self._num_ids
        if num_tokens > have:
            new = self._request.all_token_ids[have:num_tokens]
            if num_tokens - have <= _FEW_TOKENS and all(type(t) is int for t in new):
                low, high = min(new), max(new)  # a block or so: no numpy round trip
                if low < 0:
                    raise InvalidArgument(f"token ids must be non-negative, got {low}")
            else:
                new = token_array(list(new))
                high = int(new.max()) if new.size else 0
            if high >= EXTRA_ID_BIT:
                raise Unexpressible(f"token id {high} is at or above {EXTRA_ID_BIT}")
            if num_tokens > len(self._ids):
                # room for the request's own output too (up to _HEADROOM tokens), so a decode
                # step does not pay a regrowth; then doubling
                headroom = min(int(getattr(self._request, "max_tokens", 0) or 0), _HEADROOM)
                grown = np.empty(max(num_tokens + headroom, 2 * len(self._ids)),
                                 dtype=np.uint32)
                grown[:have] = self._ids[:have]
                self._ids = grown
            self._ids[have:num_tokens] = new
            self._num_ids = num_tokens
        view = self._ids[:num_tokens]
        view.flags.writeable = False
        return view

    def _extend(self, num_blocks: int) -> None:
        """Compute the extras of blocks up to ``num_blocks`` with vLLM's own function, in
        order, as its block hasher does."""
        bs = self._block_size
        for i in range(len(self._extras), num_blocks):
            keys, self._mm_index = generate_block_hash_extra_keys(
                self._request, i * bs, (i + 1) * bs, self._mm_index)
            own = [k for k in keys or () if not (isinstance(k, tuple) and k
                                                  and k[0] in _NAMESPACE_TAGS)]
            self._extras.append(encode_extra(own) if own else None)

