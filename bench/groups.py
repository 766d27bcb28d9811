"""Cache groups: a grouped lookup's cost against a plain one, and which transformers
architectures the adapter handles.

    PYTHONPATH=. python bench/groups.py lookup     # embedded store, one JSON line per case
    PYTHONPATH=. python bench/groups.py adapter Llama Qwen3Next Jamba ...   # one line per model

``adapter`` builds each ``<Name>ForCausalLM`` from its (text) config's defaults with the size
fields shrunk (a generic shrink: a model whose tiny config its own ``generate`` rejects is
reported as PLAIN, not as an adapter failure), generates 20 tokens of a 70-token prompt without
and with the store (cold, then warm), and reports whether the tokens match, the groups, the
tokens reused and the warm first logits' distance from one forward pass over the prompt.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from kvstore.groups import CacheGroup, CacheSpec
from kvstore.keys import Namespace, block_keys, snapshot_keys, snapshot_tokens
from kvstore.spec import KVSpec
from tests.server.helpers import MiB, short_tmpdir, small_config

BT = 16
NUM_TOKENS = 32768
RUNS = 15


async def _timed(store, ns, tokens) -> tuple[int, float]:
    times, matched = [], 0
    for _ in range(RUNS):
        start = time.perf_counter()
        matched = (await store.lookup(ns, tokens)).matched_tokens
        times.append(time.perf_counter() - start)
    return matched, statistics.median(times) * 1e3


async def lookup() -> None:
    from kvstore.store import Store

    root = short_tmpdir()
    try:
        async with Store(small_config(Path(root), dram_bytes=1024 * MiB)) as store:
            tokens = np.random.default_rng(0).integers(0, 50_000, NUM_TOKENS).astype(np.uint32)
            n = NUM_TOKENS // BT
            plain = Namespace("m", KVSpec(2, 2, 8, BT))
            await store.put(plain, tokens, torch.zeros(plain.spec.shape(NUM_TOKENS),
                                                       dtype=torch.bfloat16))
            window = 4096
            spec = CacheSpec((CacheGroup.attention(2, 2, 8),
                              CacheGroup.latent(2, [("kv", 16, "bfloat16")]),
                              CacheGroup.attention(2, 2, 8, window_tokens=window),
                              CacheGroup.state(2, {"s": ((64,), "float32")})), BT)
            ns = Namespace("m", spec)
            for g in (0, 1):
                gns = ns.group(g)
                await store.put(gns, tokens, torch.zeros(gns.spec.shape(NUM_TOKENS),
                                                         dtype=gns.spec.torch_dtype))
            # Window blocks of the last two snapshots' prefixes, a snapshot every 16 blocks.
            for g, blocks in ((2, range(n - window // BT - 16, n)), (3, range(BT - 1, n, 16))):
                gns = ns.group(g)
                chain = block_keys(gns, tokens)
                for b in blocks:
                    await store.put(gns, snapshot_tokens(chain[b], BT), torch.zeros(
                        gns.spec.shape(BT), dtype=gns.spec.torch_dtype))
            cases = [("plain KVSpec", plain), ("4 groups, whole at the end", ns)]
            for label, target in cases:
                matched, p50 = await _timed(store, target, tokens)
                print(json.dumps({"case": label, "tokens": NUM_TOKENS, "matched": matched,
                                  "p50_ms": round(p50, 2)}))
            state = ns.group(3)
            await store.evict(keys=snapshot_keys(state, [block_keys(state, tokens)[n - 1]]))
            matched, p50 = await _timed(store, ns, tokens)
            print(json.dumps({"case": "4 groups, last snapshot evicted", "tokens": NUM_TOKENS,
                              "matched": matched, "p50_ms": round(p50, 2)}))
    finally:
        shutil.rmtree(root, ignore_errors=True)


SMALL = {
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "max_position_embeddings": 1024, "sliding_window": 24, "num_experts": 4,
    "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
    "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
    "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 16,
    "linear_value_head_dim": 16, "mamba_d_state": 8, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_n_heads": 8,
    "mamba_d_head": 16, "mamba_n_groups": 1, "mamba_dt_rank": 8, "use_mamba_kernels": False,
    "ssm_state_size": 8, "n_groups": 1, "mamba_head_dim": 16, "mamba_num_heads": 8, "expand": 2,
    "conv_kernel": 4, "state_size": 8, "num_heads": 8, "mamba_chunk_size": 16, "chunk_size": 16,
    "global_head_dim": 16, "first_k_dense_replace": 1, "n_shared_experts": 1, "attn_layer_period": 2,
    "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1}
LAYERS = 4


def _tiny(name: str) -> torch.nn.Module:
    import transformers

    config_cls = getattr(transformers, name + "TextConfig", None) or \
        getattr(transformers, name + "Config")
    config = config_cls()
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    for key, value in {**SMALL, "num_hidden_layers": LAYERS}.items():
        # A derived property, or a per-layer field a global read refuses: left as it is.
        with contextlib.suppress(Exception):
            if getattr(text, key, None) is not None:
                setattr(text, key, value)
    if (getattr(text, "pad_token_id", None) or 0) >= SMALL["vocab_size"]:
        text.pad_token_id = 0
    types = getattr(text, "layer_types", None)
    if isinstance(types, list) and len(types) >= LAYERS:  # every kind the default mixes
        kinds = list(dict.fromkeys(types))
        try:
            text.layer_types = [kinds[i % len(kinds)] for i in range(LAYERS)]
        except AttributeError:
            pass
    torch.manual_seed(0)
    return getattr(transformers, name + "ForCausalLM")(config).eval()


def adapter(names: list[str]) -> None:
    from kvstore.client import Client
    from kvstore.integrations.transformers import wrap
    from tests.server.helpers import DaemonThread

    greedy = {"do_sample": False, "return_dict_in_generate": True, "output_logits": True}
    root = short_tmpdir()
    try:
        with DaemonThread(small_config(Path(root))) as daemon, \
                Client(daemon.unix_address) as client:
            for name in names:
                row: dict[str, object] = {"model": name}
                try:
                    model = _tiny(name)
                    ids = torch.randint(0, 512, (1, 70),
                                        generator=torch.Generator().manual_seed(1))
                    try:
                        plain = model.generate(ids, max_new_tokens=20, **greedy)
                    except Exception as exc:  # noqa: BLE001  # the tiny config, not the adapter
                        row["result"] = f"PLAIN {type(exc).__name__}"
                        continue
                    cached = wrap(model, client, revision="r")
                    cold = cached.generate(ids, max_new_tokens=20, **greedy)
                    warm = cached.generate(ids, max_new_tokens=20, **greedy)
                    with torch.no_grad():
                        reference = model(input_ids=ids).logits[:, -1]
                    same = torch.equal(cold.sequences, plain.sequences) and \
                        torch.equal(warm.sequences, plain.sequences)
                    row.update(result="OK" if same else "DIFF",
                               groups=sorted({g.kind.value for g in cached.layout.groups}),
                               reused=cached.last_stats.num_reused_tokens,
                               warm_logit_err=float((warm.logits[0] - reference).abs().max()))
                except Exception as exc:  # noqa: BLE001  # a survey reports every failure
                    row["result"] = f"ADAPTER {type(exc).__name__}: {str(exc)[:120]}"
                finally:
                    print(json.dumps(row))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["lookup"]:
        asyncio.run(lookup())
    elif sys.argv[1:2] == ["adapter"]:
        adapter(sys.argv[2:])
    else:
        raise SystemExit(__doc__)
