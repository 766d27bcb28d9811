import dataclasses
import subprocess
import sys

import numpy as np
import pytest
import torch

from kvstore.errors import InvalidArgument
from kvstore.keys import Namespace, block_keys, parse_key
from kvstore.spec import KVSpec

from .conftest import random_tokens


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
