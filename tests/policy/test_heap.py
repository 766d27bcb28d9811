"""IndexedHeap against a sorted list: pushes, re-scores and removals in any order."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvstore.policy.heap import IndexedHeap, merge_ascending

ops = st.lists(st.tuples(st.sampled_from(["push", "remove"]), st.integers(0, 30),
                         st.floats(-100, 100)), max_size=200)


@given(ops)
def test_ascending_matches_a_sorted_reference(operations):
    heap: IndexedHeap[int] = IndexedHeap()
    reference: dict[int, tuple[float, int]] = {}
    filed = 0
    for op, k, score in operations:
        if op == "push":
            if k not in reference:
                filed += 1
                reference[k] = (score, filed)
            else:
                reference[k] = (score, reference[k][1])
            heap.push(k, score)
        else:
            reference.pop(k, None)
            heap.remove(k)
        assert len(heap) == len(reference)
    assert list(heap.ascending()) == sorted(reference, key=reference.__getitem__)
    for k, (score, _) in reference.items():
        assert k in heap and heap.score(k) == score


def test_merge_interleaves_heaps_lazily():
    a: IndexedHeap[str] = IndexedHeap()
    b: IndexedHeap[str] = IndexedHeap()
    for i, name in enumerate("acegi"):
        a.push(name, 2.0 * i)
    for i, name in enumerate("bdfhj"):
        b.push(name, 2.0 * i + 1)
    walk = merge_ascending([a, b])
    assert [next(walk) for _ in range(4)] == ["a", "b", "c", "d"]
    assert list(merge_ascending([IndexedHeap(), a]))[:2] == ["a", "c"]
