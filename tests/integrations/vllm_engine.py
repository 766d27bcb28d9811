"""Runs in the vLLM venv: build a tiny random-weight Llama with a word-level tokenizer, or
generate greedily through the kvstore connector and write the outputs as JSON.

    python vllm_engine.py build MODEL_DIR
    python vllm_engine.py generate MODEL_DIR ADDRESS PROMPTS_JSON OUT_JSON
"""

from __future__ import annotations

import json
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


def generate(model: str, address: str, prompts: list[list[int]], out: Path) -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from kvstore.integrations.vllm import namespace_for

    llm = LLM(model=model, enforce_eager=True, block_size=BLOCK_SIZE, max_model_len=1024,
              dtype="float32", enable_prefix_caching=False, max_num_seqs=4, seed=0,
              kv_transfer_config=KVTransferConfig(
                  kv_connector="KVStoreConnector", kv_role="kv_both",
                  kv_load_failure_policy="recompute",
                  kv_connector_module_path="kvstore.integrations.vllm",
                  kv_connector_extra_config={"address": address, "revision": "r1"}))
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


if __name__ == "__main__":  # the engine starts its workers by spawn
    if sys.argv[1] == "build":
        build(Path(sys.argv[2]))
    else:
        generate(sys.argv[2], sys.argv[3], json.loads(Path(sys.argv[4]).read_text()),
                 Path(sys.argv[5]))
