"""Runs in the vLLM venv: build a tiny random-weight Llama with a word-level tokenizer, or
generate greedily through the kvstore connector and write the outputs as JSON.

    python vllm_engine.py build MODEL_DIR
    python vllm_engine.py generate MODEL_DIR ADDRESS PROMPTS_JSON OUT_JSON
    python vllm_engine.py copies ADDRESS

``copies`` drives the connector's own copy functions on caches laid out as vLLM's CPU backend
lays them out (no engine): a prefix saved in two steps from scattered blocks, then loaded into
other blocks whole and from its second block; it exits non-zero naming the first difference.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

VOCAB = 512
BLOCK_SIZE = 32


def build(out: Path) -> None:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "t0", "bos_token": "t1",
        "eos_token": "t2", "model_max_length": 2048}))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=2048, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(config).save_pretrained(out)


def generate(model: str, address: str, prompts: list[list[int]], out: Path,
             beside: str = "") -> None:
    """``beside``: a directory for vLLM's ExampleConnector, composed with kvstore's under
    vLLM's MultiConnector (kvstore first), as a P/D transport would be."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from kvstore.integrations.vllm import namespace_for

    ours = {"kv_connector": "KVStoreConnector",
            "kv_connector_module_path": "kvstore.integrations.vllm",
            "kv_connector_extra_config": {"address": address, "revision": "r1"}}
    if beside:
        transfer = KVTransferConfig(
            kv_connector="MultiConnector", kv_role="kv_both", kv_load_failure_policy="recompute",
            kv_connector_extra_config={"connectors": [
                {**ours, "kv_role": "kv_both", "kv_load_failure_policy": "recompute"},
                {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                 "kv_connector_extra_config": {"shared_storage_path": beside}}]})
    else:
        transfer = KVTransferConfig(kv_role="kv_both", kv_load_failure_policy="recompute",
                                    **ours)
    llm = LLM(model=model, enforce_eager=True, block_size=BLOCK_SIZE, max_model_len=1024,
              dtype="float32", enable_prefix_caching=False, max_num_seqs=4, seed=0,
              kv_cache_dtype=os.environ.get("KVSTORE_TEST_CACHE_DTYPE", "auto"),
              disable_log_stats=False,  # the connector's stats go through vLLM's logger
              kv_transfer_config=transfer)
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=1, ignore_eos=True)
    results = []
    for ids in prompts:  # one at a time: the time to first token of each
        start = time.perf_counter()
        first = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        elapsed = time.perf_counter() - start
        sample = first.outputs[0]
        results.append({
            "tokens": list(sample.token_ids),
            "logprobs": [lp[t].logprob for lp, t in zip(sample.logprobs, sample.token_ids)],
            "num_cached_tokens": first.num_cached_tokens, "seconds": elapsed})
    ns = namespace_for(llm.llm_engine.vllm_config)
    out.write_text(json.dumps({"results": results, "namespace": ns.to_dict()}))


def copies(address: str) -> None:
    import torch

    from kvstore.client import Client
    from kvstore.integrations.vllm_copies import block_views, gather_blocks, load_blocks
    from kvstore.keys import Namespace
    from kvstore.spec import KVSpec

    bs, heads, head_dim = BLOCK_SIZE, 2, 32
    spec = KVSpec(num_layers=2, num_kv_heads=heads, head_dim=head_dim, block_tokens=bs,
                  dtype="bfloat16")
    ns = Namespace(model_id="copies", spec=spec, revision="r1")
    g = torch.Generator().manual_seed(0)
    # vLLM 0.32's CPU layer cache: [num_blocks, H, block_size, 2 * head_dim]
    layers = [torch.randn(16, heads, bs, 2 * head_dim, generator=g).to(torch.bfloat16)
              for _ in range(spec.num_layers)]
    tokens, saved_ids = list(range(5 * bs)), [3, 4, 9, 10, 11]
    with Client(address) as client:
        views = block_views(layers, spec)
        client.put(ns, tokens[: 2 * bs], gather_blocks(views, spec, saved_ids[:2]))
        client.put(ns, tokens, gather_blocks(views, spec, saved_ids[2:]), first_block=2)
        for first_block, loaded_ids in ((0, [7, 1, 2, 0, 5]), (1, [15, 12, 13, 14, 6])):
            target = [torch.zeros_like(t) for t in layers]
            got = load_blocks(client, ns, block_views(target, spec), tokens, loaded_ids,
                              first_block)
            if got != 5:
                sys.exit(f"load from block {first_block}: {got} of 5 blocks stored")
            for i, (src, dst) in enumerate(zip(saved_ids, loaded_ids, strict=True)):
                for layer, (a, b) in enumerate(zip(layers, target, strict=True)):
                    if i >= first_block and not torch.equal(a[src], b[dst]):
                        sys.exit(f"block {i} layer {layer} differs after the load")
                    if i < first_block and b[dst].any():
                        sys.exit(f"block {i} before the first was written")


if __name__ == "__main__":  # the engine starts its workers by spawn
    if sys.argv[1] == "copies":
        copies(sys.argv[2])
    elif sys.argv[1] == "build":
        build(Path(sys.argv[2]))
    else:
        generate(sys.argv[2], sys.argv[3], json.loads(Path(sys.argv[4]).read_text()),
                 Path(sys.argv[5]), *sys.argv[6:7])
