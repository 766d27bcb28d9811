"""Shared fixtures: small specs, namespaces and K/V tensors; what a fresh interpreter imports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvstore.keys import Namespace
from kvstore.spec import KVSpec

REPO_ROOT = Path(__file__).resolve().parents[1]  # a subprocess there imports this checkout


@pytest.fixture
def spec() -> KVSpec:
    return KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, block_tokens=16, dtype="bfloat16")


@pytest.fixture
def ns(spec: KVSpec) -> Namespace:
    return Namespace(model_id="test/model", spec=spec, revision="r1", tenant="acme")


def random_kv(spec: KVSpec, num_tokens: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(spec.shape(num_tokens), generator=g).to(spec.torch_dtype)


def random_tokens(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50_000, (n,), generator=g).tolist()


def modules_loaded_by(code: str) -> set[str]:
    """The modules a fresh interpreter holds after running ``code`` (nothing else imported)."""
    script = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, timeout=120, cwd=REPO_ROOT)
    return set(json.loads(out.stdout.splitlines()[-1]))


def under(modules: set[str], *packages: str) -> list[str]:
    """The modules in ``modules`` that are one of ``packages`` or inside one."""
    return sorted(m for m in modules for p in packages if m == p or m.startswith(p + "."))


@pytest.fixture(scope="session")
def redis_url():
    """A standalone Redis every remote test may use (each with its own key prefix)."""
    import shutil

    from .redis_servers import standalone_url, temp_root

    root = temp_root()
    url, server = standalone_url(root)
    yield url
    if server is not None:
        server.kill()
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def redis_cluster_url():
    """A 3-master Redis cluster every remote test may use (each with its own key prefix)."""
    import shutil

    from .redis_servers import cluster_url, temp_root

    root = temp_root()
    url, cluster = cluster_url(root)
    yield url
    if cluster is not None:
        cluster.stop()
    shutil.rmtree(root, ignore_errors=True)


_prefixes = iter(range(1 << 30))


@pytest.fixture
def key_prefix() -> str:
    """A key prefix no other test uses, so tests share one server without seeing each other."""
    import os

    return f"kvt{os.getpid()}x{next(_prefixes)}"
