"""transformers with kvstore on a GPU: time to first token of plain ``generate`` (recompute)
beside the wrapped model warm, through the device path (DRAM raw, DRAM fp8) and the host path
(``device_path=False``: the prefix read into host tensors, copied to the GPU), in one run.

    python3 bench/gpu_transformers.py --shape 8b --prompt-tokens 8192 32768 --out $OUT/tf.json
    TRITON_INTERPRET=1 python bench/gpu_transformers.py --shape micro --prompt-tokens 64 160

Without CUDA (``--shape micro``) the model runs on the CPU and the device path's kernels in
Triton's interpreter: a check of this script, not a measurement. Each kvstore codec gets a
fresh daemon (``gpu_vllm.start_daemon``); the configurations on one daemon share its prefix
(one namespace), so the host path reads what the device path stored.

- plain: ``model.generate(max_new_tokens=1)``, wall time (synchronized).
- cold: the wrapped model's first call stores the prompt's blocks.
- warm: the same prompt again; ``GenerateStats.ttft_s`` (the first token's logits computed,
  the load included) and the call's wall time, which also waits for the save of the last
  block (stored already: nothing new is written).
First tokens are compared with plain's; raw pages give the same K/V as a prefill, yet a tail
computed against cached K/V can round differently from one whole prefill, so a lossy or even
raw row may differ on a near tie (reported, not failed). Weights are random at the usual init
scale (std 0.02, norms 1) so logits are not flat.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_vllm import start_daemon  # a script beside this one

SHAPES = {  # layers, hidden, heads, kv heads, head dim, intermediate, vocab
    "micro": (2, 64, 4, 2, 16, 128, 512),  # a check of this script on a CPU
    "tiny": (4, 1024, 8, 2, 128, 2816, 32000),
    "8b": (32, 4096, 32, 8, 128, 14336, 128256),
}
CONFIGS = {  # name: (daemon codec, device_path)
    "device-raw": ("raw", True),
    "device-fp8": ("fp8_e4m3", True),
    "host-raw": ("raw", False),
    "device-hbm": ("hbm", True),  # a device pool heads the daemon's chain (needs CUDA)
}
DEFAULT_CONFIGS = "plain,device-raw,device-fp8,host-raw"


def build_model(shape: str, max_len: int, device: torch.device):
    from transformers import LlamaConfig, LlamaForCausalLM

    layers, hidden, heads, kv_heads, head_dim, inter, vocab = SHAPES[shape]
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, head_dim=head_dim,
                         max_position_embeddings=max_len, rope_theta=500000.0,
                         initializer_range=0.02, tie_word_embeddings=False)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16 on the device: no fp32 copy
    try:
        with device:
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, call):
    sync(device)
    start = time.perf_counter()
    out = call()
    sync(device)
    return out, time.perf_counter() - start


def first_token(out) -> tuple[int, torch.Tensor]:
    return int(out.sequences[0, -1]), out.logits[0][0].float()


def run_plain(model, ids, reps: int, device) -> dict:
    greedy = {"do_sample": False, "return_dict_in_generate": True, "output_logits": True,
              "max_new_tokens": 1}
    with torch.no_grad():
        model.generate(ids, **greedy)  # kernels and allocator warmed
        times, out = [], None
        for _ in range(reps):
            out, seconds = timed(device, lambda: model.generate(ids, **greedy))
            times.append(seconds)
    return {"config": "plain", "ttft_s": times, "wall_s": times, "reused_tokens": 0,
            "first": first_token(out)}


def run_wrapped(cached, ids, reps: int, device) -> dict:
    greedy = {"do_sample": False, "return_dict_in_generate": True, "output_logits": True,
              "max_new_tokens": 1}
    with torch.no_grad():
        _, cold_s = timed(device, lambda: cached.generate(ids, **greedy))
        cold = cached.last_stats
        ttft, wall, out, stats = [], [], None, None
        for _ in range(reps):
            out, seconds = timed(device, lambda: cached.generate(ids, **greedy))
            stats = cached.last_stats
            ttft.append(stats.ttft_s)
            wall.append(seconds)
    return {"cold_s": cold_s, "cold_saved_tokens": cold.num_saved_tokens, "ttft_s": ttft,
            "wall_s": wall, "reused_tokens": stats.num_reused_tokens,
            "reused_per_tier": stats.reused_tokens_per_tier, "first": first_token(out)}


def run_daemon(codec: str, names: list[str], model, prompts, args, device) -> list[dict]:
    """The configurations of one daemon codec, each prompt length in turn."""
    from kvstore.client import Client
    from kvstore.integrations.transformers import wrap

    rows = []
    with tempfile.TemporaryDirectory(prefix="kvs-tf-") as tmp:
        proc, socket = start_daemon(Path(tmp), codec, args.dram_gib, sys.executable)
        try:
            with Client(f"unix://{socket}") as client:
                for name in names:
                    cached = wrap(model, client, revision="r1", device_path=CONFIGS[name][1])
                    try:
                        for n, ids in prompts.items():
                            try:
                                row = run_wrapped(cached, ids, args.reps, device)
                            except Exception as exc:  # noqa: BLE001  (a row says why)
                                row = {"error": f"{type(exc).__name__}: {exc}"}
                            rows.append({"config": name, "prompt_tokens": n, **row})
                    finally:
                        cached.close()
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    return rows


def summarise(rows: list[dict], plain: dict[int, dict]) -> None:
    for row in rows:
        if "error" in row:
            continue
        base = plain[row["prompt_tokens"]]
        token, logits = row.pop("first")
        base_token, base_logits = base["first"]
        row["same_first_token"] = token == base_token
        row["max_logit_diff"] = float((logits - base_logits).abs().max())
        row["ttft_ms"] = 1e3 * statistics.median(row["ttft_s"])
        row["wall_ms"] = 1e3 * statistics.median(row["wall_s"])
        row["speedup"] = statistics.median(base["ttft_s"]) / statistics.median(row["ttft_s"])


def table(rows: list[dict]) -> None:
    print(f"{'prompt':>7}  {'config':<11}{'TTFT ms':>10}{'wall ms':>10}{'vs plain':>10}"
          f"{'reused':>8}{'cold s':>8}  first token")
    for r in rows:
        if "error" in r:
            print(f"{r['prompt_tokens']:>7}  {r['config']:<11}failed: {r['error'][-300:]}")
            continue
        cold = f"{r['cold_s']:8.2f}" if "cold_s" in r else " " * 8
        print(f"{r['prompt_tokens']:>7}  {r['config']:<11}{r['ttft_ms']:>10.1f}"
              f"{r['wall_ms']:>10.1f}{r['speedup']:>9.1f}x{r['reused_tokens']:>8}{cold}  "
              f"{'same' if r['same_first_token'] else 'differs'} "
              f"(max logit diff {r['max_logit_diff']:.3g})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    ap.add_argument("--prompt-tokens", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--reps", type=int, default=3, help="timed warm calls per configuration")
    ap.add_argument("--configs", default=DEFAULT_CONFIGS,
                    help=f"comma-separated: plain and any of {sorted(CONFIGS)}")
    ap.add_argument("--dram-gib", type=int, default=24, help="each daemon's DRAM tier")
    ap.add_argument("--out", default="", help="write the rows as JSON here")
    args = ap.parse_args()
    names = args.configs.split(",")
    unknown = [n for n in names if n != "plain" and n not in CONFIGS]
    if unknown:
        ap.error(f"unknown configs {unknown}; known: plain, {sorted(CONFIGS)}")
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        ap.error("without CUDA the device path needs TRITON_INTERPRET=1")
    model = build_model(args.shape, max(args.prompt_tokens) + 64, device)
    rng = random.Random(7)
    vocab = SHAPES[args.shape][6]
    prompts = {n: torch.tensor([[rng.randrange(3, vocab) for _ in range(n)]], device=device)
               for n in args.prompt_tokens}
    plain = {n: run_plain(model, ids, args.reps, device) for n, ids in prompts.items()}
    rows = []
    for codec in dict.fromkeys(CONFIGS[n][0] for n in names if n != "plain"):
        rows += run_daemon(codec, [n for n in names if n != "plain" and CONFIGS[n][0] == codec],
                           model, prompts, args, device)
    plain_rows = [{**p, "prompt_tokens": n} for n, p in plain.items()]
    everything = (plain_rows if "plain" in names else []) + rows
    summarise(everything, plain)
    everything.sort(key=lambda r: (r["prompt_tokens"], names.index(r["config"])
                                   if r["config"] in names else 0))
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"\ntransformers {args.shape} on {gpu}, median of {args.reps} warm calls")
    table(everything)
    if args.out:
        import transformers

        Path(args.out).write_text(json.dumps({
            "shape": args.shape, "device": gpu, "torch": torch.__version__,
            "transformers": transformers.__version__, "reps": args.reps,
            "date": time.strftime("%Y-%m-%d"), "rows": everything}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
