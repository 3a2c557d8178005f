"""Run under mpirun -np N: the TP=N sharded reference target equals TP=1 on the tiny checkpoint.

Every rank loads only its shard and runs the sharded model; rank 0 also runs the whole model (TP=1) and
compares logits, captured features and the latent cache after a prefill, a decode step and a tree verify.
argv[1]: directory holding (or to hold) the tiny checkpoints, shared by the ranks.
"""
import sys

import numpy as np

from ddtree_cupy.checkpoint import load_reference_weights
from ddtree_cupy.config import TargetConfig
from ddtree_cupy.dist import init_communicator, guarded
from ddtree_cupy.reference.target import ReferenceTarget
from ddtree_cupy.tinymodel import ensure_tiny_checkpoints

comm = init_communicator("numpy")


def run(tgt):
    rng = np.random.default_rng(5)                      # same draws on every rank
    cfg = tgt.cfg
    cache = tgt.new_cache()
    prompt = rng.integers(0, cfg.vocab_size, 23)
    caps = (1, 2)
    out = []
    lg, ft = tgt.forward(prompt, np.arange(prompt.size), cache, capture_layers=caps)
    out += [lg, ft]
    lg, ft = tgt.forward(rng.integers(0, cfg.vocab_size, 1), np.array([prompt.size]), cache, capture_layers=caps)
    out += [lg, ft]
    # a tree: row 0 root, parents drawn before children
    n = 9
    parents = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, n)])
    depth = np.zeros(n, int)
    vis = np.eye(n, dtype=bool)
    for i in range(1, n):
        depth[i] = depth[parents[i]] + 1
        vis[i] |= vis[parents[i]]
    s = cache.length
    lg, ft = tgt.forward(rng.integers(0, cfg.vocab_size, n), s + depth, cache, visible=vis, capture_layers=caps)
    out += [lg, ft] + [cache.layer(l).copy() for l in range(cfg.num_hidden_layers)]
    return out


def main():
    if comm.is_root:
        tdir, _ = ensure_tiny_checkpoints(sys.argv[1])
    tdir = comm.broadcast_obj(tdir if comm.is_root else None)
    cfg = TargetConfig.load(tdir)
    shard = load_reference_weights(tdir, np.float64, tp_rank=comm.rank, tp_size=comm.size)
    got = run(ReferenceTarget(cfg, shard, np.float64, comm=comm))
    if comm.is_root:
        from ddtree_cupy.dist import SingleRank
        want = run(ReferenceTarget(cfg, load_reference_weights(tdir, np.float64), np.float64, comm=SingleRank()))
        for i, (g, w) in enumerate(zip(got, want)):
            err = np.linalg.norm(g - w) / np.linalg.norm(w)
            assert g.shape == w.shape and err < 1e-12, (i, g.shape, w.shape, err)
        assert int(np.argmax(got[4][-1])) == int(np.argmax(want[4][-1]))
    comm.barrier()
    print(f"rank {comm.rank}/{comm.size} OK", flush=True)
    return 0


sys.exit(guarded(main, comm))
