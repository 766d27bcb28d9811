"""The transformers adapter against a real daemon: tiny random-weight Llama, Qwen2, Qwen3 and
Mistral models generate the same tokens and first-step logits with the store as without it."""

from __future__ import annotations

import shutil

import pytest
import torch

pytest.importorskip("transformers", minversion="5.17")

from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from kvstore.client import Client
from kvstore.errors import InvalidArgument
from kvstore.integrations.transformers import namespace_for, wrap
from tests.server.helpers import DaemonThread, MiB, short_tmpdir, small_config

VOCAB = 512
# Grouped-query attention everywhere: 4 query heads share 2 KV heads.
COMMON = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 1024}
MODELS = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 16}),
    # A window shorter than the prompts: only the window's blocks are stored.
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": 48}),
}
GREEDY = {"do_sample": False, "return_dict_in_generate": True, "output_logits": True}


def tiny_model(name: str, seed: int = 0, **overrides: object) -> torch.nn.Module:
    config_cls, model_cls, extra = MODELS[name]
    torch.manual_seed(seed)
    return model_cls(config_cls(**{**COMMON, **extra, **overrides})).eval()


def prompt(n: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (1, n), generator=g)


def assert_same_generation(plain: object, stored: object) -> None:
    assert torch.equal(plain.sequences, stored.sequences)
    torch.testing.assert_close(stored.logits[0], plain.logits[0], rtol=1e-3, atol=1e-5)


@pytest.fixture
def root():
    path = short_tmpdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def client(root):
    with DaemonThread(small_config(root)) as daemon, Client(daemon.unix_address) as kv:
        yield kv


@pytest.mark.parametrize("name", sorted(MODELS))
def test_generation_with_the_store_equals_generation_without(name, client):
    model = tiny_model(name)
    ids = prompt(70)
    plain = model.generate(ids, max_new_tokens=40, **GREEDY)
    cached = wrap(model, client, revision="r1")

    cold = cached.generate(ids, max_new_tokens=40, **GREEDY)
    assert_same_generation(plain, cold)
    assert cached.last_stats.num_reused_tokens == 0
    # 64 prompt tokens after prefill, then the blocks decoding filled: 110 tokens -> 96. A
    # sliding window (Mistral's 48 tokens) stores only the blocks of each saved prefix's window:
    # blocks 1-3 for 64 tokens, then block 4 for 80 and block 5 for 96.
    assert cached.last_stats.num_saved_tokens == (80 if name == "mistral" else 96)

    warm = cached.generate(ids, max_new_tokens=40, **GREEDY)
    assert_same_generation(plain, warm)
    assert cached.last_stats.num_reused_tokens == 64
    assert cached.last_stats.reused_tokens_per_tier == {"dram": 64}
    assert cached.last_stats.num_saved_tokens == 0

    # The next turn's prompt is the whole first exchange: the blocks decoding saved are reused.
    turn = torch.cat([plain.sequences, prompt(20, seed=2)], dim=1)
    plain2 = model.generate(turn, max_new_tokens=8, **GREEDY)
    warm2 = cached.generate(turn, max_new_tokens=8, **GREEDY)
    assert_same_generation(plain2, warm2)
    assert cached.last_stats.num_reused_tokens == 96
    assert cached.last_stats.num_prompt_tokens == 130


def test_prefix_survives_a_daemon_restart(root):
    """After a restart the prefix comes from SSD (persisted on shutdown) and gives the same
    tokens."""
    model = tiny_model("llama")
    ids = prompt(100)
    plain = model.generate(ids, max_new_tokens=10, **GREEDY)
    config = small_config(root)
    with DaemonThread(config) as daemon, Client(daemon.unix_address) as kv:
        wrap(model, kv, revision="r1").generate(ids, max_new_tokens=10, **GREEDY)
    with DaemonThread(config) as daemon, Client(daemon.unix_address) as kv:
        cached = wrap(model, kv, revision="r1")
        assert_same_generation(plain, cached.generate(ids, max_new_tokens=10, **GREEDY))
        assert cached.last_stats.reused_tokens_per_tier == {"ssd": 96}


def test_prefix_split_across_dram_and_ssd(root):
    """A DRAM tier smaller than the prefix: the older blocks are demoted to SSD, and a prefix
    read from both tiers gives the same tokens. The client streams: a zero-copy get pins the
    whole prefix in DRAM, which holds only part of it here."""
    model = tiny_model("llama", num_hidden_layers=4, hidden_size=128, num_attention_heads=4,
                       intermediate_size=128)  # 64 KiB blocks: 1 MiB of DRAM holds ~15
    ids = prompt(600)
    plain = model.generate(ids, max_new_tokens=4, **GREEDY)
    with DaemonThread(small_config(root, dram_bytes=1 * MiB)) as daemon, \
            Client(daemon.unix_address, zero_copy=False) as kv:
        cached = wrap(model, kv, revision="r1")
        cached.generate(ids, max_new_tokens=4, **GREEDY)
        assert_same_generation(plain, cached.generate(ids, max_new_tokens=4, **GREEDY))
        per_tier = cached.last_stats.reused_tokens_per_tier
        assert per_tier.get("dram", 0) > 0 and per_tier.get("ssd", 0) > 0, per_tier
        assert sum(per_tier.values()) == 592


def test_revisions_and_tenants_never_share(client):
    model = tiny_model("qwen2")
    ids = prompt(80)
    wrap(model, client, revision="r1").generate(ids, max_new_tokens=2, **GREEDY)
    for other in (wrap(model, client, revision="r2"),
                  wrap(model, client, revision="r1", tenant="globex")):
        other.generate(ids, max_new_tokens=2, **GREEDY)
        assert other.last_stats.num_reused_tokens == 0
    again = wrap(model, client, revision="r1")
    again.generate(ids, max_new_tokens=2, **GREEDY)
    assert again.last_stats.num_reused_tokens == 64


def test_namespace_follows_the_model_config():
    base = namespace_for(tiny_model("llama"), revision="r1")
    assert base.spec.num_kv_heads == 2 and base.spec.head_dim == 16
    assert base.spec.dtype == "float32"
    for other in (tiny_model("llama", rope_theta=1234.0), tiny_model("qwen2"),
                  tiny_model("llama").to(torch.bfloat16)):
        assert namespace_for(other, revision="r1").fingerprint != base.fingerprint


def test_padded_batches_are_refused(client):
    cached = wrap(tiny_model("llama"), client, revision="r1")
    with pytest.raises(InvalidArgument, match="shape"):
        cached.generate(prompt(40).repeat(2, 1), max_new_tokens=1)
    mask = torch.ones(1, 40, dtype=torch.long)
    mask[0, 0] = 0
    with pytest.raises(InvalidArgument, match="attention_mask"):
        cached.generate(prompt(40), attention_mask=mask, max_new_tokens=1)
