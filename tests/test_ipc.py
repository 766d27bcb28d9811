"""Naming GPUs and pool regions so that processes with different CUDA_VISIBLE_DEVICES agree."""

from __future__ import annotations

import pytest
import torch

from kvstore.errors import InvalidArgument, Unavailable
from kvstore.ipc import device_id, local_device, map_region

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_host_devices_are_named_by_themselves():
    assert device_id(torch.device("cpu")) == "cpu"
    assert device_id(torch.device("cpu", 1)) == "cpu:1"


def test_a_gpu_this_process_cannot_see_is_unavailable_and_a_bad_name_refused():
    with pytest.raises(Unavailable, match="CUDA_VISIBLE_DEVICES"):
        local_device("GPU-00000000-0000-0000-0000-000000000000")
    with pytest.raises(InvalidArgument, match="device name"):
        local_device("cuda:zero")
    assert local_device("3") == torch.device("cuda", 3)  # an older daemon's ordinal


def test_regions_of_unknown_kinds_or_bad_shapes_are_refused():
    with pytest.raises(InvalidArgument, match="unknown pool region"):
        map_region("nfs:/x")
    with pytest.raises(InvalidArgument, match="malformed CUDA pool region"):
        map_region("cuda-ipc:GPU-1:12")


@cuda
@pytest.mark.gpu
def test_a_gpu_is_named_by_its_uuid_and_found_again():
    for index in range(torch.cuda.device_count()):
        name = device_id(torch.device("cuda", index))
        assert name.startswith("GPU-") and len(name) == 40
        assert local_device(name) == torch.device("cuda", index)
    assert device_id(torch.device("cuda")) == device_id(torch.device("cuda", 0))
