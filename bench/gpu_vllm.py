"""vLLM on a GPU with kvstore's connector, beside the engine's own prefix cache, recompute and
vLLM's own CPU offloading, in one run (the H200 rows of BENCHMARKS.md).

    python3 bench/gpu_vllm.py --shape 8b --prefix-tokens 32768 --out $OUT/vllm-h200.json

Runs in a python with a CUDA vLLM (0.26) importable and kvstore's own dependencies on the
path. Each configuration is a fresh engine process (``--child``); a kvstore configuration gets
a fresh daemon, whose DRAM tier stores raw or fp8 pages. Every engine serves the same
documents: a long shared prefix each and a short question after it.

- cold: each document once, one request at a time (nothing cached: recompute); the kvstore
  configurations save the prefixes as they go.
- warm: the engine's GPU prefix cache is dropped (``reset_prefix_cache``) except for the
  ``prefix`` configuration, then each document again with another question: the prefix comes
  from the engine's own cache (``prefix``), from kvstore, or from vLLM's CPU offloading.
- tokens: greedy output (16 tokens, first-token logprobs) of a third question, from the same
  place, compared with the ``prefix`` configuration's: raw pages must give the same tokens.

TTFT is the wall time of a one-token request. Weights are random at the usual init scale
(std 0.02, norms 1) rather than vLLM's dummy ones (+-1e-3 gives flat logits and ties), seeded
alike in every engine.
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

REPO = Path(__file__).resolve().parents[1]
SHAPES = {  # layers, hidden, heads, kv heads, head dim, intermediate, vocab
    "micro": (2, 256, 4, 2, 64, 512, 1024),  # a check of this script on a CPU vLLM
    "tiny": (4, 1024, 8, 2, 128, 2816, 32000),
    "8b": (32, 4096, 32, 8, 128, 14336, 128256),
}
CONFIGS = ("prefix", "kvstore-raw", "kvstore-fp8", "kvstore-hbm", "offload", "lmcache")
QUESTION_TOKENS = 32
LMCACHE_PORT = 5555


def write_model(path: Path, shape: str, max_len: int) -> Path:
    layers, hidden, heads, kv_heads, head_dim, inter, vocab = SHAPES[shape]
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "vocab_size": vocab,
        "max_position_embeddings": max_len, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False,
        "mlp_bias": False, "dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}))
    return path


def documents(args) -> list[tuple[list[int], list[list[int]]]]:
    """Per document: its prefix and three questions (cold, warm, tokens)."""
    import random

    vocab = SHAPES[args.shape][6]
    rng = random.Random(7)
    return [([rng.randrange(3, vocab) for _ in range(args.prefix_tokens)],
             [[rng.randrange(3, vocab) for _ in range(QUESTION_TOKENS)] for _ in range(3)])
            for _ in range(args.documents)]


def reinit(model) -> int:
    """Weights at the usual init scale, the same in every engine (vLLM's dummy loader's are
    +-1e-3)."""
    import torch

    count = 0
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if param.dim() >= 2:
                gen = torch.Generator(device=param.device).manual_seed(count)
                param.normal_(0.0, 0.02, generator=gen)
            else:
                param.fill_(1.0 if "norm" in name else 0.0)
            count += 1
    return count


def child(args) -> None:
    """One engine: cold, warm and token rounds; prints ``RESULT <json>``."""
    import torch
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # apply_model(reinit)
    docs = documents(args)
    max_len = args.prefix_tokens + 2 * QUESTION_TOKENS + 64
    model = write_model(Path(args.model_dir), args.shape, max_len)
    kwargs = {"model": str(model), "load_format": "dummy", "enforce_eager": True,
              "skip_tokenizer_init": True, "dtype": "bfloat16", "seed": 0,
              "max_model_len": max_len, "gpu_memory_utilization": args.gpu_mem,
              "max_num_seqs": 8, "enable_prefix_caching": True, "block_size": args.block_size}
    if args.child.startswith("kvstore"):
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVStoreConnector", kv_role="kv_both",
            kv_connector_module_path="kvstore.integrations.vllm",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"address": f"unix://{args.socket}", "revision": "r1"})
    elif args.child == "offload":
        kwargs["kv_offloading_size"] = args.offload_gib
    elif args.child == "lmcache":  # LMCache's multi-process connector against its own server
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="LMCacheMPConnector", kv_role="kv_both",
            kv_connector_extra_config={"lmcache.mp.host": "tcp://localhost",
                                       "lmcache.mp.port": LMCACHE_PORT})
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    init_s = time.perf_counter() - t0
    # by reference to an importable module: the engine's process cannot unpickle __main__'s
    sys.path.insert(0, str(REPO / "bench"))
    from gpu_vllm import reinit as importable_reinit

    llm.apply_model(importable_reinit)
    one = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
    many = SamplingParams(temperature=0.0, max_tokens=16, logprobs=1, detokenize=False,
                          ignore_eos=True)

    def ttft(prompt: list[int]) -> float:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], one, use_tqdm=False)
        return time.perf_counter() - t

    ttft([5] * 64)  # warm-up: kernels, allocator
    cold = [ttft(prefix + qs[0]) for prefix, qs in docs]
    if args.child.startswith("kvstore"):
        settle(args.socket)
    elif args.child == "lmcache":
        time.sleep(5)  # LMCache stores asynchronously too
    if args.child != "prefix":
        llm.reset_prefix_cache()
    warm = [ttft(prefix + qs[1]) for prefix, qs in docs]
    daemon = daemon_stats(args.socket) if args.child.startswith("kvstore") else {}
    if args.child != "prefix":
        llm.reset_prefix_cache()
    outs = llm.generate([{"prompt_token_ids": prefix + qs[2]} for prefix, qs in docs], many,
                        use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [[float(next(iter(step.values())).logprob) for step in o.outputs[0].logprobs]
                for o in outs]
    print("RESULT " + json.dumps({"config": args.child, "init_s": init_s, "cold_s": cold,
                                  "warm_s": warm, "tokens": tokens, "logprobs": logprobs,
                                  "daemon_after_warm": daemon}),
          flush=True)


def settle(socket: str, timeout_s: float = 120.0) -> None:
    """Wait until the daemon's stored blocks stop growing (the saves are asynchronous)."""
    from kvstore.client import Client

    with Client(f"unix://{socket}") as client:
        last, since = -1, time.monotonic()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            blocks = client.stats().num_blocks
            if blocks != last:
                last, since = blocks, time.monotonic()
            elif time.monotonic() - since > 1.5 and blocks:
                return
            time.sleep(0.25)


def daemon_stats(socket: str) -> dict:
    from kvstore.client import Client

    with Client(f"unix://{socket}") as client:
        stats = client.stats()
    return {"counters": stats.counters.as_dict(),
            "tiers": {name: t.as_dict() for name, t in stats.tiers.items()}}


def start_daemon(root: Path, codec: str, dram_gib: int, python: str
                 ) -> tuple[subprocess.Popen, str]:
    socket = str(root / "kvstore.sock")
    config = root / "kvstore.toml"
    if codec == "hbm":  # a device pool on the engine's GPU heads the chain, raw DRAM under it
        tiers = (f'[[tiers]]\nname = "gpu"\nkind = "hbm"\ndevice = "cuda:0"\n'
                 f'capacity_bytes = "{dram_gib}GiB"\ncodec = "raw"\n\n'
                 f'[[tiers]]\nname = "dram"\nkind = "dram"\ncapacity_bytes = "{dram_gib}GiB"\n'
                 f'chunk_bytes = "256MiB"\n\n')
    else:
        tiers = (f'[dram]\ncapacity_bytes = "{dram_gib}GiB"\ncodec = "{codec}"\n'
                 f'chunk_bytes = "256MiB"\n\n[ssd]\nenabled = false\n\n')
    config.write_text(tiers + f'[server]\nsocket_path = "{socket}"\n')
    with open(root / "daemon.log", "w") as log:  # the daemon keeps its own descriptor
        proc = subprocess.Popen([python, "-m", "kvstore.server.daemon", "--config",
                                 str(config)], stdout=log, stderr=subprocess.STDOUT,
                                env=daemon_env())
    deadline = time.monotonic() + 60
    while not os.path.exists(socket):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the daemon did not start: {(root / 'daemon.log').read_text()}")
        time.sleep(0.2)
    return proc, socket


def daemon_env() -> dict[str, str]:
    """The daemon needs none of the engine's packages: drop them from its path."""
    env = dict(os.environ)
    engine_site = os.environ.get("KVSTORE_ENGINE_SITE", "")
    if engine_site:
        env["PYTHONPATH"] = os.pathsep.join(p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                            if p and p != engine_site)
    return env


def lmcache_env() -> dict[str, str]:
    """LMCache's packages (``KVSTORE_LMCACHE_SITE``) ahead of the engine's."""
    env = dict(os.environ)
    site = os.environ.get("KVSTORE_LMCACHE_SITE", "")
    if site:
        env["PYTHONPATH"] = os.pathsep.join([site, env.get("PYTHONPATH", "")])
    return env


def start_lmcache(root: Path, dram_gib: int) -> subprocess.Popen:
    """LMCache's server holding ``dram_gib`` of CPU memory; ready when its port answers."""
    import socket as sockets

    with open(root / "lmcache.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "lmcache.cli.main", "server",
                                 "--l1-size-gb", str(dram_gib), "--eviction-policy", "LRU",
                                 "--port", str(LMCACHE_PORT)], stdout=log,
                                stderr=subprocess.STDOUT, env=lmcache_env())
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"LMCache's server ended: {(root / 'lmcache.log').read_text()}")
        try:
            sockets.create_connection(("localhost", LMCACHE_PORT), timeout=1).close()
            return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("LMCache's server did not open its port in 120 s")


def run_config(args, config: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="kvs-vllm-") as tmp:
        root = Path(tmp)
        daemon, socket = None, str(root / "kvstore.sock")
        if config.startswith("kvstore"):
            codec = {"kvstore-fp8": "fp8_e4m3", "kvstore-hbm": "hbm"}.get(config, "raw")
            daemon, socket = start_daemon(root, codec, args.dram_gib, args.daemon_python)
        elif config == "lmcache":
            daemon = start_lmcache(root, args.dram_gib)
        try:
            cmd = [sys.executable, __file__, "--child", config, "--socket", socket,
                   *args.passthrough]
            proc = subprocess.run(cmd, check=False, capture_output=True, text=True,
                                  timeout=args.timeout_s,
                                  env=lmcache_env() if config == "lmcache" else None)
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                return {"config": config, "error": (proc.stdout + proc.stderr)[-4000:]}
            result = json.loads(line[len("RESULT "):])
            log = root / ("lmcache.log" if config == "lmcache" else "daemon.log")
            if log.exists():
                result["daemon_log_tail"] = log.read_text(errors="replace")[-1500:]
            return result
        finally:
            if daemon is not None:
                daemon.terminate()
                daemon.wait(30)


def report(results: list[dict], args) -> None:
    base = next((r for r in results if r.get("config") == "prefix" and "error" not in r), None)
    recompute = statistics.median(base["cold_s"]) if base else None
    print(f"\nvLLM {args.shape}, {args.documents} documents of {args.prefix_tokens} prefix "
          f"tokens + {QUESTION_TOKENS}; TTFT of one-token requests (median)")
    print(f"{'config':<14}{'cold s':>9}{'warm s':>9}{'recompute/warm':>16}  tokens vs prefix")
    for r in results:
        if "error" in r:
            print(f"{r['config']:<14} failed: {r['error'][-300:]!r}")
            continue
        cold, warm = statistics.median(r["cold_s"]), statistics.median(r["warm_s"])
        same = None
        if base is not None:
            same = sum(a == b for a, b in zip(r["tokens"], base["tokens"]))
            r["same_tokens_as_prefix"] = same
            r["max_abs_dlogprob"] = max(abs(x - y) for a, b in zip(r["logprobs"], base["logprobs"])
                                        for x, y in zip(a, b))
        speed = recompute / warm if recompute else float("nan")
        r["recompute_over_warm"] = speed
        hits = r.get("daemon_after_warm", {}).get("counters", {}).get("lookup_hit_tokens", "")
        print(f"{r['config']:<14}{cold:>9.3f}{warm:>9.3f}{speed:>15.1f}x  "
              f"{same}/{len(r['tokens'])} same, max |dlogprob| {r.get('max_abs_dlogprob', 0):.3g}"
              + (f", kvstore lookups hit {hits} tokens" if hits != "" else ""))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", default="")
    ap.add_argument("--socket", default="")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--prefix-tokens", type=int, default=4096)
    ap.add_argument("--documents", type=int, default=3)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--gpu-mem", type=float, default=0.5)
    ap.add_argument("--offload-gib", type=float, default=24.0)
    ap.add_argument("--dram-gib", type=int, default=24)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--model-dir", default="/tmp/kvs-vllm-model")
    ap.add_argument("--timeout-s", type=float, default=400)
    ap.add_argument("--out", default="")
    ap.add_argument("--daemon-python", default=sys.executable)
    args = ap.parse_args()
    args.passthrough = ["--shape", args.shape, "--prefix-tokens", str(args.prefix_tokens),
                        "--documents", str(args.documents), "--block-size", str(args.block_size),
                        "--gpu-mem", str(args.gpu_mem), "--offload-gib", str(args.offload_gib),
                        "--model-dir", args.model_dir]
    if args.child:
        child(args)
        return 0
    results = [run_config(args, c) for c in args.configs.split(",")]
    report(results, args)
    if args.out:
        Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"),
                                              "shape": args.shape,
                                              "prefix_tokens": args.prefix_tokens,
                                              "results": results}, indent=1))
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
