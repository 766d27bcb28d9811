"""One vLLM engine of ``kvstore bench engine``, run in the engine's own venv: built from the
JSON spec in ``argv[1]``, then one JSON command a line on stdin, one JSON reply a line on stdout.

    python -m kvstore.bench.engine.worker SPEC_JSON
    python -m kvstore.bench.engine.worker build MODEL_DIR CONFIG_JSON DEVICE

Replies go to a copy of the original stdout; fd 1 itself is pointed at stderr before vLLM is
imported, so nothing vLLM or its children print can interleave with a reply. The first reply
is ``{"ready": true, "init_s": ...}`` or ``{"error": "..."}`` (the engine did not start: the
bench shows the message in that configuration's row). Commands:

- ``{"op": "generate", "prompts": [[ids...], ...], "max_tokens": n}``: the prompts one at a
  time, each timed from ``add_request`` to the step that returns its first token; the reply
  holds per prompt its tokens, their log-probabilities, ``num_cached_tokens`` and ``ttft_s``.
- ``{"op": "reset"}``: empty vLLM's prefix cache (after the warm-up prompts).
- ``{"op": "exit"}``: shut the engine down and leave.

Only the standard library, vLLM and ``weights.py`` are imported here (vLLM loads the kvstore
connector from ``kv_connector_module_path``, this checkout being on PYTHONPATH).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from kvstore.bench.engine.weights import init_weights


def engine_kwargs(spec: dict[str, Any]) -> dict[str, Any]:
    """``LLM(...)`` arguments of one configuration (``configs.worker_spec``)."""
    kwargs: dict[str, Any] = {
        "model": spec["model_dir"], "load_format": spec["load_format"],
        "skip_tokenizer_init": True, "enforce_eager": True, "dtype": spec["dtype"], "seed": 0,
        "block_size": spec["block_size"], "max_model_len": spec["max_model_len"],
        "max_num_seqs": 4, "enable_prefix_caching": spec["prefix_caching"],
    }
    if spec.get("num_blocks") is not None:
        kwargs["num_gpu_blocks_override"] = spec["num_blocks"]
    if spec.get("gpu_memory_utilization") is not None:
        kwargs["gpu_memory_utilization"] = spec["gpu_memory_utilization"]
    if spec.get("offload_gib") is not None:
        kwargs["kv_offloading_size"] = spec["offload_gib"]
    if spec.get("kv_transfer") is not None:
        from vllm.config import KVTransferConfig

        kwargs["kv_transfer_config"] = KVTransferConfig(**spec["kv_transfer"])
    return kwargs


def build(spec: dict[str, Any]) -> Any:
    """The engine; with ``redraw``, its dummy weights drawn again (``init_weights``)."""
    for module in spec.get("requires", ()):
        __import__(module)  # an optional connector's package: a clear ImportError up front
    from vllm import LLM

    llm = LLM(**engine_kwargs(spec))
    if spec["redraw"]:
        llm.apply_model(init_weights)  # by reference: the engine's processes import it
        llm.reset_prefix_cache()  # nothing computed with the dummy weights may be reused
    return llm


def build_checkpoint(model_dir: str, config: dict[str, Any], device: str) -> None:
    """A random-init ``LlamaForCausalLM`` checkpoint (transformers' initializer, std 0.02) of
    ``config`` in ``model_dir``, drawn on ``device``: what every engine of a run loads."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    dtype = getattr(torch, config["torch_dtype"])
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**config)).to(dtype)
    model.save_pretrained(model_dir, safe_serialization=True)


def generate_one(llm: Any, request_id: str, ids: list[int], max_tokens: int) -> dict[str, Any]:
    """One greedy request through the engine's own step loop, so the first token is seen when
    it is produced (``LLM.generate`` returns only finished requests)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=1,
                            ignore_eos=True, detokenize=False,
                            output_kind=RequestOutputKind.DELTA)
    engine = llm.llm_engine
    tokens: list[int] = []
    logprobs: list[float] = []
    ttft_s, cached = None, 0
    start = time.perf_counter()
    engine.add_request(request_id, {"prompt_token_ids": ids}, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            sample = out.outputs[0]
            if ttft_s is None and sample.token_ids:
                ttft_s = time.perf_counter() - start
            tokens += sample.token_ids
            logprobs += [lp[t].logprob for lp, t in zip(sample.logprobs or (),
                                                        sample.token_ids, strict=False)]
            cached = max(cached, out.num_cached_tokens or 0)
    return {"tokens": tokens, "logprobs": logprobs, "num_cached_tokens": cached,
            "ttft_s": ttft_s}


def serve(llm: Any, reply: Any) -> None:
    """Answer commands from stdin until ``exit`` or its end."""
    served = 0
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "exit":
            return
        if command["op"] == "reset":  # drop what warm-up prompts left in the prefix cache
            send(reply, {"reset": llm.reset_prefix_cache()})
            continue
        results = []
        for ids in command["prompts"]:
            served += 1
            results.append(generate_one(llm, f"bench-{served}", ids, command["max_tokens"]))
        send(reply, {"results": results})


def send(reply: Any, message: dict[str, Any]) -> None:
    reply.write(json.dumps(message) + "\n")
    reply.flush()


def main() -> int:
    if sys.argv[1] == "build":
        build_checkpoint(sys.argv[2], json.loads(sys.argv[3]), sys.argv[4])
        return 0
    spec = json.loads(sys.argv[1])
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # vLLM's prints and its children's go to the log, never into a reply
    if spec["redraw"]:
        # apply_model sends init_weights to the engine core's process: allowed for callables
        # only with this switch (the bench's own function, never input from elsewhere).
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    start = time.perf_counter()
    try:
        llm = build(spec)
    except Exception as exc:  # noqa: BLE001 - any failure to start is that row's answer
        send(reply, {"error": f"{type(exc).__name__}: {exc}"})
        return 1
    send(reply, {"ready": True, "init_s": time.perf_counter() - start})
    serve(llm, reply)
    llm.llm_engine.engine_core.shutdown()
    return 0


if __name__ == "__main__":  # the engine starts its processes by spawn
    sys.exit(main())
