"""Where a shared-memory put's time goes: 32 MiB prompts (16 x 2 MiB blocks) through a fresh
daemon, the client's Reserve, its writing of the slots and the Commit timed apart, against one
copy of the same bytes into shared memory, medians over the last puts.

``--pregrow``: the DRAM tier is grown by as many puts first and emptied, so the puts timed
neither grow it nor evict (else a small ``--capacity`` times puts that evict). From the
repository root: ``python bench/put_phases.py [--puts 60] [--capacity 3GiB] [--pregrow]``;
one JSON line.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

from kvstore.client import Client
from kvstore.client.mappings import write_reservation
from kvstore.keys import Namespace
from kvstore.spec import KVSpec

SPEC = KVSpec(num_layers=32, num_kv_heads=8, head_dim=128, block_tokens=16)  # 2 MiB blocks
TOKENS = 256  # 16 blocks, 32 MiB
EMPTY_EVERY = 60  # with --pregrow, the tier is emptied (untimed) this often


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--puts", type=int, default=60)
    parser.add_argument("--capacity", default="3GiB")
    parser.add_argument("--pregrow", action="store_true")
    args = parser.parse_args()
    root = tempfile.mkdtemp()
    sock = f"{root}/kv.sock"
    with open(f"{root}/log", "w") as log:
        daemon = subprocess.Popen(
            [sys.executable, "-m", "kvstore", "serve", "--socket", sock, "--dram-capacity",
             args.capacity, "--ssd-path", f"{root}/ssd", "--ssd-capacity", "1GiB",
             "--metrics-port", "0"], stdout=log, stderr=subprocess.STDOUT)
    try:
        for _ in range(300):
            if os.path.exists(sock):
                break
            time.sleep(0.1)
        client = Client(sock)
        ns = Namespace("bench", spec=SPEC)
        kv = torch.randn(SPEC.num_layers, 2, TOKENS, SPEC.num_kv_heads,
                         SPEC.head_dim).to(torch.bfloat16)
        client.put(ns, list(range(SPEC.block_tokens)), kv[:, :, :SPEC.block_tokens])  # maps
        if args.pregrow:
            for i in range(args.puts):
                client.put(ns, [10**9 + i * 1000 + j for j in range(TOKENS)], kv)
            client.evict(everything=True)
            time.sleep(1)
        phases: dict[str, list[float]] = {"put": [], "reserve": [], "write": [], "commit": []}
        for i in range(args.puts):
            if args.pregrow and i and i % EMPTY_EVERY == 0:
                client.evict(everything=True)
            tokens = [i * 100_000 + j for j in range(TOKENS)]
            t0 = time.perf_counter()
            reservation = client.reserve(ns, tokens)
            t1 = time.perf_counter()
            write_reservation(client._zero_copy.maps, ns, kv, reservation, 0,
                              client._copy_threads)
            t2 = time.perf_counter()
            client.commit(reservation.reservation_id)
            t3 = time.perf_counter()
            for name, seconds in zip(phases, (t3 - t0, t1 - t0, t2 - t1, t3 - t2)):
                phases[name].append(seconds)
        dst_map = mmap.mmap(-1, kv.numel() * 2)
        dst = np.frombuffer(dst_map, np.uint8)
        src = kv.view(torch.uint8).numpy().reshape(-1)
        dst[:] = 0
        copies = []
        for _ in range(30):
            t0 = time.perf_counter()
            np.copyto(dst, src)
            copies.append(time.perf_counter() - t0)
        client.close()
    finally:
        daemon.terminate()
        daemon.wait()

    def ms(xs: list[float]) -> float:
        return round(statistics.median(xs[len(xs) // 2:]) * 1e3, 2)

    out = {name: ms(xs) for name, xs in phases.items()}
    out["one_copy"] = round(statistics.median(copies) * 1e3, 2)
    out["put_of_one_copy"] = round(out["one_copy"] / out["put"], 3)
    out.update(cpus=os.cpu_count(), copy_threads=client._copy_threads, pregrow=args.pregrow)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
