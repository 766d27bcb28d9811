import dataclasses
import hashlib
import subprocess
import sys

import numpy as np
import pytest
import torch

from kvstore.errors import InvalidArgument
from kvstore.keys import (
    EXTRA_ID_BIT,
    Namespace,
    bind_block_extras,
    block_keys,
    chain_keys,
    parse_key,
)
from kvstore.spec import KVSpec

from .conftest import random_tokens

# block_keys(ns, range(100, 116))[0] for the conftest namespace, computed by the scheme's first
# implementation (kvstore 2026-11).
PINNED_FIRST_KEY = "fd9740a123111b3fd84c624d97cd4080"


def test_keys_only_cover_full_blocks(ns):
    assert len(block_keys(ns, list(range(15)))) == 0
    assert len(block_keys(ns, list(range(16)))) == 1
    assert len(block_keys(ns, list(range(47)))) == 2


def test_prefix_chaining(ns):
    tokens = random_tokens(64)
    full = block_keys(ns, tokens)
    assert block_keys(ns, tokens[:32]) == full[:2]
    # the same block of tokens after a different prefix gets a different key
    other = tokens[:16][::-1] + tokens[16:]
    assert block_keys(ns, other)[1] != full[1]
    assert len(set(full)) == 4 and all(len(k) == 16 for k in full)


def test_token_forms_agree(ns):
    tokens = random_tokens(32)
    expected = block_keys(ns, tokens)
    assert block_keys(ns, torch.tensor(tokens)) == expected
    assert block_keys(ns, np.array(tokens, dtype=np.int32)) == expected


@pytest.mark.parametrize(
    "change",
    [
        {"model_id": "other/model"},
        {"revision": "r2"},
        {"adapter_id": "lora-1"},
        {"tenant": "globex"},
        {"tp_rank": 1, "tp_size": 2},
        {"tp_size": 2},
        {"extra_salt": "image:abc"},
    ],
)
def test_every_namespace_field_changes_keys(ns, change):
    tokens = random_tokens(32)
    assert block_keys(dataclasses.replace(ns, **change), tokens)[0] != block_keys(ns, tokens)[0]


@pytest.mark.parametrize(
    "change",
    [{"dtype": "float16"}, {"num_layers": 3}, {"num_kv_heads": 4}, {"head_dim": 32},
     {"position_scheme": "alibi"}],
)
def test_every_spec_field_changes_keys(ns, change):
    tokens = random_tokens(32)
    spec = dataclasses.replace(ns.spec, **change)
    assert block_keys(dataclasses.replace(ns, spec=spec), tokens)[0] != block_keys(ns, tokens)[0]


def test_block_size_changes_keys(ns):
    tokens = random_tokens(64)
    spec = dataclasses.replace(ns.spec, block_tokens=32)
    assert block_keys(dataclasses.replace(ns, spec=spec), tokens)[0] != block_keys(ns, tokens)[1]
    assert block_keys(dataclasses.replace(ns, spec=spec), tokens)[0] != block_keys(ns, tokens)[0]


def test_keys_stable_across_processes(ns):
    code = (
        "from kvstore.keys import Namespace, block_keys; from kvstore.spec import KVSpec;"
        "s=KVSpec(num_layers=2,num_kv_heads=2,head_dim=16,block_tokens=16);"
        "n=Namespace(model_id='test/model',spec=s,revision='r1',tenant='acme');"
        "print(','.join(k.hex() for k in block_keys(n, list(range(100, 164)))))"
    )
    outs = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={"PYTHONHASHSEED": str(seed), "PATH": ""}, check=True).stdout.strip()
        for seed in (1, 2)
    }
    assert outs == {",".join(k.hex() for k in block_keys(ns, list(range(100, 164))))}


@pytest.mark.parametrize("bad", [[], [1.5] * 16, [-1] * 16, [2**32] * 16, "abc", None,
                                 torch.zeros(4, 4, dtype=torch.long)])
def test_bad_tokens_rejected(ns, bad):
    with pytest.raises(InvalidArgument):
        block_keys(ns, bad)


def test_bad_namespace_and_spec_rejected(spec):
    with pytest.raises(InvalidArgument, match="tp_rank"):
        Namespace(model_id="m", spec=spec, tp_rank=2, tp_size=2)
    with pytest.raises(InvalidArgument, match="model_id"):
        Namespace(model_id="", spec=spec)
    with pytest.raises(InvalidArgument, match="block_tokens"):
        KVSpec(num_layers=1, num_kv_heads=1, head_dim=8, block_tokens=0)
    with pytest.raises(InvalidArgument, match="dtype"):
        KVSpec(num_layers=1, num_kv_heads=1, head_dim=8, block_tokens=16, dtype="int8")


def test_namespace_dict_round_trip(ns):
    again = Namespace.from_dict(ns.to_dict())
    assert again == ns and again.fingerprint == ns.fingerprint


def test_parse_key():
    k = bytes(range(16))
    assert parse_key(k.hex()) == k
    with pytest.raises(InvalidArgument, match="hex"):
        parse_key("xyz")


def _reference_keys(ns: Namespace, tokens) -> list[bytes]:
    """The key scheme as first written (one blake2b built with its parameters per block over
    a copy of each block's bytes): what every stored page and SSD index is keyed by."""
    data = np.asarray(tokens, dtype=np.int64).astype("<u4").tobytes()
    step = ns.spec.block_tokens * 4
    keys, parent = [], ns.fingerprint
    for start in range(0, len(data) // step * step, step):
        h = hashlib.blake2b(parent, digest_size=16, person=b"kvstore.key.v1")
        h.update(data[start:start + step])
        parent = h.digest()
        keys.append(parent)
    return keys


@pytest.mark.parametrize("block_tokens", [1, 3, 16, 32, 256])
def test_keys_equal_the_reference_scheme(ns, block_tokens):
    """Keys stay byte-identical to the scheme stored pages were written under, over random
    tokens of every length around block boundaries (a partial last block included) and every
    token form an edge passes in."""
    spec = dataclasses.replace(ns.spec, block_tokens=block_tokens)
    ns = dataclasses.replace(ns, spec=spec)
    rng = np.random.default_rng(block_tokens)
    for num_tokens in (1, block_tokens - 1, block_tokens, block_tokens + 1, 5 * block_tokens + 2,
                       int(rng.integers(1, 40 * block_tokens))):
        if num_tokens < 1:
            continue
        tokens = rng.integers(0, 2**32, num_tokens, dtype=np.uint64)
        expected = _reference_keys(ns, tokens)
        assert len(expected) == num_tokens // block_tokens
        assert block_keys(ns, tokens.tolist()) == expected
        assert block_keys(ns, tokens.astype("<u4")) == expected
        assert block_keys(ns, tokens.astype(np.int64)) == expected
        strided = np.repeat(tokens.astype(np.int64), 2)[::2]  # not contiguous
        assert block_keys(ns, strided) == expected
        assert block_keys(ns, torch.from_numpy(tokens.astype(np.int64))) == expected


def test_keys_are_pinned_digests(ns):
    """The first keys of a fixed prompt, as hex: a change to the scheme would orphan every
    stored page, so it fails here before it ships."""
    assert [k.hex() for k in block_keys(ns, list(range(100, 148)))] == [
        k.hex() for k in _reference_keys(ns, list(range(100, 148)))]
    assert block_keys(ns, list(range(100, 116)))[0].hex() == PINNED_FIRST_KEY


def test_chain_keys_rejects_a_bad_block_size():
    with pytest.raises(InvalidArgument, match="block_bytes"):
        chain_keys(bytes(16), memoryview(bytes(64)), 0)


# block_keys(ns, range(100, 148)) for the conftest namespace before blocks could carry extras
# (kvstore 2026-12): keys without extras must stay these bytes.
PINNED_KEYS = ["fd9740a123111b3fd84c624d97cd4080", "a3b008723203870123768b73557318ce",
               "3d7e7708950e3523cd1d1f37c51b40e7"]


def test_keys_without_extras_are_byte_identical_to_before(ns):
    tokens = list(range(100, 148))
    for extras in (None, [], [None, None, None], [b"", None, b""]):
        assert [k.hex() for k in block_keys(ns, tokens, extras)] == PINNED_KEYS
    assert bind_block_extras(tokens, 16, [None, b"", None]).tolist() == tokens


def test_an_extra_changes_its_block_and_every_later_key_only(ns):
    tokens = list(range(100, 148))
    plain = block_keys(ns, tokens)
    with_image = block_keys(ns, tokens, [None, b"image-a", None])
    assert with_image[0] == plain[0]
    assert with_image[1] != plain[1] and with_image[2] != plain[2]
    other_image = block_keys(ns, tokens, [None, b"image-b", None])
    assert other_image[0] == plain[0] and other_image[1:] != with_image[1:]
    # the same extra one block later is another prefix
    assert block_keys(ns, tokens, [None, None, b"image-a"])[1] == plain[1]
    assert block_keys(ns, tokens, [None, None, b"image-a"])[2] != with_image[2]


def test_keys_with_extras_are_the_keys_of_the_bound_ids(ns):
    """The daemon hashes the ids a request carries: bound ids key as the extras do."""
    tokens, extras = random_tokens(40), [b"x", None, b"never keyed: a partial block"]
    bound = bind_block_extras(tokens, ns.spec.block_tokens, extras)
    assert block_keys(ns, bound) == block_keys(ns, tokens, extras)
    assert all(int(t) >= EXTRA_ID_BIT for t in bound[:16])
    assert bound[16:].tolist() == tokens[16:]


def test_block_extras_refuse_ids_in_the_derived_range_and_tiny_blocks(ns):
    with pytest.raises(InvalidArgument, match="below"):
        bind_block_extras([EXTRA_ID_BIT] + [1] * 15, 16, [b"x"])
    with pytest.raises(InvalidArgument, match="at least 4"):
        bind_block_extras([1, 2, 3, 4], 2, [b"x"])
