"""The numpy model of the INT4 MoE weight layout (cuda_src/moe_int4.cu's repack and fragment helpers) and a float64
reference MoE: the oracle of the GPU repack, of tests/test_moe_layout.py's emulated inner loop and of the GPU tests.
docs/MOE.md "Weight layout"."""
from __future__ import annotations

from typing import Optional, Tuple

import numpy as np

GROUP = 32          # INT4 scale group along K
KSTEP = 64          # K elements per repacked block (one 16-byte word per lane)


# ------------------------------------------------------------------------------------------------------
# Layout model (numpy). Mirrors nat_k / frag_row / frag_col in the .cu file.
# ------------------------------------------------------------------------------------------------------
def nat_k(w, kappa):
    """Natural k inside a 64-block of MMA column ``kappa`` (0..15) of k16 sub-tile ``w`` (0..3)."""
    w, kappa = np.asarray(w), np.asarray(kappa)
    return 32 * (w >> 1) + 8 * ((kappa & 7) >> 1) + 4 * (w & 1) + 2 * (kappa >> 3) + (kappa & 1)


def frag_row(g, idx):
    return np.asarray(g) + 8 * ((np.asarray(idx) >> 1) & 1)


def frag_col(t, idx):
    idx = np.asarray(idx)
    return 2 * np.asarray(t) + (idx & 1) + 8 * (idx >> 2)


def layout_tables():
    """Index tables of one 16x64 block: for (lane, word w, nibble position p) the source (row, k)."""
    lane = np.arange(32)[:, None, None]
    w = np.arange(4)[None, :, None]
    p = np.arange(8)[None, None, :]
    idx = 2 * (p & 3) + (p >> 2)
    row = frag_row(lane >> 2, idx)
    k = nat_k(w, frag_col(lane & 3, idx))
    return np.broadcast_to(row, (32, 4, 8)).copy(), np.broadcast_to(k, (32, 4, 8)).copy()


def scale_tables():
    """For (g, q) of one 16x64 block's scale record: (row, group inside the block)."""
    g = np.arange(8)[:, None]
    q = np.arange(4)[None, :]
    return np.broadcast_to(g + 8 * (q & 1), (8, 4)).copy(), np.broadcast_to(q >> 1, (8, 4)).copy()


def _padded_k(K: int) -> int:
    return -(-K // KSTEP) * KSTEP


def unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    """int32 [..., K/8] -> uint8 nibbles [..., K] (k-th value = nibble k % 8 of word k // 8)."""
    u = np.ascontiguousarray(packed).view(np.uint32)
    sh = (4 * np.arange(8, dtype=np.uint32))
    return ((u[..., None] >> sh) & np.uint32(0xF)).astype(np.uint8).reshape(*u.shape[:-1], u.shape[-1] * 8)


def repack_numpy(packed: np.ndarray, scale: np.ndarray, packed2: Optional[np.ndarray] = None,
                 scale2: Optional[np.ndarray] = None) -> Tuple[np.ndarray, np.ndarray]:
    """Numpy model of the GPU repack. packed int32 [E, N, K/8], scale uint16 [E, N, K/32] (and a second
    linear interleaved by 16-row tiles when given) -> (wp uint32 [E, Nf/16, Kp/64, 32, 4],
    sp uint16 [E, Nf/16, Kp/64, 8, 4])."""
    nib = unpack_nibbles(packed)
    sc = np.ascontiguousarray(scale)
    if packed2 is not None:
        nib2, sc2 = unpack_nibbles(packed2), np.ascontiguousarray(scale2)
        E, N, K = nib.shape
        nib = np.stack([nib.reshape(E, N // 16, 16, K), nib2.reshape(E, N // 16, 16, K)], axis=2).reshape(E, 2 * N, K)
        G = sc.shape[-1]
        sc = np.stack([sc.reshape(E, N // 16, 16, G), sc2.reshape(E, N // 16, 16, G)], axis=2).reshape(E, 2 * N, G)
    E, N, K = nib.shape
    Kp = _padded_k(K)
    KS = Kp // KSTEP
    nibp = np.full((E, N, Kp), 8, np.uint8)
    nibp[:, :, :K] = nib
    scp = np.zeros((E, N, Kp // GROUP), np.uint16)
    scp[:, :, :K // GROUP] = sc
    row, k = layout_tables()
    blocks = nibp.reshape(E, N // 16, 16, KS, KSTEP).transpose(0, 1, 3, 2, 4)     # [E, NT, KS, 16, 64]
    sel = blocks[:, :, :, row, k].astype(np.uint32)                               # [E, NT, KS, 32, 4, 8]
    wp = np.bitwise_or.reduce(sel << (4 * np.arange(8, dtype=np.uint32)), axis=-1)
    srow, sgrp = scale_tables()
    sblk = scp.reshape(E, N // 16, 16, KS, 2).transpose(0, 1, 3, 2, 4)            # [E, NT, KS, 16, 2]
    sp = sblk[:, :, :, srow, sgrp]                                                # [E, NT, KS, 8, 4]
    return np.ascontiguousarray(wp, dtype=np.uint32), np.ascontiguousarray(sp, dtype=np.uint16)


def fused_sort_numpy(ids: np.ndarray, n_experts: int, chunk: int):
    """Model of the gate/up prologue's shared-memory sort (sort_pairs_block): slots in expert order, inside an
    expert in pair order (the deterministic rank), unpadded. -> (chunks int32 [n, 4] (expert, first slot,
    tokens, 0), slot_pair int32 [valid pairs], bad)."""
    flat = np.asarray(ids).reshape(-1)
    valid = (flat >= 0) & (flat < n_experts)
    order = np.nonzero(valid)[0]
    slot_pair = order[np.argsort(flat[order], kind="stable")].astype(np.int32)
    counts = np.bincount(flat[valid], minlength=n_experts)
    chunks, off = [], 0
    for e in range(n_experts):
        for j in range(0, counts[e], chunk):
            chunks.append((e, off + j, min(chunk, counts[e] - j), 0))
        off += counts[e]
    return np.array(chunks, np.int32).reshape(-1, 4), slot_pair, int((~valid).sum())


def dequant_numpy(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """compressed-tensors int32 [..., N, K/8] + bf16 bits [..., N, K/32] -> float32 q * scale (exact)."""
    q = unpack_nibbles(packed).astype(np.float32) - 8.0
    s = (scale.astype(np.uint32) << np.uint32(16)).view(np.float32)
    return q * np.repeat(s, GROUP, axis=-1)


def moe_reference(x, ids, wts, gate, up, down, residual=None) -> np.ndarray:
    """float64 reference: out[t] = sum_j w[t,j] * down_e(silu(gate_e x) * up_e x) (+ residual).
    x [T, H]; ids/wts [T, k]; gate/up [E, I, H], down [E, H, I] dense (dequantised) weights."""
    x = np.asarray(x, np.float64)
    T, H = x.shape
    out = np.zeros((T, H), np.float64) if residual is None else np.array(residual, np.float64)
    ids = np.asarray(ids)
    for e in np.unique(ids):
        tok, j = np.nonzero(ids == e)
        xe = x[tok]
        g = xe @ np.asarray(gate[e], np.float64).T
        u = xe @ np.asarray(up[e], np.float64).T
        h = g / (1.0 + np.exp(-g)) * u
        y = h @ np.asarray(down[e], np.float64).T
        np.add.at(out, tok, np.asarray(wts, np.float64)[tok, j][:, None] * y)
    return out
