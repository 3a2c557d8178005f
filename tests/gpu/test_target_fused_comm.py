"""GpuTarget with a communicator that fuses the all-reduce with the residual add + next RMSNorm
(``all_reduce_add_norm``, comm/custom.py): the fused stage sequence (no post_norm stage, the input norm reduced
to its feature copy, the final norm done by the last MLP all-reduce) gives the same logits, features and latent
cache as the unfused sequence, bit for bit, eager and from a captured graph. Rank 0 of TP = 2 on one GPU:
the stand-in communicators sum over one rank (identity), the fused one runs the unfused pair's kernel
(rms_norm with a residual) in its place, so any wrong weight, buffer or order in the restructured stages shows.
Also runs on the CPU emulation (tests/test_allreduce_fused_target_cpu.py)."""
import numpy as np
import pytest

from test_target_model import POISON, _tree_step_inputs, make_kv, poison_batch, tiny  # noqa: F401 (fixture)

pytestmark = pytest.mark.gpu


class IdentityComm:
    """Rank 0 of 2 whose all-reduce sums over this rank alone."""

    def __init__(self):
        self.rank, self.size, self.reduces = 0, 2, 0

    def all_reduce(self, x):
        self.reduces += 1
        return x


class FusingIdentityComm(IdentityComm):
    def __init__(self):
        super().__init__()
        self.fused = 0

    def all_reduce_add_norm(self, x, residual, weight, eps, normed, residual_out=None):
        from ddtree_cupy.kernels.layers import rms_norm
        self.fused += 1
        return rms_norm(x, weight, eps, out=normed, residual=residual, residual_out=residual_out)


def _run(cfg, tgt, feat, graph: bool):
    import cupy as cp
    from ddtree_cupy.models.batch import TargetBatch
    rng = np.random.default_rng(5)
    S, R, Rt = 2, 16, 8
    lens = np.array([16, 9])
    kv = make_kv(cfg, S, 1, np.random.default_rng(1))
    pre = TargetBatch(S, R, cfg, 2, len(feat), tree=False)
    pre.set(tokens=rng.integers(0, cfg.vocab_size, (S, R)), positions=np.tile(np.arange(R), (S, 1)), n_rows=lens,
            prefix_len=np.zeros(S, int))
    poison_batch(pre)
    tgt.forward(pre, kv)
    out = [pre.logits.get(), pre.features.get()]
    bt = TargetBatch(S, Rt, cfg, 2, len(feat), tree=True)
    bt.set(**_tree_step_inputs(cfg, rng, S, Rt, lens))
    poison_batch(bt)
    if graph:
        tgt.forward(bt, kv)          # first call of the shape: eager (allocates the attention workspace)
        st = cp.cuda.Stream(non_blocking=True)
        with st:
            st.begin_capture()
            tgt.forward(bt, kv)
            g = st.end_capture()
        poison_batch(bt)
        cp.cuda.Stream.null.synchronize()
        g.launch(st)
        st.synchronize()
    else:
        tgt.forward(bt, kv)
    out += [bt.logits.get(), bt.features.get(), np.stack([p.get() for p in kv.pools])]
    return out


@pytest.mark.parametrize("graph", [False, True])
def test_fused_stages_equal_unfused(tiny, graph):  # noqa: F811
    from ddtree_cupy.models.target import GpuTarget
    from ddtree_cupy.models.weights import GpuTargetWeights
    cfg, feat = tiny["cfg"], tiny["feat"]
    w = GpuTargetWeights.from_checkpoint(tiny["tdir"], cfg, 0, 2)
    plain_c, fused_c = IdentityComm(), FusingIdentityComm()
    plain = GpuTarget(cfg, w, plain_c, max_tokens=32, feature_layers=feat)
    fused = GpuTarget(cfg, w, fused_c, max_tokens=32, feature_layers=feat)
    assert fused.fuses_norms() and not plain.fuses_norms()
    a = _run(cfg, plain, feat, graph)
    b = _run(cfg, fused, feat, graph)
    for name, x, y in zip(("prefill logits", "prefill features", "tree logits", "tree features", "cache"), a, b):
        assert np.array_equal(x, y, equal_nan=True), f"{name}: fused stages differ from unfused"
    assert np.isfinite(a[2]).any()
    L = cfg.num_hidden_layers
    calls = 3 if graph else 2                        # forwards run: prefill, tree (+ the captured one)
    assert fused_c.fused == 2 * L * calls and fused_c.reduces == calls       # the embedding stays plain
    assert plain_c.reduces == (2 * L + 1) * calls
    from ddtree_cupy.models.batch import TargetBatch
    names = [n for n, _ in fused.layer_stages(1, TargetBatch(1, 1, cfg, 2, len(feat), tree=False),
                                              make_kv(cfg, 1, 1, np.random.default_rng(0)))]
    assert "post_norm" not in names and "o_proj" in names
    assert [n for n, _ in plain.layer_stages(1, TargetBatch(1, 1, cfg, 2, len(feat), tree=False),
                                             make_kv(cfg, 1, 1, np.random.default_rng(0)))].count("post_norm") == 1
