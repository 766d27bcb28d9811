"""``kvstore.engine_fp8``: what an fp8 cache's namespace binds (flavour and per-tensor scales)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvstore.engine_fp8 import Fp8Cache
from kvstore.errors import InvalidArgument
from kvstore.keys import Namespace
from kvstore.spec import KVSpec

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, block_tokens=16)


def test_the_salt_names_the_flavour_and_the_scales_as_float32():
    a = Fp8Cache("fp8", (0.5, 0.25))
    assert a.salt.startswith("fp8/e4m3/")
    assert Fp8Cache(torch.float8_e4m3fn, (0.5, 0.25)).salt == a.salt
    assert Fp8Cache("fp8_e4m3", (0.5 + 1e-12, 0.25)).salt == a.salt  # the same float32
    assert Fp8Cache("fp8", (0.5, 0.2501)).salt != a.salt
    assert Fp8Cache("fp8_e5m2", (0.5, 0.25)).salt.startswith("fp8/e5m2/")
    assert Fp8Cache("fp8", ()).salt == "fp8/e4m3/static"


def test_bind_keys_the_bytes_apart_from_every_other_cache():
    fp8 = Fp8Cache("fp8", (1.0, 1.0))
    plain = Namespace(model_id="m", spec=SPEC, extra_salt="vllm/cuda")
    bound = fp8.bind(plain)
    assert bound.spec.dtype == "uint8" and bound.extra_salt == f"vllm/cuda/{fp8.salt}"
    fp8.check(bound)
    others = {plain.fingerprint, Fp8Cache("fp8", (1.0, 2.0)).bind(plain).fingerprint,
              Fp8Cache("fp8_e5m2", (1.0, 1.0)).bind(plain).fingerprint}
    assert bound.fingerprint not in others
    with pytest.raises(InvalidArgument, match="does not carry this fp8 cache"):
        fp8.check(plain)


def test_scales_are_read_from_engine_layers_and_checked():
    layers = [SimpleNamespace(_k_scale_float=0.5, _v_scale_float=0.25) for _ in range(2)]
    assert Fp8Cache.of_layers("fp8", layers).scales == (0.5, 0.25, 0.5, 0.25)
    with pytest.raises(InvalidArgument, match="engine layer 0 has no _v_scale_float"):
        Fp8Cache.of_layers("fp8", [SimpleNamespace(_k_scale_float=1.0)])
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(InvalidArgument, match="finite and positive"):
            Fp8Cache("fp8", (bad,))
    with pytest.raises(InvalidArgument, match="Fp8Cache.dtype must be one of"):
        Fp8Cache("int8", ())
    with pytest.raises(InvalidArgument, match="Fp8Cache.dtype must be one of"):
        Fp8Cache(torch.bfloat16, ())
