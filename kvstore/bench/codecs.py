"""``kvstore bench codecs``: size, error and speed of every codec on synthetic and real K/V.

Sections (one table each, all rows in one JSON):

- ``quality-synthetic`` / ``quality-minilm``: bytes per element (``len(blob) / numel``), the
  ratio to bf16, relative L2 error of K and V, max absolute error, and the relative error of
  the attention output ``softmax(Q K^T / sqrt(d)) V`` against the bf16 original (full, not
  causal, attention per layer and head, float32). Synthetic K carries KIVI-style outlier
  channels; the MiniLM data is real (``kvstore.bench.realkv``).
- ``quality-latent``: DeepSeek-V3-shaped MLA latents stored through a ``Store`` as a latent
  group's pages, and the relative error of MLA's absorbed attention output
  (``kvstore.bench.latent``).
- ``cpu-speed``: encode and decode MB/s (bf16 bytes per second) of the torch references.
- ``gpu-speed``: the Triton kernels' GB/s against a device copy (``kvstore.bench.kernels``).
- ``gpu-check``: whether the Triton encoder writes the same blob as the CPU reference, and how
  far the Triton decode of one blob lands from the CPU decode.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kvstore import codecs
from kvstore.bench.report import BenchReport, Column
from kvstore.errors import InvalidArgument, NotFound
from kvstore.spec import KVSpec

CODECS = ("raw", "fp8_e4m3", "nvfp4", "mxfp4", "int4", "int2",
          "fp8_e4m3+zstd", "int4+zstd", "raw+zstd")
GPU_CHECK_CODECS = ("fp8_e4m3", "nvfp4", "mxfp4", "int4", "int2")
BF16_BYTES = 2


@dataclass(frozen=True, slots=True)
class BenchSizes:
    """Shapes and repeats of one run."""

    num_layers: int
    num_tokens: int
    num_kv_heads: int
    head_dim: int
    outlier_channels: int  # K channels per (layer, head) scaled by 10x-20x
    real_tokens: int  # MiniLM tokens to capture (at most 512)
    cpu_repeats: int  # CPU timings keep the best of this many
    gpu_bytes: int  # bf16 input of each Triton benchmark


FULL = BenchSizes(8, 512, 8, 128, 4, 512, 3, 1 << 30)  # synthetic K/V: 16 MiB of bf16
QUICK = BenchSizes(2, 64, 2, 64, 2, 64, 1, 64 << 20)


@dataclass(frozen=True, slots=True)
class Dataset:
    """K/V to compress, the queries that read it, and their attention output on the original.

    ``kv`` bf16 canonical; ``queries`` bf16 ``[num_layers, num_tokens, num_kv_heads, head_dim]``;
    ``reference`` float32 ``[num_layers, num_kv_heads, num_tokens, head_dim]``.
    """

    name: str
    kv: torch.Tensor
    queries: torch.Tensor
    reference: torch.Tensor

    @classmethod
    def build(cls, name: str, kv: torch.Tensor, queries: torch.Tensor) -> Dataset:
        return cls(name, kv, queries, attention(queries, kv))

    @property
    def spec(self) -> KVSpec:
        layers, _, tokens, heads, dim = self.kv.shape
        return KVSpec(num_layers=layers, num_kv_heads=heads, head_dim=dim, block_tokens=tokens)


def synthetic_dataset(sizes: BenchSizes, seed: int = 0) -> Dataset:
    """Gaussian K/V and queries; in K, ``outlier_channels`` random channels per (layer, head)
    are scaled by 10x-20x, the fixed-channel outliers KIVI reports in real keys."""
    gen = torch.Generator().manual_seed(seed)
    shape = (sizes.num_layers, 2, sizes.num_tokens, sizes.num_kv_heads, sizes.head_dim)
    kv = torch.randn(shape, generator=gen)
    scale = torch.ones(sizes.num_layers, sizes.num_kv_heads, sizes.head_dim)
    for layer in range(sizes.num_layers):
        for head in range(sizes.num_kv_heads):
            channels = torch.randperm(sizes.head_dim, generator=gen)[:sizes.outlier_channels]
            scale[layer, head, channels] = 10 + 10 * torch.rand(len(channels), generator=gen)
    kv[:, 0] *= scale.unsqueeze(1)
    queries = torch.randn(shape[:1] + shape[2:], generator=gen)
    return Dataset.build("synthetic", kv.to(torch.bfloat16), queries.to(torch.bfloat16))


def attention(queries: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """Float32 ``softmax(Q K^T / sqrt(d)) V`` per layer and head: ``[layers, heads, tokens, d]``."""
    q, k, v = (t.float().transpose(1, 2) for t in (queries, kv[:, 0], kv[:, 1]))
    return F.scaled_dot_product_attention(q, k, v)


def relative_l2(error: torch.Tensor, reference: torch.Tensor) -> float:
    """``||error|| / ||reference||`` (0 when both are zero)."""
    ref = float(reference.norm())
    return float(error.norm()) / ref if ref else float(error.norm())


def quality_row(name: str, data: Dataset) -> dict[str, Any]:
    """Size and error of codec ``name`` on ``data``, from one encode and one decode."""
    codec = codecs.get(name)
    blob = codec.encode(data.kv)
    decoded = codec.decode(blob)
    ref, err = data.kv.float(), decoded.float() - data.kv.float()
    out = attention(data.queries, decoded)
    per_layer = [relative_l2(out[i] - data.reference[i], data.reference[i])
                 for i in range(out.shape[0])]
    bpe = len(blob) / data.kv.numel()
    return {
        "section": f"quality-{data.name}", "codec": name,
        "lossless": codec.lossless, "blob_bytes": len(blob), "bytes_per_element": bpe,
        "nominal_bytes_per_element": codec.bytes_per_element(data.spec),
        "compression_ratio": BF16_BYTES / bpe,
        "k_rel_l2": relative_l2(err[:, 0], ref[:, 0]),
        "v_rel_l2": relative_l2(err[:, 1], ref[:, 1]),
        "max_abs_err": float(err.abs().max()),
        "attn_rel_err": relative_l2(out - data.reference, data.reference),
        "attn_rel_err_worst_layer": max(per_layer),
    }


def size_notes(rows: list[dict[str, Any]], tolerance: float = 0.01) -> list[str]:
    """A note for each codec outside a zstd chain whose blobs are more than ``tolerance`` off
    its own ``bytes_per_element`` (zstd's size depends on the data, so it has no nominal)."""
    notes = []
    for row in rows:
        measured, nominal = row["bytes_per_element"], row["nominal_bytes_per_element"]
        if "+zstd" not in row["codec"] and abs(measured / nominal - 1) > tolerance:
            notes.append(f"{row['section']}: {row['codec']} stores {measured:.4f} B/element, "
                         f"its bytes_per_element() says {nominal:.4f}")
    return notes


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    """The fastest of ``repeats`` calls, after one untimed warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def cpu_speed_row(name: str, kv: torch.Tensor, repeats: int) -> dict[str, Any]:
    """Encode and decode MB/s of codec ``name`` on the CPU, counting bf16 bytes."""
    codec = codecs.get(name)
    blob = codec.encode(kv)
    out = torch.empty_like(kv)
    megabytes = kv.numel() * kv.element_size() / 1e6
    return {
        "section": "cpu-speed", "codec": name, "megabytes": megabytes,
        "encode_mb_s": megabytes / best_seconds(lambda: codec.encode(kv), repeats),
        "decode_mb_s": megabytes / best_seconds(lambda: codec.decode(blob, out), repeats),
        "threads": torch.get_num_threads(),
    }


def gpu_speed_rows(nbytes: int, notes: list[str]) -> list[dict[str, Any]]:
    """Rows of each kernel family's benchmark (``kvstore.bench.kernels``); a family that fails
    adds a note."""
    from kvstore.bench.kernels import FAMILIES

    rows: list[dict[str, Any]] = []
    for family, bench in FAMILIES.items():
        try:
            got = bench(nbytes)
        # Broad on purpose: an unattended run keeps the other kernel families' rows when one
        # fails to compile or run, and the note carries the failure into the table and JSON.
        except Exception as exc:  # noqa: BLE001
            notes.append(f"gpu-speed: kvstore.bench.kernels.{bench.__name__} failed: "
                         f"{type(exc).__name__}: {exc}")
            continue
        finally:
            torch.cuda.empty_cache()
        rows += [{"section": "gpu-speed", "kernels": family, "nbytes": nbytes, **row}
                 for row in got]
    return rows


def gpu_check_row(name: str, data: Dataset, device: str = "cuda") -> dict[str, Any]:
    """Compare codec ``name``'s encode and decode on ``device`` (the Triton kernels on CUDA)
    with the CPU reference: identical blobs, and the largest gap between the two decodes."""
    codec = codecs.get(name)
    cpu_blob = codec.encode(data.kv)
    device_blob = codec.encode(data.kv.to(device))
    differing = None
    if len(device_blob) == len(cpu_blob):
        differing = int((torch.frombuffer(bytearray(device_blob), dtype=torch.uint8)
                         != torch.frombuffer(bytearray(cpu_blob), dtype=torch.uint8)).sum())
    on_device = codec.decode(cpu_blob, torch.empty_like(data.kv, device=device)).cpu()
    return {
        "section": f"gpu-check-{data.name}", "codec": name,
        "blob_identical": device_blob == cpu_blob, "differing_bytes": differing,
        "decode_max_diff": float((on_device.float() - codec.decode(cpu_blob).float()).abs().max()),
    }


def real_dataset(sizes: BenchSizes, minilm_dir: str | os.PathLike[str] | None,
                 notes: list[str]) -> Dataset | None:
    """The MiniLM capture, or None with a note saying why it was skipped."""
    from kvstore.bench.realkv import capture_kv

    try:
        real = capture_kv(sizes.real_tokens, model_dir=minilm_dir)
    except NotFound as exc:
        notes.append(f"quality-minilm: skipped: {exc}")
        return None
    notes.append(f"quality-minilm: all-MiniLM-L6-v2 from {real.model_dir}, "
                 f"{real.num_tokens} tokens of English prose, shape {tuple(real.kv.shape)}")
    return Dataset.build("minilm", real.kv, real.queries)


COLUMNS = (
    Column("codec", "codec", justify="left"),
    Column("op", "op", justify="left"),
    Column("bytes_per_element", "B/elem", 4),
    Column("compression_ratio", "vs bf16", 2),
    Column("k_rel_l2", "K rel L2", 4),
    Column("v_rel_l2", "V rel L2", 4),
    Column("c_kv_rel_l2", "c_kv rel L2", 4),
    Column("k_rope_rel_l2", "k_rope rel L2", 4),
    Column("max_abs_err", "max abs", 4),
    Column("attn_rel_err", "attn rel", 4),
    Column("megabytes", "MB", 1),
    Column("encode_mb_s", "encode MB/s", 1),
    Column("decode_mb_s", "decode MB/s", 1),
    Column("gbps", "GB/s", 1),
    Column("copy_gbps", "copy GB/s", 1),
    Column("ratio", "vs copy", 3),
    Column("blob_identical", "same blob"),
    Column("differing_bytes", "bytes differ"),
    Column("decode_max_diff", "decode diff", 6),
)


def _use_gpu(gpu: bool | None) -> tuple[bool, str]:
    """Whether the GPU sections run, and why not when they don't."""
    available = torch.cuda.is_available()
    if gpu and not available:
        raise InvalidArgument("--gpu needs a CUDA device, and torch sees none")
    if gpu is False:
        return False, "--no-gpu"
    return available, "" if available else "no CUDA device"


def _guarded(label: str, fn: Callable[[], dict[str, Any]], notes: list[str]) -> list[dict]:
    # Broad on purpose, as in gpu_speed_rows: one failing kernel must not lose the other rows.
    try:
        return [fn()]
    except Exception as exc:  # noqa: BLE001
        notes.append(f"{label} failed: {type(exc).__name__}: {exc}")
        return []


def _params(quick: bool, sizes: BenchSizes, names: tuple[str, ...],
            datasets: list[Dataset], use_gpu: bool) -> dict[str, Any]:
    try:
        import triton

        triton_version: str | None = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "quick": quick, "codecs": list(names), "sizes": {
            f: getattr(sizes, f) for f in sizes.__dataclass_fields__},
        "torch": torch.__version__, "triton": triton_version,
        "cpu_threads": torch.get_num_threads(), "gpu_sections": use_gpu,
        "gpu": torch.cuda.get_device_name(0) if use_gpu else None,
        "datasets": {d.name: list(d.kv.shape) for d in datasets},
        "attention": "full (non-causal) softmax(QK^T/sqrt(d))V per layer and head, float32",
    }


def run_codec_bench(*, quick: bool = False, real: bool = True, gpu: bool | None = None,
                    minilm_dir: str | os.PathLike[str] | None = None,
                    codec_names: tuple[str, ...] = CODECS, latent: bool = True) -> BenchReport:
    """Measure every codec's size, error and speed; the report prints one table per section.

    Args:
        quick: small shapes and one timing repeat (seconds on a CPU; for tests).
        real: capture real K/V from all-MiniLM-L6-v2 (skipped with a note if unavailable).
        gpu: run the GPU sections; None runs them when CUDA is available.
        minilm_dir: the MiniLM files (default: ``$KVSTORE_MINILM_DIR``, then the package).
        codec_names: codec chains to measure.
        latent: measure the ``quality-latent`` section (MLA latents, ``kvstore.bench.latent``).

    Returns:
        The report; rows carry a ``section`` key (see the module docstring).

    Raises:
        InvalidArgument: ``gpu`` is True without CUDA, a named MiniLM directory lacks its
            files, or a codec name is unknown (CodecError).
    """
    sizes = QUICK if quick else FULL
    use_gpu, gpu_reason = _use_gpu(gpu)
    for name in codec_names:
        codecs.get(name)  # an unknown name fails before any measuring
    notes: list[str] = []
    datasets: list[Dataset] = []
    if real:
        found = real_dataset(sizes, minilm_dir, notes)
        datasets += [found] if found is not None else []
    else:
        notes.append("quality-minilm: skipped: --no-real")
    datasets.insert(0, synthetic_dataset(sizes))
    rows = [quality_row(name, data) for data in datasets for name in codec_names]
    params = _params(quick, sizes, codec_names, datasets, use_gpu)
    if latent:
        from kvstore.bench import latent as mla

        latent_sizes = mla.LATENT_QUICK if quick else mla.LATENT_FULL
        latent_data = mla.latent_dataset(latent_sizes)
        rows += [mla.latent_quality_row(name, latent_data) for name in codec_names]
        params["latent"] = mla.latent_params(latent_sizes)
        notes.append(mla.REAL_NOTE)
    notes += size_notes(rows)
    rows += [cpu_speed_row(name, datasets[0].kv, sizes.cpu_repeats) for name in codec_names]
    if use_gpu:
        rows += gpu_speed_rows(sizes.gpu_bytes, notes)
        for data in datasets:
            for name in (n for n in GPU_CHECK_CODECS if n in codec_names):
                rows += _guarded(f"gpu-check {name} on {data.name}",
                                 lambda n=name, d=data: gpu_check_row(n, d), notes)
    else:
        notes.append(f"gpu-speed, gpu-check: skipped: {gpu_reason}")
    return BenchReport(
        name="codecs", title="codecs", columns=COLUMNS, rows=tuple(rows),
        params=params, notes=tuple(notes),
        section_key="section")


__all__ = ["CODECS", "FULL", "QUICK", "BenchSizes", "Dataset", "attention", "cpu_speed_row",
           "gpu_check_row", "gpu_speed_rows", "quality_row", "run_codec_bench", "size_notes",
           "synthetic_dataset"]
