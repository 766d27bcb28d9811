"""``kvstore bench gpu --host-overhead``: the host's share of ``EngineCache`` save and load of
a prefix through a daemon, the kernels' own time taken out, optionally beside another checkout.

This file also runs against another checkout's kvstore package (``--baseline``, in a child
process): it imports only modules every checkout has, and no other module of the GPU bench.
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from collections.abc import Callable
from typing import Self

import torch

from kvstore.bench.report import BenchReport, Column
from kvstore.errors import KVStoreError
from kvstore.spec import KVSpec

# On a GPU, the GPU bench's blocks (kvstore.bench.gpu.rig.SPEC): 2 MiB.
SPEC = KVSpec(num_layers=32, num_kv_heads=8, head_dim=128, block_tokens=16)
# ``--host-overhead``: the host's share of EngineCache.save and load of a 512-block prefix
# through a daemon, with the kernels' own time taken out, so it runs on the 2-core box too
# (HbmTier(device="cpu") and Triton's interpreter run the same code as on the GPU). On the
# CPU one layer of one head of 128 (8 KiB blocks) keeps the interpreted kernels to seconds:
# what is measured is per block, not per byte. On a GPU, SPEC (2 MiB blocks). On the CPU the
# kernels run in the warm-up pass, whose pages are checked, and are skipped in the timed ones
# (still counted as launches): interpreted, 512 blocks take seconds a launch.
HOST_SPEC = KVSpec(num_layers=1, num_kv_heads=1, head_dim=128, block_tokens=16)
HOST_COLUMNS = (
    Column("phase", "phase", justify="left"),
    Column("code", "code", justify="left"),
    Column("wall_ms", "wall ms", 2),
    Column("kernel_ms", "kernel ms", 2),
    Column("host_ms", "host ms", 2),
    Column("host_min_ms", "host min ms", 2),
    Column("launches", "launches", 0),
    Column("vs_baseline", "host vs baseline", 2),
)


class _KernelClock:
    """Every Triton kernel of ``kvstore.codecs.triton.engine`` wrapped so the time spent in
    its launches adds up (device events on a GPU, the interpreter's wall time on the CPU)."""

    def __init__(self) -> None:
        from kvstore.codecs.triton import engine

        self._engine = engine
        self.skip = False  # interpreted launches are counted, not run
        # The launched kernels (``kernel[grid](...)``), not the device functions they call.
        self._saved = {name: value for name, value in vars(engine).items()
                       if name.endswith("_kernel") and hasattr(value, "__getitem__")}
        if not self._saved:
            raise KVStoreError("bench gpu: kvstore.codecs.triton.engine has no *_kernel to time")
        self.seconds = 0.0
        self.launches = 0
        self._events: list[tuple[object, object]] = []

    def __enter__(self) -> Self:
        for name, kernel in self._saved.items():
            setattr(self._engine, name, _Timed(kernel, self))
        return self

    def __exit__(self, *exc_info: object) -> None:
        for name, kernel in self._saved.items():
            setattr(self._engine, name, kernel)

    def reset(self) -> None:
        self.seconds, self.launches, self._events = 0.0, 0, []

    def total_s(self) -> float:
        """Kernel seconds since ``reset`` (synchronises the device first)."""
        if self._events:
            torch.cuda.synchronize()
            self.seconds += sum(a.elapsed_time(b) for a, b in self._events) / 1e3
            self._events = []
        return self.seconds


class _Timed:
    def __init__(self, kernel, clock: _KernelClock) -> None:
        self._kernel, self._clock = kernel, clock

    def __getitem__(self, grid):
        launch = self._kernel[grid]

        def timed(*args, **kwargs):
            clock = self._clock
            clock.launches += 1
            on_gpu = any(isinstance(a, torch.Tensor) and a.is_cuda for a in args)
            if on_gpu:
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                    enable_timing=True)
                begin.record()
                launch(*args, **kwargs)
                end.record()
                clock._events.append((begin, end))
                return
            start = time.perf_counter()
            if not clock.skip:
                launch(*args, **kwargs)
            clock.seconds += time.perf_counter() - start

        return timed


def _host_overhead_samples(blocks: int, repeat: int, root: str) -> dict[str, list[list]]:
    """Per phase: ``[wall s, kernel s, launches]`` of each of ``repeat`` passes after a
    warm-up. Uses only the public client API, so the same function measures another checkout
    of kvstore (``baseline``)."""
    cuda = torch.cuda.is_available()
    device = "cuda:0" if cuda else "cpu"
    spec = SPEC if cuda else HOST_SPEC
    threads = torch.get_num_threads()
    if not cuda:
        # Copies of a few hundred KiB split over torch's threads wait on busy cores on a shared
        # 2-core box: a DRAM load measured 277 ms with two threads, 18 ms with one (2026-12-01).
        torch.set_num_threads(1)
    try:
        return _passes(spec, device, blocks, repeat, root)
    finally:
        torch.set_num_threads(threads)


def _passes(spec: KVSpec, device: str, blocks: int, repeat: int, root: str
            ) -> dict[str, list[list]]:
    from kvstore.client import Client
    from kvstore.client.engine import EngineCache
    from kvstore.config import DramConfig, HbmConfig, KVStoreConfig, ServerConfig, TierConfig
    from kvstore.keys import Namespace
    from kvstore.server.daemon import DaemonThread

    cuda = device != "cpu"
    bt = spec.block_tokens
    nbytes = blocks * spec.block_bytes
    ns = Namespace(model_id="bench-host", spec=spec, tenant="default")
    shape = (2, 2 * blocks, bt, spec.num_kv_heads, spec.head_dim)
    samples: dict[str, list[list]] = {}
    with _KernelClock() as clock:
        def timed(phase: str, fn: Callable[[], object], keep: bool) -> object:
            if cuda:
                torch.cuda.synchronize()
            clock.reset()
            clock.skip = keep and not cuda
            start = time.perf_counter()
            out = fn()
            wall = time.perf_counter() - start
            kernel = clock.total_s()
            if keep:
                samples.setdefault(phase, []).append([wall, kernel, clock.launches])
            return out

        for tier in ("HBM pool", "DRAM arena"):
            hbm = TierConfig("hbm", "hbm", HbmConfig(capacity_bytes=4 * nbytes + (64 << 20),
                                                     device=device))
            dram = TierConfig("dram", "dram", DramConfig(
                capacity_bytes=(repeat + 2) * 2 * nbytes + (256 << 20), chunk_bytes=64 << 20))
            config = KVStoreConfig(tiers=(hbm, dram) if tier == "HBM pool" else (dram,),
                                   server=ServerConfig(socket_path=f"{root}/{tier[:4]}.sock",
                                                       log_level="WARNING",
                                                       lease_timeout_s=600.0))
            with DaemonThread(config) as daemon, Client(daemon.unix_address) as client:
                caches = [torch.randn(shape, device=device).to(torch.bfloat16)
                          for _ in range(spec.num_layers)]
                with EngineCache(client, ns, caches) as engine:
                    for rep in range(repeat + 1):
                        prompt = list(range(rep * 10 * blocks * bt,
                                            rep * 10 * blocks * bt + blocks * bt))
                        pages = torch.randperm(2 * blocks)[:blocks].tolist()
                        if tier == "HBM pool":
                            want = [c[:, pages].cpu() for c in caches]
                            saved = timed("save, HBM pool", lambda p=prompt, ids=pages:
                                          engine.save(p, ids), rep > 0)
                        else:  # the DRAM tier's save is the client's put: not this path
                            kv = torch.randn(spec.shape(blocks * bt)).to(torch.bfloat16)
                            want = list(kv.view(spec.num_layers, 2, blocks, bt,
                                                *kv.shape[3:]))
                            saved = client.put(ns, prompt, kv)
                        if saved != blocks * bt:
                            raise KVStoreError(f"bench gpu: saved {saved} of {blocks * bt} "
                                               "tokens")
                        target = torch.randperm(2 * blocks)[:blocks].tolist()
                        handle = timed(f"load, {tier}", lambda p=prompt, ids=target:
                                       _load(engine, p, ids), rep > 0)
                        if handle.matched_tokens != blocks * bt:
                            raise KVStoreError(f"bench gpu: loaded {handle.matched_tokens} of "
                                               f"{blocks * bt} tokens from the {tier}")
                        if rep == 0 and not all(torch.equal(c[:, target].cpu(), w)
                                                for c, w in zip(caches, want)):
                            raise KVStoreError(f"bench gpu: pages loaded from the {tier} are "
                                               "not the ones saved")
    return samples


def _summary(phase: str, got: list[list]) -> dict:
    host = sorted((wall - kernel) * 1e3 for wall, kernel, _ in got)
    return {"phase": phase, "wall_ms": _median([w * 1e3 for w, _, _ in got]),
            "kernel_ms": _median([k * 1e3 for _, k, _ in got]), "host_ms": _median(host),
            "host_min_ms": host[0], "launches": _median([n for _, _, n in got]),
            "passes": len(got)}


def _load(engine, prompt: list[int], target: list[int]):
    handle = engine.load(prompt, target, advice=False)
    handle.wait()
    return handle


def _median(values: list[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2] if values else math.nan


def _baseline_samples(baseline: str, blocks: int, repeat: int, root: str
                      ) -> dict[str, list[list]]:
    """``_host_overhead_samples`` of this file run against the kvstore package under
    ``baseline`` (another checkout), in a child process."""
    import json
    import subprocess
    import sys

    if not os.path.isdir(os.path.join(baseline, "kvstore")):
        raise KVStoreError(f"bench gpu: --baseline {baseline} holds no kvstore package")
    code = ("import json, runpy, sys; sys.path.insert(0, sys.argv[1]); "
            "m = runpy.run_path(sys.argv[2]); "
            "print('SAMPLES ' + json.dumps(m['_host_overhead_samples']("
            "*map(int, sys.argv[3:5]), sys.argv[5])))")
    os.makedirs(f"{root}/base", exist_ok=True)
    done = subprocess.run([sys.executable, "-c", code, os.path.abspath(baseline), __file__,
                           str(blocks), str(repeat), f"{root}/base"], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              [os.path.abspath(baseline), *filter(None, [os.environ.get(
                                  "PYTHONPATH")])])}, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("SAMPLES ")]
    if done.returncode or not lines:
        raise KVStoreError(f"bench gpu: the baseline run failed: {done.stderr[-2000:]}")
    return json.loads(lines[-1][len("SAMPLES "):])


def run_host_overhead_bench(*, blocks: int = 512, repeat: int = 5, rounds: int = 3,
                            baseline: str | None = None) -> BenchReport:
    """The host's share of ``EngineCache.save``/``load`` of ``blocks`` blocks through a daemon
    (see ``HOST_SPEC``), ``repeat`` passes in each of ``rounds`` rounds. ``baseline``: another
    kvstore checkout measured the same way in a child process, its rounds taking turns with
    this code's (first one, then the other), each phase's host ms compared with it."""
    from kvstore.codecs.triton.common import kernels_runnable

    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    if not kernels_runnable(device):
        raise KVStoreError("kvstore bench gpu --host-overhead needs a CUDA device or "
                           "TRITON_INTERPRET=1 (the kernels run in Triton's interpreter)")
    if min(blocks, repeat, rounds) < 1:
        raise KVStoreError(f"bench gpu: blocks, repeat and rounds must be positive, got "
                           f"{blocks}, {repeat} and {rounds}")
    this: dict[str, list[list]] = {}
    base: dict[str, list[list]] = {}
    with tempfile.TemporaryDirectory(prefix="kvsh", dir="/tmp") as root:
        for r in range(rounds):
            turns = [(this, None)] + ([(base, baseline)] if baseline else [])
            for into, checkout in (turns if r % 2 else turns[::-1]):
                where = f"{root}/{r}{'b' if checkout else 't'}"
                os.makedirs(where)
                got = (_baseline_samples(checkout, blocks, repeat, where) if checkout
                       else _host_overhead_samples(blocks, repeat, where))
                for phase, passes in got.items():
                    into.setdefault(phase, []).extend(passes)
    out: list[dict] = []
    for phase, passes in this.items():
        row = _summary(phase, passes)
        old = _summary(phase, base[phase]) if phase in base else None
        if old is not None:
            out.append({**old, "code": "baseline", "vs_baseline": 1.0})
        out.append({**row, "code": "this",
                    "vs_baseline": row["host_ms"] / old["host_ms"] if old else math.nan})
    spec = SPEC if device.type == "cuda" else HOST_SPEC
    notes = ((f"{blocks} blocks of {spec.block_bytes >> 10} KiB ({spec.num_layers} layers, "
              f"{spec.num_kv_heads} KV heads of {spec.head_dim}, {spec.block_tokens} tokens): "
              f"{blocks * spec.block_tokens} tokens a phase; medians of {rounds} x {repeat} "
              "passes, each round after a warm-up pass"),
             ("host ms = wall - kernel ms: the kernels' own time (interpreted on the CPU, device "
              "events on a GPU) taken out; a load's wall holds Acquire (no Lookup), the lease "
              "parse and Release; a DRAM load's also its page copies"),
             *([f"baseline: {baseline}, rounds taking turns with this code's"]
               if baseline else ()))
    return BenchReport(name="gpu-host", title=f"EngineCache host overhead ({device.type})",
                       columns=HOST_COLUMNS, rows=tuple(out), notes=notes,
                       params={"blocks": blocks, "repeat": repeat, "rounds": rounds,
                               "spec": spec.to_dict(), "baseline": baseline or ""})

