"""KV pool bookkeeping: admission reserves everything up front, refusals change nothing, release
returns every page, and thousands of random joins/leaves never lose or double-own a page."""
import numpy as np
import pytest

from ddtree_cupy.engine.kv_pool import KVPool, KVPoolFull


def pool(**kw):
    args = dict(num_pages=40, page_size=64, max_streams=4, max_pages_per_stream=16, tree_rows=65)
    args.update(kw)
    return KVPool(**args)


def test_admit_reserves_prompt_output_and_tree_rows():
    p = pool()
    s = p.admit("a", prompt_len=100, max_new_tokens=200)
    need = -(-(100 + 200 + 65) // 64)
    assert p.free_pages == 40 - need and p.capacity(s) == need * 64
    assert (p.block_table[s, :need] >= 0).all() and (p.block_table[s, need:] == -1).all()
    p.check_invariants()


def test_refusal_names_the_problem_and_changes_nothing():
    p = pool(num_pages=10)
    p.admit("a", 300, 100)                      # 8 pages
    before = (p.free_pages, p.block_table.copy(), p.active_slots)
    with pytest.raises(KVPoolFull, match="KV pool full: needs 4 pages of 64 tokens, 2 of 10 free"):
        p.admit("b", 64, 64)
    with pytest.raises(KVPoolFull, match="more than one stream may hold"):
        p.admit("c", 5000, 10)
    assert (p.free_pages, p.active_slots) == before[0::2] and np.array_equal(p.block_table, before[1])
    p.check_invariants()


def test_slots_exhausted_and_empty_prompt():
    p = pool(max_streams=2)
    p.admit("a", 10, 10); p.admit("b", 10, 10)
    with pytest.raises(KVPoolFull, match="all 2 stream slots are busy"):
        p.admit("c", 10, 10)
    with pytest.raises(ValueError, match="empty prompt"):
        p.admit("d", 0, 10)


def test_random_join_leave_keeps_invariants_and_returns_to_empty():
    rng = np.random.default_rng(7)
    p = pool(num_pages=64, max_streams=10, max_pages_per_stream=20)
    live = []
    for step in range(3000):
        if live and (rng.random() < 0.45 or len(live) == 10):
            p.release(live.pop(rng.integers(len(live))))
        else:
            try:
                live.append(p.admit(step, int(rng.integers(1, 600)), int(rng.integers(0, 600))))
            except KVPoolFull:
                pass
        if step % 97 == 0:
            p.check_invariants()
    for s in live:
        p.release(s)
    p.check_invariants()
    assert p.free_pages == 64 and p.active_slots == [] and (p.block_table == -1).all()


def test_release_unknown_slot():
    with pytest.raises(KeyError, match="slot 3 is not in use"):
        pool().release(3)
