"""Cache groups: the spec, its fingerprint and the page layout of each kind of group."""

from __future__ import annotations

import pytest
import torch

from kvstore.errors import InvalidArgument
from kvstore.groups import CacheGroup, CachePart, CacheSpec, GroupKind
from kvstore.keys import Namespace, snapshot_keys
from kvstore.spec import KVSpec

BT = 16


def cache(**overrides) -> CacheSpec:
    groups = (
        CacheGroup.attention(2, 2, 24, v_head_dim=16, name="mla-expanded"),
        CacheGroup.latent(2, [("kv", 32, "bfloat16"), ("pe", 8, "float8_e4m3fn")]),
        CacheGroup.attention(1, 2, 8, window_tokens=40, name="sliding"),
        CacheGroup.state(2, {"conv": ((6, 4), "float32"), "ssm": ((2, 4, 8), "bfloat16")}),
        CacheGroup.attention(2, 2, 8, "float8_e5m2", scales="token", name="fp8"),
    )
    return CacheSpec(overrides.get("groups", groups), BT)


def parts_of(group: CacheGroup, num_tokens: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for p in group.parts:
        lead = (group.num_layers,) if group.kind is GroupKind.STATE else \
            (group.num_layers, num_tokens // BT if p.per_block else num_tokens)
        shape = lead + p.shape
        if p.torch_dtype.is_floating_point and p.torch_dtype.itemsize > 1:
            out[p.name] = torch.randn(shape, generator=g).to(p.torch_dtype)
        else:  # fp8 and bytes: every bit pattern, NaN encodings included, must survive
            raw = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
            out[p.name] = raw.view(p.torch_dtype)
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def test_a_kvspec_namespace_keeps_its_fingerprint_and_is_its_own_one_group():
    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, block_tokens=BT)
    ns = Namespace("m", spec)
    assert not ns.is_grouped and ns.group(0) is ns
    assert ns.cache.storage(0) == spec
    # A CacheSpec of that one group is another cache description: another fingerprint.
    assert Namespace("m", CacheSpec.of(spec)).fingerprint != ns.fingerprint


@pytest.mark.parametrize("index", range(5))
def test_each_group_packs_and_unpacks_bit_exact(index):
    group = cache().groups[index]
    tokens = 3 * BT if group.kind is not GroupKind.STATE else BT
    parts = parts_of(group, tokens)
    stored = group.pack(parts, BT)
    spec = group.storage_spec(BT)
    expected_tokens = BT if group.kind is GroupKind.STATE else tokens
    assert tuple(stored.shape) == spec.shape(expected_tokens)
    assert stored.dtype == spec.torch_dtype
    back = group.unpack(stored, BT)
    for name, tensor in parts.items():
        assert same_bits(back[name], tensor), name
    if group.kind is not GroupKind.STATE:  # block by block as the store slices it
        second = group.unpack(stored[:, :, BT:2 * BT], BT)
        for p in group.parts:
            want = parts[p.name][:, 1:2] if p.per_block else parts[p.name][:, BT:2 * BT]
            assert same_bits(second[p.name], want)


def test_storage_layouts():
    c = cache()
    assert c.storage(0) == KVSpec(2, 1, 2 * (24 + 16) // 2, BT, "bfloat16")  # K/V dims differ
    assert c.storage(1).dtype == "uint8"  # mixed dtypes: bytes
    assert c.storage(2) == KVSpec(1, 2, 8, BT, "bfloat16")  # a window is plain K/V
    assert c.storage(3).dtype == "uint8" and c.storage(4).dtype == "uint8"
    bf16_latent = CacheGroup.latent(3, [("kv", 512, "bfloat16"), ("pe", 64, "bfloat16")])
    assert bf16_latent.storage_spec(BT) == KVSpec(3, 1, 288, BT, "bfloat16")
    assert not bf16_latent.is_lossless_only and c.groups[3].is_lossless_only
    assert c.groups[4].is_lossless_only


def test_the_fingerprint_covers_every_group_and_replicated_groups_drop_the_rank():
    a = Namespace("m", cache(), tp_rank=0, tp_size=2)
    b = Namespace("m", cache(), tp_rank=1, tp_size=2)
    assert a.fingerprint != b.fingerprint
    assert a.group(1).fingerprint == b.group(1).fingerprint  # the latent: one copy
    assert a.group(0).fingerprint != b.group(0).fingerprint  # sharded: per rank
    assert len({a.group(i).fingerprint for i in range(5)}) == 5
    other = cache(groups=cache().groups[:4] + (CacheGroup.attention(2, 2, 8, "float8_e4m3fn",
                                                                    scales="token"),))
    assert Namespace("m", other).group(0).fingerprint != Namespace("m", cache()).group(0).fingerprint
    assert Namespace.from_dict(a.to_dict()) == a
    # Another TP size shards the attention group differently; the latent is still one copy.
    tp4 = cache(groups=(CacheGroup.attention(2, 1, 24, v_head_dim=16),) + cache().groups[1:])
    c = Namespace("m", tp4, tp_rank=3, tp_size=4)
    assert c.group(1).fingerprint == a.group(1).fingerprint
    assert c.group(0).fingerprint != a.group(0).fingerprint
    assert Namespace("m", cache(), revision="r2").group(1).fingerprint != a.group(1).fingerprint


def test_snapshot_keys_differ_per_block_and_from_real_blocks():
    ns = Namespace("m", cache()).group(3)
    keys = snapshot_keys(ns, [b"a" * 16, b"b" * 16])
    assert len(set(keys)) == 2


@pytest.mark.parametrize("bad, match", [
    (lambda: CacheGroup("nope", 1, (CachePart("x", (1,)),)), "kind"),
    (lambda: CacheGroup(GroupKind.WINDOW, 1, (CachePart("k", (1, 2)), CachePart("v", (1, 2)))),
     "window_tokens"),
    (lambda: CacheGroup(GroupKind.ATTENTION, 1, (CachePart("x", (1,)),)), "'k' and 'v'"),
    (lambda: CachePart("x", (0,)), "shape"),
    (lambda: CachePart("x", (2,), "int4"), "dtype"),
    (lambda: CacheSpec((CacheGroup.state(1, {"s": ((4,), "float32")}),), 2), "at least 4"),
    (lambda: CacheGroup.attention(1, 2, 8, scales="row"), "scales"),
])
def test_bad_groups_are_refused_by_name(bad, match):
    with pytest.raises(InvalidArgument, match=match):
        bad()


def test_pack_checks_parts():
    group = cache().groups[0]
    parts = parts_of(group, 2 * BT)
    with pytest.raises(InvalidArgument, match="takes parts"):
        group.pack({"k": parts["k"]}, BT)
    with pytest.raises(InvalidArgument, match="shape"):
        group.pack({"k": parts["k"], "v": parts["k"]}, BT)
    with pytest.raises(InvalidArgument, match="float16"):
        group.pack({"k": parts["k"].half(), "v": parts["v"]}, BT)
