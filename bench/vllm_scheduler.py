"""The vLLM connector's host time per scheduler step, with many requests running.

    PYTHONPATH=. python bench/vllm_scheduler.py --requests 256 --prompt-tokens 32768 --steps 64

Runs in a python with vLLM (0.32 on a CPU, 0.26 on CUDA): the scheduler side only, no model
runs. A daemon is started (or ``--address`` names one); ``--requests`` prompts are admitted (each
asked ``get_num_new_matched_tokens`` until its lookup is answered, then allocated and scheduled
in one step that computes the whole prompt), then ``--steps`` decode steps schedule one token
for every request, as a decode batch does: each step the connector plans the saves of the
blocks its requests completed (``build_connector_meta``). Prints the median and worst host
time per decode step and per admitted request, and writes JSON with ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BLOCK_SIZE = 16


def write_model(path: Path) -> str:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
        "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 32000,
        "max_position_embeddings": 1 << 17, "rms_norm_eps": 1e-5, "dtype": "bfloat16"}))
    return str(path)


def run(args, address: str) -> dict:
    from vllm import SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
    from vllm.v1.request import Request

    from kvstore.integrations.vllm import KVStoreConnector

    model = write_model(Path(tempfile.mkdtemp()) / "model")
    config = EngineArgs(
        model=model, block_size=BLOCK_SIZE, max_model_len=args.prompt_tokens + args.steps + 64,
        enforce_eager=True, skip_tokenizer_init=True,
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVStoreConnector", kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_module_path="kvstore.integrations.vllm",
            kv_connector_extra_config={"address": address, "revision": "bench"}),
    ).create_engine_config()
    connector = KVStoreConnector(config, KVConnectorRole.SCHEDULER)
    requests = [Request(f"r{i}", [3 + (i * 7919 + j) % 31000 for j in range(args.prompt_tokens)],
                        SamplingParams(max_tokens=args.steps + 1), None)
                for i in range(args.requests)]
    blocks_per_req = (args.prompt_tokens + args.steps) // BLOCK_SIZE + 2
    admit: list[float] = []
    for request in requests:
        t = time.perf_counter()
        while connector.get_num_new_matched_tokens(request, 0)[0] is None:
            time.sleep(0.001)  # the lookup runs past its deadline: vLLM asks next step
        connector.update_state_after_alloc(request, None, 0)
        admit.append(time.perf_counter() - t)
    first = SchedulerOutput.make_empty()
    first.scheduled_new_reqs = [NewRequestData.from_request(
        r, (list(range(i * blocks_per_req, (i + 1) * blocks_per_req)),))
        for i, r in enumerate(requests)]
    first.num_scheduled_tokens = {r.request_id: args.prompt_tokens for r in requests}
    t = time.perf_counter()
    connector.build_connector_meta(first)
    prefill_step = time.perf_counter() - t
    steps: list[float] = []
    save_steps: list[float] = []  # the steps that completed blocks (every request's at once)
    saves = 0
    for step in range(args.steps):
        for r in requests:
            r.append_output_token_ids(5 + step)
        out = SchedulerOutput.make_empty()
        ids = [r.request_id for r in requests]
        out.scheduled_cached_reqs = CachedRequestData(
            req_ids=ids, resumed_req_ids=set(), new_token_ids=[[] for _ in ids],
            all_token_ids={}, new_block_ids=[None for _ in ids],
            num_computed_tokens=[args.prompt_tokens + step for _ in ids],
            num_output_tokens=[step + 1 for _ in ids])
        out.num_scheduled_tokens = dict.fromkeys(ids, 1)
        t = time.perf_counter()
        meta = connector.build_connector_meta(out)
        steps.append(time.perf_counter() - t)
        saves += len(meta.saves)
        if meta.saves:
            save_steps.append(steps[-1])
    for r in requests:
        connector.request_finished(r, [])
    connector.shutdown()
    return {"requests": args.requests, "prompt_tokens": args.prompt_tokens,
            "decode_steps": args.steps, "saves_planned": saves,
            "decode_step_ms_median": statistics.median(steps) * 1e3,
            "decode_step_ms_max": max(steps) * 1e3,
            "save_step_ms_median": statistics.median(save_steps) * 1e3 if save_steps else 0.0,
            "saves_per_save_step": saves / max(1, len(save_steps)),
            "prefill_step_ms": prefill_step * 1e3,
            "admit_ms_median": statistics.median(admit) * 1e3, "admit_ms_max": max(admit) * 1e3}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt-tokens", type=int, default=32768)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--address", default="")
    ap.add_argument("--daemon-python", default=sys.executable)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    daemon = None
    address = args.address
    if not address:
        root = Path(tempfile.mkdtemp(prefix="kvs-sched-"))
        socket = root / "kvstore.sock"
        (root / "kvstore.toml").write_text(
            f'[dram]\ncapacity_bytes = "1GiB"\n\n[ssd]\nenabled = false\n\n'
            f'[server]\nsocket_path = "{socket}"\n')
        daemon = subprocess.Popen([args.daemon_python, "-m", "kvstore.server.daemon",
                                   "--config", str(root / "kvstore.toml")],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while not os.path.exists(socket):
            time.sleep(0.1)
        address = f"unix://{socket}"
    try:
        result = run(args, address)
    finally:
        if daemon is not None:
            daemon.terminate()
            daemon.wait(30)
    print(f"{result['requests']} requests of {result['prompt_tokens']} prompt tokens: "
          f"decode step {result['decode_step_ms_median']:.3f} ms median, "
          f"{result['decode_step_ms_max']:.3f} ms worst ({result['saves_planned']} saves "
          f"planned in {result['decode_steps']} steps; a step with "
          f"{result['saves_per_save_step']:.0f} saves {result['save_step_ms_median']:.2f} ms "
          f"median); prefill step "
          f"{result['prefill_step_ms']:.1f} ms; admission {result['admit_ms_median']:.3f} ms "
          f"median, {result['admit_ms_max']:.1f} ms worst per request")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
