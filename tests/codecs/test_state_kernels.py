"""State snapshots (``kvstore.codecs.triton.state``): an engine's state slots copied into a state
group's pages and back, bit for bit, against ``CacheGroup.pack``; on the CPU through Triton's
interpreter, on CUDA when there is one."""

from __future__ import annotations

import pytest
import torch

from kvstore.codecs.device import SECTION_ALIGN
from kvstore.codecs.triton.common import kernels_runnable
from kvstore.codecs.triton.state import (
    StateLayout,
    load_states,
    save_states,
    state_page_reference,
)
from kvstore.errors import CodecError
from kvstore.groups import CacheGroup

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not kernels_runnable(DEVICE),
                                reason="needs CUDA or TRITON_INTERPRET=1")
SLOTS, BLOCK = 5, 16
MAMBA = CacheGroup.state(3, {"conv": ((8, 3), "bfloat16"), "ssm": ((2, 4, 8), "float32")},
                         name="mamba")
ODD = CacheGroup.state(2, {"conv": ((5,), "uint8"), "ssm": ((3,), "float32")}, name="odd")


def states(group: CacheGroup, fill: int | None = None) -> list[dict[str, torch.Tensor]]:
    """Per layer, each part as [SLOTS, *shape]: random bits (NaN payloads included) or a
    byte pattern everywhere."""
    out = []
    for _ in range(group.num_layers):
        layer = {}
        for part in group.parts:
            nbytes = SLOTS * part.nbytes
            raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8) if fill is None else \
                torch.full((nbytes,), fill, dtype=torch.uint8)
            layer[part.name] = raw.view(part.torch_dtype).view(SLOTS, *part.shape).to(DEVICE)
        out.append(layer)
    return out


def pool(pages: int, page_bytes: int) -> tuple[torch.Tensor, int]:
    raw = torch.full((pages * page_bytes + SECTION_ALIGN,), 0xEE, dtype=torch.uint8,
                     device=DEVICE)
    pad = -raw.data_ptr() % SECTION_ALIGN
    return raw[pad:pad + pages * page_bytes], raw.data_ptr() + pad


def slot_bytes(layer_states: list[dict[str, torch.Tensor]], slot: int) -> list[torch.Tensor]:
    return [t[slot].reshape(-1).view(torch.uint8).cpu() for layer in layer_states
            for t in layer.values()]


@pytest.mark.parametrize("group", [MAMBA, ODD], ids=["mamba", "odd"])
def test_states_round_trip_bit_exact_as_the_groups_pages(group):
    src_states = states(group)
    src = StateLayout.of(group, BLOCK, src_states)
    assert src.word == (8 if group is MAMBA else 1)
    page_bytes = -(-src.page_bytes // SECTION_ALIGN) * SECTION_ALIGN
    memory, base = pool(2, page_bytes)
    addrs = [base + page_bytes, base]
    save_states(src, addrs, [3, 1])
    for i, slot in enumerate([3, 1]):
        at = (1 - i) * page_bytes
        page = memory[at:at + src.page_bytes].cpu()
        assert torch.equal(page, state_page_reference(src, slot).reshape(-1))  # padding zeroed
    dst_states = states(group, fill=0x5A)
    dst = StateLayout.of(group, BLOCK, dst_states)
    load_states(dst, addrs, [0, 4])
    assert all(torch.equal(a, b) for a, b in zip(slot_bytes(src_states, 3),
                                                 slot_bytes(dst_states, 0)))
    assert all(torch.equal(a, b) for a, b in zip(slot_bytes(src_states, 1),
                                                 slot_bytes(dst_states, 4)))
    for slot in (1, 2, 3):  # slots outside the load keep the sentinel
        assert all(bool((b == 0x5A).all()) for b in slot_bytes(dst_states, slot))


def test_bad_states_and_slots_are_refused_by_name():
    good = states(MAMBA)
    with pytest.raises(CodecError, match="layer 1 part ssm: expected"):
        StateLayout.of(MAMBA, BLOCK, [good[0], {**good[1], "ssm": good[1]["ssm"].half()}, good[2]])
    with pytest.raises(CodecError, match="takes a state group"):
        StateLayout.of(CacheGroup.attention(3, 2, 8), BLOCK, good)
    strided = {**good[0], "conv": good[0]["conv"].transpose(1, 2).contiguous().transpose(1, 2)}
    with pytest.raises(CodecError, match="layer 0 part conv: a slot's state must be contiguous"):
        StateLayout.of(MAMBA, BLOCK, [strided, good[1], good[2]])
    layout = StateLayout.of(MAMBA, BLOCK, good)
    _, base = pool(1, 1 << 16)
    with pytest.raises(CodecError, match=r"slots span \[5, 5\], the engine keeps 5"):
        save_states(layout, [base], [5])
    with pytest.raises(CodecError, match="aligned"):
        load_states(layout, [base + 8], [0])
