"""Shared fixtures: small specs, namespaces and K/V tensors."""

from __future__ import annotations

import pytest
import torch

from kvstore.keys import Namespace
from kvstore.spec import KVSpec


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
