"""An oracle in place of the drafter's ``draft``: noise logits with a known continuation's token boosted at every
depth, so the tree holds that continuation (the float64 reference's greedy tokens, say) and walks accept long
paths. Shared by tests/gpu/test_engine.py, tests/_engine_target_emul.py and bench/diag_verify.py."""
import numpy as np


def oracle_draft_logits(rng, seqs, start, shape, off_chain_every=0):
    """[S, D, V] float32 draft logits: standard-normal noise from ``rng``; for each slot ``b`` with a sequence
    ``seqs[b]``, the token at position start[b] + d gets 12 at depth d. With ``off_chain_every = n`` the token
    5 ids further gets 13 wherever (start[b] + d) % n == 0: a wrong top-1 with the right token at rank 1, so
    accepted paths leave the top-1 chain and the KV compaction moves rows."""
    S, D, V = shape
    host = rng.standard_normal((S, D, V)).astype(np.float32)
    for b in range(S):
        seq = seqs.get(b)
        s = int(start[b])
        for d in range(1, D + 1):
            if seq is not None and s + d < len(seq):
                t = seq[s + d]
                host[b, d - 1, t] = 12.0
                if off_chain_every and (s + d) % off_chain_every == 0:
                    host[b, d - 1, (t + 5) % V] = 13.0
    return host


class OracleDraft:
    """Stands in for ``GpuDrafter.draft`` in eager mode (it reads ``start_pos`` back to the host): the
    ``oracle_draft_logits`` of ``seqs`` (slot -> token sequence) written into ``out``."""

    def __init__(self, seqs, seed=0, off_chain_every=0):
        self.seqs, self.rng, self.off_chain_every = seqs, np.random.default_rng(seed), off_chain_every

    def __call__(self, bonus, start_pos, ctx_len, out):
        out.set(oracle_draft_logits(self.rng, self.seqs, start_pos.get(), out.shape, self.off_chain_every))
        return out
