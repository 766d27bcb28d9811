"""The transformers adapter's device path against a real daemon: hits decoded by EngineCache into
the wrapper's device buffer, saves encoded from it. On CUDA the model runs there; without it the
path is forced on CPU tensors and the kernels run in Triton's interpreter (TRITON_INTERPRET=1)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

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
)

import kvstore.integrations.transformers as adapter
from kvstore.client import Client
from kvstore.client.engine import EngineCache
from kvstore.codecs.triton.common import kernels_runnable
from kvstore.config import DramConfig, HbmConfig, TierConfig
from kvstore.errors import InvalidArgument
from kvstore.integrations import transformers_device
from kvstore.integrations.transformers import wrap
from tests.server.helpers import DaemonThread, MiB, short_tmpdir, small_config

DEVICE = "cuda:0" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not kernels_runnable(torch.device(DEVICE)),
                                reason="needs CUDA or TRITON_INTERPRET=1")
REPO = Path(__file__).resolve().parents[2]
VOCAB = 512
COMMON = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 1024}
MODELS = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}
GREEDY = {"do_sample": False, "return_dict_in_generate": True, "output_logits": True}


def tiny_model(name: str = "llama", dtype: torch.dtype = torch.bfloat16,
               **overrides: object) -> torch.nn.Module:
    config_cls, model_cls = MODELS[name]
    torch.manual_seed(0)
    return model_cls(config_cls(**{**COMMON, **overrides})).to(DEVICE, dtype).eval()


def prompt(n: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (1, n), generator=g).to(DEVICE)


def assert_same_generation(plain, stored) -> None:
    assert torch.equal(plain.sequences, stored.sequences)
    torch.testing.assert_close(stored.logits[0], plain.logits[0], rtol=2e-2, atol=2e-2)


def with_hbm(config):
    return dataclasses.replace(config, tiers=(
        TierConfig("gpu", "hbm", HbmConfig(capacity_bytes=4 * MiB, device=DEVICE)),
        TierConfig("host", "dram", DramConfig(capacity_bytes=8 * MiB, chunk_bytes=MiB)),
    ))


@pytest.fixture
def root():
    path = short_tmpdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def client(root):
    with DaemonThread(small_config(root)) as daemon, Client(daemon.unix_address) as kv:
        yield kv


@pytest.mark.parametrize(("name", "tiers"), [("llama", "dram"), ("qwen2", "dram"),
                                             ("llama", "hbm")])
def test_generation_on_the_device_path_equals_plain_generation(root, name, tiers):
    model = tiny_model(name)
    ids = prompt(70)
    plain = model.generate(ids, max_new_tokens=20, **GREEDY)
    config = small_config(root)
    with DaemonThread(with_hbm(config) if tiers == "hbm" else config) as daemon, \
            Client(daemon.unix_address) as kv:
        cached = wrap(model, kv, revision="r1", device_path=True)
        assert cached.device_kv is not None
        cold = cached.generate(ids, max_new_tokens=20, **GREEDY)
        assert_same_generation(plain, cold)
        assert cached.last_stats.num_reused_tokens == 0
        assert cached.last_stats.num_saved_tokens == 80  # 90 tokens held: five whole blocks

        warm = cached.generate(ids, max_new_tokens=20, **GREEDY)
        assert_same_generation(plain, warm)
        assert cached.last_stats.num_reused_tokens == 64
        assert cached.last_stats.reused_tokens_per_tier == {"gpu" if tiers == "hbm" else
                                                            "dram": 64}
        assert cached.last_stats.num_saved_tokens == 0
        cached.close()
        stats = kv.stats()
        assert stats.active_leases == 0 and stats.active_reservations == 0


def test_a_longer_prompt_reuses_the_stored_prefix_and_grows_the_buffer(client, monkeypatch):
    """Saves go in pieces of two blocks here (SAVE_PIECE_BYTES), each behind the last."""
    model = tiny_model()
    ids = prompt(40)
    cached = wrap(model, client, revision="r1", device_path=True)
    monkeypatch.setattr(transformers_device, "SAVE_PIECE_BYTES",
                        2 * cached.namespace.spec.block_bytes)
    first = cached.generate(ids, max_new_tokens=10, **GREEDY)
    assert cached.last_stats.num_saved_tokens == 48
    turn = torch.cat([first.sequences, prompt(60, seed=2)], dim=1)  # 110 tokens
    plain = model.generate(turn, max_new_tokens=4, **GREEDY)
    warm = cached.generate(turn, max_new_tokens=4, **GREEDY)
    assert_same_generation(plain, warm)
    assert cached.last_stats.num_reused_tokens == 48  # the first call's blocks, decoding's too
    assert cached.last_stats.num_saved_tokens == 112 - 48
    assert cached.device_kv.capacity_tokens >= 112
    again = cached.generate(turn, max_new_tokens=4, **GREEDY)
    assert_same_generation(plain, again)
    assert cached.last_stats.num_reused_tokens == 96  # the last whole block before the last token


def test_a_prefix_evicted_after_the_load_is_saved_whole_again(client, monkeypatch):
    """Regression: a save from the first new block needs the blocks before it stored; when
    they went between the load and the save (NotFound), the whole prefix is saved from the
    buffer, which still holds it."""
    model = tiny_model()
    ids = prompt(70)
    cached = wrap(model, client, revision="r1", device_path=True)
    cached.generate(ids, max_new_tokens=1, **GREEDY)
    load = transformers_device.DeviceKV.load

    def load_then_evict(self, *args):
        out = load(self, *args)
        client.evict(namespace=cached.namespace)
        return out

    monkeypatch.setattr(transformers_device.DeviceKV, "load", load_then_evict)
    longer = torch.cat([ids, prompt(30, seed=3)], dim=1)  # 100 tokens: 64 loaded, 96 saved
    plain = model.generate(longer, max_new_tokens=1, **GREEDY)
    assert_same_generation(plain, cached.generate(longer, max_new_tokens=1, **GREEDY))
    assert cached.last_stats.num_reused_tokens == 64
    assert cached.last_stats.num_saved_tokens == 96
    assert client.lookup(cached.namespace, longer[0].tolist()).matched_tokens == 96


@pytest.mark.parametrize(("codec", "head_dim", "tolerance"), [
    ("fp8_e4m3", 32, 0.05), ("nvfp4", 32, 0.2),
    # Heads of 16: a block's fp4 scales (128 bytes) are padded apart from the tensor scales
    # on the device, as a real model's are not; such pages load through get.
    ("nvfp4", 16, 0.2)])
def test_lossy_dram_pages_load_within_tolerance(root, codec, head_dim, tolerance):
    model = tiny_model(hidden_size=4 * head_dim)
    ids = prompt(70)
    plain = model.generate(ids, max_new_tokens=1, **GREEDY)
    config = small_config(root)
    config = dataclasses.replace(config, dram=dataclasses.replace(config.dram, codec=codec))
    with DaemonThread(config) as daemon, Client(daemon.unix_address) as kv:
        cached = wrap(model, kv, revision="r1", device_path=True)
        cached.generate(ids, max_new_tokens=1, **GREEDY)
        warm = cached.generate(ids, max_new_tokens=1, **GREEDY)
        assert cached.last_stats.reused_tokens_per_tier == {"dram": 64}
        # e4m3 keeps 3 mantissa bits, e2m1 one: the first logits move, but by little.
        diff = (warm.logits[0].float() - plain.logits[0].float()).abs().max().item()
        assert 0 < diff < tolerance, diff


CHILD = textwrap.dedent("""
    import json, sys, torch
    from tests.integrations.test_transformers_device import GREEDY, prompt, tiny_model
    from kvstore.client import Client
    from kvstore.integrations.transformers import wrap
    with Client(sys.argv[1]) as kv:
        cached = wrap(tiny_model(), kv, revision="r1", device_path=True)
        out = cached.generate(prompt(70), max_new_tokens=20, **GREEDY)
        stats = cached.last_stats
        cached.close()
    print(json.dumps({"reused": stats.num_reused_tokens, "tiers": stats.reused_tokens_per_tier,
                      "sequences": out.sequences[0].tolist()}))
""")


def test_a_wrapper_in_a_fresh_process_hits_the_first_ones_blocks(root):
    model = tiny_model()
    ids = prompt(70)
    with DaemonThread(small_config(root)) as daemon, Client(daemon.unix_address) as kv:
        cached = wrap(model, kv, revision="r1", device_path=True)
        cold = cached.generate(ids, max_new_tokens=20, **GREEDY)
        cached.close()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO),
                                                            os.environ.get("PYTHONPATH", "")])}
        run = subprocess.run([sys.executable, "-c", CHILD, daemon.unix_address], cwd=REPO,
                             env=env, capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["reused"] == 64 and got["tiers"] == {"dram": 64}
    assert got["sequences"] == cold.sequences[0].tolist()


def _refuse(what: str):
    def refuse(*args, **kwargs):
        raise AssertionError(f"{what} called on the device path")
    return refuse


def _refuse_floats(original, what: str):
    def guarded(self, *args, **kwargs):
        if self.is_floating_point():
            raise AssertionError(f"{what} of a {self.dtype} tensor on the device path")
        return original(self, *args, **kwargs)
    return guarded


@pytest.mark.parametrize("device_path", [True, False])
def test_no_kv_goes_through_host_tensors_on_the_device_path(client, monkeypatch, device_path):
    """A warm call (no block to save) may not read the prefix into host tensors, nor copy or
    view K/V on the host; a cold call saves through EngineCache, never the host copy of the
    cache. The host path (False) trips the same traps: the check can fail."""
    model = tiny_model()
    ids = prompt(70)
    cached = wrap(model, client, revision="r1", device_path=device_path)
    saves = []
    monkeypatch.setattr(EngineCache, "save", lambda self, *a, _save=EngineCache.save, **kw:
                        saves.append(1) or _save(self, *a, **kw))
    with monkeypatch.context() as trap:
        trap.setattr(adapter, "kv_from_cache", _refuse("kv_from_cache"))
        if device_path:
            cached.generate(ids, max_new_tokens=20, **GREEDY)
            assert saves and cached.last_stats.num_saved_tokens == 80
        else:
            with pytest.raises(AssertionError, match="kv_from_cache"):
                cached.generate(ids, max_new_tokens=20, **GREEDY)
    if not device_path:  # store the prefix the trap kept from being stored
        wrap(model, client, revision="r1", device_path=True).generate(ids, max_new_tokens=20,
                                                                      **GREEDY)
    with monkeypatch.context() as trap:
        trap.setattr(Client, "get", _refuse("Client.get"))
        trap.setattr(torch.Tensor, "cpu", _refuse_floats(torch.Tensor.cpu, "Tensor.cpu"))
        trap.setattr(torch.Tensor, "numpy", _refuse_floats(torch.Tensor.numpy, "Tensor.numpy"))
        if device_path:
            cached.generate(ids, max_new_tokens=4, **GREEDY)  # 73 tokens: no new block
            assert cached.last_stats.num_reused_tokens == 64
        else:
            with pytest.raises(AssertionError, match="Client.get"):
                cached.generate(ids, max_new_tokens=4, **GREEDY)


def test_the_device_path_is_chosen_where_it_can_run(client):
    auto = wrap(tiny_model(), client, revision="r1")
    assert (auto.device_kv is not None) == (DEVICE != "cpu")  # "auto": on CUDA
    windowed = MistralForCausalLM(MistralConfig(**COMMON, sliding_window=48)).to(
        DEVICE, torch.bfloat16)
    with pytest.raises(InvalidArgument, match="groups"):
        wrap(windowed, client, revision="r1", device_path=True)
    assert wrap(windowed, client, revision="r1").device_kv is None
    with pytest.raises(InvalidArgument, match="dtype"):
        wrap(tiny_model(dtype=torch.float32), client, revision="r1", device_path=True)
    with pytest.raises(InvalidArgument, match="device_path"):
        wrap(tiny_model(), client, revision="r1", device_path="yes")
    assert wrap(tiny_model(), client, revision="r1", device_path=False).device_kv is None
