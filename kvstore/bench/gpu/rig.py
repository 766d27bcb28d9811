"""The GPU bench's fixture: an engine cache and the device pages of every codec in a GPU pool
and in pinned host memory, with the timers and buffers every GPU measurement uses."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from kvstore.bench.report import Column
from kvstore.codecs.device import SECTION_ALIGN, DeviceLayout, device_layout
from kvstore.errors import KVStoreError
from kvstore.spec import EngineLayout, KVSpec

# The columns of a path or kernel row: its time, its rate, and that rate against a ceiling
# measured in the same run.
COLUMNS = (
    Column("path", "path", justify="left"),
    Column("codec", "codec", justify="left"),
    Column("ms", "ms", 3),
    Column("gbps", "GB/s", 1),
    Column("ceiling", "ceiling", justify="left"),
    Column("ceiling_gbps", "ceiling GB/s", 1),
    Column("ratio", "ratio", 3),
    Column("aim", "aim", justify="left"),
)


SPEC = KVSpec(num_layers=32, num_kv_heads=8, head_dim=128, block_tokens=16)  # 2 MiB a block
CODECS = ("raw", "fp8_e4m3", "nvfp4", "mxfp4", "int4", "int2")


def bench_ms(fn: Callable[[], None], reps: int = 20) -> float:
    """Median milliseconds of ``fn`` on the current stream (device events)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=max(reps, 50), return_mode="median"))


def aligned(nbytes: int, device: str | torch.device, pin: bool = False) -> torch.Tensor:
    """``nbytes`` of uint8 starting on a ``SECTION_ALIGN`` boundary (pinned with ``pin``)."""
    raw = torch.empty(nbytes + SECTION_ALIGN, dtype=torch.uint8, device=device,
                      pin_memory=pin)
    pad = -raw.data_ptr() % SECTION_ALIGN
    return raw[pad:pad + nbytes]


def encoded_pages(codec: str, blocks: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The sections of each block's device page under ``codec`` (CPU reference encoders)."""
    from kvstore.codecs.fp4 import mxfp4_quantize_reference, nvfp4_quantize_reference
    from kvstore.codecs.fp8 import encode_fp8_reference

    out = []
    for block in blocks:
        if codec == "raw":
            out.append([block])
        elif codec == "fp8_e4m3":
            parts = encode_fp8_reference(block)
            out.append([parts.codes, parts.scales])
        elif codec == "nvfp4":
            out.append(nvfp4_quantize_reference(block).sections())
        elif codec == "mxfp4":
            out.append(mxfp4_quantize_reference(block).sections())
        else:
            from kvstore.codecs.kivi import encode_kivi_reference

            group = device_layout(codec, SPEC).group_size
            bits = 4 if codec == "int4" else 2
            out.append(encode_kivi_reference(block, bits, group).tensors())
    return out


class Rig:
    """An engine cache, device pages of every codec in a GPU pool and in pinned host memory."""

    def __init__(self, num_blocks: int, device: torch.device) -> None:
        self.device = device
        self.n = num_blocks
        spec = SPEC
        pages = 2 * num_blocks
        self.caches = [torch.empty(2, pages, spec.block_tokens, spec.num_kv_heads,
                                   spec.head_dim, dtype=torch.bfloat16, device=device)
                       for _ in range(spec.num_layers)]
        for cache in self.caches:
            cache.normal_()
        self.layout = EngineLayout.of(self.caches, spec)
        self.ids = torch.randperm(pages)[:num_blocks]  # host tables: the launch copies them
        self.engine_bytes = num_blocks * spec.block_bytes
        # A few distinct random blocks repeated: the reference encoders run on the CPU.
        distinct = [torch.randn(spec.block_shape).to(torch.bfloat16) for _ in range(4)]
        self.blocks = distinct
        self.layouts: dict[str, DeviceLayout] = {}
        self.pools: dict[str, torch.Tensor] = {}
        self.hosts: dict[str, torch.Tensor] = {}
        for codec in CODECS:
            dev = device_layout(codec, spec)
            self.layouts[codec] = dev
            one = aligned(dev.nbytes, "cpu")
            pool = aligned(num_blocks * dev.nbytes, device)
            host = aligned(num_blocks * dev.nbytes, "cpu", pin=True)
            encoded = encoded_pages(codec, distinct)
            for i in range(num_blocks):
                if i < len(distinct):
                    for section, part in zip(dev.sections, encoded[i]):
                        flat = part.contiguous().view(-1).view(torch.uint8)
                        one[section.offset:section.offset + section.nbytes].copy_(flat)
                    host[i * dev.nbytes:(i + 1) * dev.nbytes].copy_(one)
                else:
                    src = (i % len(distinct)) * dev.nbytes
                    host[i * dev.nbytes:(i + 1) * dev.nbytes].copy_(
                        host[src:src + dev.nbytes])
            pool.copy_(host)
            self.pools[codec] = pool
            self.hosts[codec] = host

    def addrs(self, memory: torch.Tensor, codec: str, count: int | None = None) -> torch.Tensor:
        dev = self.layouts[codec]
        count = self.n if count is None else count
        base = memory.data_ptr()
        return torch.arange(count, dtype=torch.int64) * dev.nbytes + base

    def page_bytes(self, codec: str, count: int | None = None) -> int:
        dev = self.layouts[codec]
        return (self.n if count is None else count) * sum(s.nbytes for s in dev.sections)

    def check_loaded(self, codec: str, count: int | None = None) -> None:
        """Blocks landed in the engine's pages as the codec's reference decodes them."""
        from kvstore.codecs.fp4 import dequantize_reference
        from kvstore.codecs.fp8 import decode_fp8_reference
        from kvstore.codecs.parts import Fp4Parts, Fp8Parts
        from kvstore.codecs.triton.engine import page_tensors

        dev = self.layouts[codec]
        count = self.n if count is None else count
        for i in sorted({0, 1, 2, 3, count - 1}):
            if i >= count:
                continue
            parts = [t.cpu() for t in page_tensors(self.hosts[codec], dev,
                                                   (i % len(self.blocks)) * dev.nbytes)]
            if codec == "raw":
                want = parts[0]
            elif codec == "fp8_e4m3":
                want = decode_fp8_reference(Fp8Parts(*parts), torch.bfloat16)
            elif codec in ("nvfp4", "mxfp4"):
                want = dequantize_reference(Fp4Parts(*parts), torch.bfloat16)
            else:
                from kvstore.codecs.kivi import decode_kivi_reference
                from kvstore.codecs.parts import KiviParts

                bits = 4 if codec == "int4" else 2
                want = decode_kivi_reference(KiviParts(bits, dev.group_size, *parts),
                                             torch.bfloat16)
            page = int(self.ids[i])
            got = torch.stack([torch.stack(self.layout.block_view(layer, page))
                               for layer in range(SPEC.num_layers)]).cpu()
            if not torch.equal(got, want):
                bad = int((got != want).sum())
                raise KVStoreError(f"bench gpu: {codec} block {i} landed wrong ({bad} values)")

    def poison(self) -> None:
        for cache in self.caches:
            cache.fill_(float("nan"))



def staged_load(rig: Rig, codec: str, ring) -> None:
    """Pinned host pages DMA'd chunk by chunk into a device ring and decoded on the current
    stream as each chunk lands: the engine client's own path (``StagingRing``)."""
    from kvstore.client.staging import HostPages

    dev = rig.layouts[codec]
    pages = HostPages([rig.hosts[codec]], np.zeros(rig.n, dtype=np.intp),
                      np.arange(rig.n, dtype=np.int64) * dev.nbytes)
    ring.load(rig.layout, dev, pages, rig.ids)


def copy_ms(src: torch.Tensor) -> float:
    """Median ms of a device-to-device copy of ``src``."""
    dst = torch.empty_like(src)
    return bench_ms(lambda: dst.copy_(src))

