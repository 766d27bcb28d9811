"""The transformers adapter on caches made of groups, against a real daemon: tiny random
DeepseekV3 (MLA latent), Qwen3Next (gated delta net + attention), Gemma3 (sliding + full),
GptOss (sliding with sinks) and Jamba (Mamba + attention) models generate what they generate
without the store, reuse a stored prefix, fall back when a state snapshot is gone, and never
share across revisions or adapters. The groups come from each model's config and cache
classes; nothing here names a model to the adapter."""

from __future__ import annotations

import shutil

import pytest
import torch

pytest.importorskip("transformers", minversion="5.17")

from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GptOssConfig,
    GptOssForCausalLM,
    JambaConfig,
    JambaForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

from kvstore.client import Client
from kvstore.groups import GroupKind
from kvstore.integrations.transformers import wrap
from kvstore.keys import block_keys, snapshot_keys
from tests.server.helpers import DaemonThread, short_tmpdir, small_config

VOCAB = 512
BASE = {"vocab_size": VOCAB, "hidden_size": 64, "max_position_embeddings": 1024}
MODELS = {
    "deepseek_v3": (DeepseekV3Config, DeepseekV3ForCausalLM, {
        "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 32,
        "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
        "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 1,
        "topk_group": 1, "first_k_dense_replace": 1}),
    "qwen3_next": (Qwen3NextConfig, Qwen3NextForCausalLM, {
        "intermediate_size": 128, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2}),
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM, {
        "intermediate_size": 128, "num_hidden_layers": 6, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "sliding_window": 24}),
    "gpt_oss": (GptOssConfig, GptOssForCausalLM, {
        "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 4,
        "num_experts_per_tok": 2, "sliding_window": 24}),
    "jamba": (JambaConfig, JambaForCausalLM, {
        "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "attn_layer_period": 2, "attn_layer_offset": 1,
        "expert_layer_period": 2, "expert_layer_offset": 1, "num_experts": 2,
        "mamba_d_state": 8, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_dt_rank": 8,
        "use_mamba_kernels": False}),
}
KINDS = {
    "deepseek_v3": {GroupKind.LATENT},
    "qwen3_next": {GroupKind.STATE, GroupKind.ATTENTION},
    "gemma3": {GroupKind.WINDOW, GroupKind.ATTENTION},
    "gpt_oss": {GroupKind.WINDOW, GroupKind.ATTENTION},
    "jamba": {GroupKind.STATE, GroupKind.ATTENTION},
}
STATEFUL = ("qwen3_next", "jamba")
GREEDY = {"do_sample": False, "return_dict_in_generate": True, "output_logits": True}


def tiny_model(name: str, seed: int = 0) -> torch.nn.Module:
    config_cls, model_cls, extra = MODELS[name]
    torch.manual_seed(seed)
    return model_cls(config_cls(**{**BASE, **extra})).eval()


def prompt(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def assert_same_generation(model: torch.nn.Module, ids: torch.Tensor, plain: object,
                           stored: object) -> None:
    """The same tokens as plain generation, and first logits those of one forward pass over
    the whole prompt. (Compared with that pass rather than with plain ``generate``'s: for
    Jamba's 120-token prompt transformers' ``generate`` itself is 4e-3 off its own forward
    pass, which the stored prefix's logits match to 1e-7.)"""
    assert torch.equal(plain.sequences, stored.sequences)
    with torch.no_grad():
        reference = model(input_ids=ids).logits[:, -1]
    torch.testing.assert_close(stored.logits[0], reference, rtol=1e-3, atol=1e-4)


@pytest.fixture
def client():
    root = short_tmpdir()
    try:
        with DaemonThread(small_config(root)) as daemon, Client(daemon.unix_address) as kv:
            yield kv
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_groups_come_from_the_config_and_cache_classes(name):
    cached = wrap(tiny_model(name), client=None, revision="r1")  # type: ignore[arg-type]
    assert cached.namespace.is_grouped
    assert {g.kind for g in cached.layout.groups} == KINDS[name]
    if name == "deepseek_v3":  # MLA's latent is the same on every TP rank: one copy
        assert all(g.is_replicated for g in cached.layout.groups)
    for group in cached.layout.groups:
        if group.kind is GroupKind.WINDOW:
            assert group.window_tokens == 24


@pytest.mark.parametrize("name", sorted(MODELS))
def test_generation_with_the_store_equals_generation_without(name, client):
    model = tiny_model(name)
    ids = prompt(70)
    plain = model.generate(ids, max_new_tokens=30, **GREEDY)
    cached = wrap(model, client, revision="r1")

    cold = cached.generate(ids, max_new_tokens=30, **GREEDY)
    assert_same_generation(model, ids, plain, cold)
    assert cached.last_stats.num_reused_tokens == 0
    assert cached.last_stats.num_saved_tokens > 0

    warm = cached.generate(ids, max_new_tokens=30, **GREEDY)
    assert_same_generation(model, ids, plain, warm)
    assert cached.last_stats.num_reused_tokens == 64

    # A prompt extending the first exchange reuses what decoding saved (96 tokens: 99 were
    # generated into the cache; a state model saved its snapshots at 64, 80 and 96).
    turn = torch.cat([plain.sequences, prompt(20, seed=2)], dim=1)
    plain2 = model.generate(turn, max_new_tokens=8, **GREEDY)
    warm2 = cached.generate(turn, max_new_tokens=8, **GREEDY)
    assert_same_generation(model, turn, plain2, warm2)
    assert cached.last_stats.num_reused_tokens == 96


@pytest.mark.parametrize("name", STATEFUL)
def test_a_hit_whose_snapshot_was_evicted_falls_back(name, client):
    model = tiny_model(name)
    ids = prompt(70)
    cached = wrap(model, client, revision="r1")
    first = cached.generate(ids, max_new_tokens=30, **GREEDY)
    turn = torch.cat([first.sequences, prompt(20, seed=2)], dim=1)
    ns = cached.namespace
    state = next(i for i, g in enumerate(ns.cache.groups) if g.kind is GroupKind.STATE)
    gns = ns.group(state)
    chain = block_keys(gns, turn[0].tolist())
    assert client.evict(keys=snapshot_keys(gns, [chain[5]])) == 1  # the snapshot at 96

    plain = model.generate(turn, max_new_tokens=8, **GREEDY)
    fallback = cached.generate(turn, max_new_tokens=8, **GREEDY)
    assert_same_generation(model, turn, plain, fallback)
    assert cached.last_stats.num_reused_tokens == 80  # the last snapshot still stored


@pytest.mark.parametrize("name", ["qwen3_next", "gemma3"])
def test_another_revision_or_adapter_reuses_nothing(name, client):
    model = tiny_model(name)
    ids = prompt(70)
    wrap(model, client, revision="r1").generate(ids, max_new_tokens=2, **GREEDY)
    for other in (wrap(model, client, revision="r2"),
                  wrap(model, client, revision="r1", adapter_id="lora-a@1")):
        other.generate(ids, max_new_tokens=2, **GREEDY)
        assert other.last_stats.num_reused_tokens == 0
    again = wrap(model, client, revision="r1")
    again.generate(ids, max_new_tokens=2, **GREEDY)
    assert again.last_stats.num_reused_tokens == 64


def test_a_model_with_a_cache_of_its_own_is_refused_by_name():
    """MiniMax keeps its lightning-attention state in a cache class of its own, which the
    adapter cannot read groups from: a clear error at wrap, not an exception inside generate."""
    from transformers import MiniMaxConfig, MiniMaxForCausalLM

    from kvstore.errors import InvalidArgument

    torch.manual_seed(0)
    model = MiniMaxForCausalLM(MiniMaxConfig(
        **BASE, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=2, num_experts_per_tok=1)).eval()
    with pytest.raises(InvalidArgument, match="MiniMaxForCausalLM does not fill a DynamicCache"):
        wrap(model, client=None, revision="r1")  # type: ignore[arg-type]
