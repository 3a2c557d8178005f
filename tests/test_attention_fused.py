"""CPU: the MLA kernel's in-kernel split combine (cuda_src/mla_attention.cu mla_group_barrier /
mla_fused_combine), through models of its work partition and its group barrier, and the launch rule that
decides where it runs (kernels/attention.py fused_combine_refusal). The kernels themselves:
tests/gpu/test_mla_attention_fused.py."""
import re

import numpy as np
import pytest

from ddtree_cupy.kernels import attention as A
from ddtree_cupy.kernels.compile import CUDA_SRC_DIR


def _cu_define(name: str) -> int:
    m = re.search(rf"#define {name} (\d+)", (CUDA_SRC_DIR / "mla_attention.cu").read_text())
    assert m, name
    return int(m.group(1))


def test_constants_match_the_kernel():
    assert A.FC_W_MAX == _cu_define("MLA_FC_W_MAX")
    assert A.MAX_SPLITS == int(re.search(r"#define ATTN_MAX_SPLITS (\d+)",
                                         (CUDA_SRC_DIR / "attn_combine.cuh").read_text()).group(1))


@pytest.mark.parametrize("bm", (16, 32))
def test_every_output_unit_is_merged_exactly_once(bm):
    """For every row count of a ksplit row tile and every split count: the blocks' shares tile the group's
    valid_m x 8 units with no gap or overlap, each block's rows are the rows of its units, and its weights
    (rows x splits) fit the kernel's shared-memory buffer."""
    for valid_m in range(1, bm + 1):
        for ns in range(2, A.MAX_SPLITS + 1):
            seen = np.zeros(valid_m * 8, np.int32)
            for sp in range(ns):
                u0, u1, r0, nr = A.fused_combine_share(sp, ns, valid_m)
                seen[u0:u1] += 1
                if nr:
                    assert r0 == u0 // 8 and r0 + nr - 1 == (u1 - 1) // 8
                    assert nr * ns <= A.FC_W_MAX, (valid_m, ns, sp)
            assert (seen == 1).all(), (valid_m, ns)


def _merge_model(part_o, part_lse, valid_m, ns, sg=4):
    """numpy model of mla_fused_combine over the whole group: each block's units, split groups sg, sg + 4, ...
    summed in order and then across the groups, as the kernel adds them."""
    out = np.full((valid_m, 512), np.nan, np.float32)
    for sp in range(ns):
        u0, u1, r0, nr = A.fused_combine_share(sp, ns, valid_m)
        for u in range(u0, u1):
            r, c0 = u // 8, (u % 8) * 64
            lse = part_lse[:, r]
            mx = lse.max()
            with np.errstate(invalid="ignore"):   # a row with every split empty: -inf - -inf, weighed 0
                w = np.where(lse == -np.inf, 0.0, np.exp2(lse - mx)).astype(np.float32)
            tot = np.float32(w.sum())
            acc = np.zeros((sg, 64), np.float32)
            for g in range(sg):
                for s in range(g, ns, sg):
                    if w[s] != 0:
                        acc[g] += w[s] * part_o[s, r, c0:c0 + 64]
            inv = np.float32(1.0) / tot if tot > 0 else np.float32(0.0)
            out[r, c0:c0 + 64] = acc.sum(0) * inv
    return out


@pytest.mark.parametrize("valid_m,ns", ((32, 65), (16, 64), (7, 3), (32, 2), (1, 256), (20, 17)))
def test_merge_model_matches_the_float64_combine(valid_m, ns):
    """The partition and the weights reproduce o = sum_i 2^(lse_i - max) o_i / sum_i 2^(lse_i - max) with empty
    splits (lse = -inf, NaN partials: never read) and a row with every split empty (zeros)."""
    rng = np.random.default_rng(valid_m * 1000 + ns)
    part_o = rng.standard_normal((ns, valid_m, 512)).astype(np.float32)
    part_lse = (rng.standard_normal((ns, valid_m)) * 4).astype(np.float32)
    empty = rng.random((ns, valid_m)) < 0.3
    if valid_m > 1:
        empty[:, 0] = True
    part_lse[empty] = -np.inf
    part_o[np.broadcast_to(empty[:, :, None], part_o.shape)] = np.nan
    got = _merge_model(part_o, part_lse, valid_m, ns)
    lse = part_lse.astype(np.float64)
    mx = np.where(np.isfinite(lse).any(0), np.max(np.where(np.isfinite(lse), lse, -1e300), 0), 0.0)
    w = np.where(np.isfinite(lse), np.exp2(lse - mx), 0.0)
    num = np.einsum("sr,src->rc", w, np.where(np.isfinite(part_o), part_o, 0.0))
    ref = np.divide(num, w.sum(0)[:, None], out=np.zeros_like(num), where=w.sum(0)[:, None] > 0)
    assert np.isfinite(got).all()
    if valid_m > 1:
        assert (got[0] == 0).all()
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert err < 1e-5, err


class _Barrier:
    """The group barrier's thread-0 protocol on two words (arrivals, generation), one atomic step at a time."""

    def __init__(self):
        self.arrive = 0
        self.gen = 0

    def block(self, ns, passed):
        g0 = self.gen                       # ld.acquire before arriving
        yield
        old, self.arrive = self.arrive, self.arrive + 1
        yield
        if old == ns - 1:
            self.arrive = 0                 # the next launch starts from zero
            yield
            self.gen += 1                   # red.release
        else:
            while self.gen == g0:
                yield
        passed.append(ns)


@pytest.mark.parametrize("seed", range(20))
def test_group_barrier_releases_no_block_early_and_rearms(seed):
    """Random interleavings of the blocks of one group over consecutive launches with different split counts:
    no block passes before every block of its launch has arrived, and the arrivals word is zero after each
    launch (a graph replays the launch with no memset)."""
    rng = np.random.default_rng(seed)
    bar = _Barrier()
    for ns in rng.integers(2, 40, size=6):
        passed, arrived = [], []
        gens = {i: bar.block(int(ns), passed) for i in range(ns)}
        steps = {i: 0 for i in range(ns)}
        while gens:
            i = int(rng.choice(list(gens)))
            try:
                next(gens[i])
                steps[i] += 1
                if steps[i] == 2:
                    arrived.append(i)
                if passed:
                    assert len(arrived) == ns, "a block passed before every block arrived"
            except StopIteration:
                del gens[i]
        assert len(passed) == ns and bar.arrive == 0


def test_launch_rule_refusals():
    ks32, large = A.MLA_CONFIGS["ks32"], A.MLA_CONFIGS["large"]
    assert A.fused_combine_refusal(ks32, 65, 2, 1, 132) is None          # 1 stream x 8 rows at 4K on the H200
    assert "not an mla_attn_ksplit" in A.fused_combine_refusal(large, 17, 2, 1, 132)
    assert "one split" in A.fused_combine_refusal(ks32, 1, 2, 1, 132)
    assert "co-resident" in A.fused_combine_refusal(ks32, 65, 2, 2, 132)  # 260 blocks
    assert "barriers" in A.fused_combine_refusal(ks32, 2, A.FC_MAX_GROUPS, 2, None)
    assert A.fused_combine_refusal(ks32, 65, 2, 2, None) is None          # occupancy not asked yet
    with pytest.raises(ValueError, match="only the mla_attn_ksplit"):
        large.fused_name
    assert ks32.fused_name == "mla_attn_ksplit<2, 32, 3, 1>"
    assert all(c.fused_name in A.MLA_KERNEL_NAMES for c in A.MLA_CONFIGS.values() if c.ksplit)
