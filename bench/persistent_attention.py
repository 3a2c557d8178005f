"""The persistent executor against today's kernel chain on a target layer's attention half around its attention
kernels, at one TP = 8 rank's widths of Kimi K2.6: launch 0 = input norm, qkv_a GEMM, the qkv_a epilogue
(norms, RoPE, cache write), q_b GEMM, W_UK + RoPE against today's rms_norm, gemm_bf16, mla_qkv_a_post,
gemm_bf16, mla_head_gemm; launch 2 = W_UV, o_proj against mla_head_gemm, gemm_bf16. Same weights and inputs.

    PYTHONPATH=$PWD python3 -m bench.persistent_attention [--rows 1 8 16] [--json out.json] [--timeline]

Per shape and launch: today's chain as a CUDA graph without and with programmatic dependent launch (the
engine's decode graphs use PDL), the persistent launch as a graph, the byte floor (weights + activations
once, at the read ceiling measured in the same run), and the relative error against today's outputs. Cold
weights as in a step of 61 layers (bench/persistent.py ``_copies``). --timeline prints the launch's stage
spans (globaltimer per item).
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from bench.ceilings import measure_read_bandwidth, time_graph
from bench.persistent import _Cycle, _copies, _rel, stage_spans
from ddtree_cupy.engine import schedule as S

H, NH, QL, DN, DV = 7168, 8, 1536, 128, 128
ROW, LAT, PAGE = 576, 512, 64


def run_shape(cp, T, read_gbs, timeline=False):
    from ddtree_cupy.kernels import fused, gemm, launch, layers
    from ddtree_cupy.kernels.persistent import PersistentSegment, bind_attention_half, default_grid
    from ddtree_cupy.config import RopeConfig
    from ddtree_cupy.reference import yarn_inv_freq
    rng = np.random.default_rng(T)
    bf = lambda *s, sc=0.05: cp.asarray(((rng.standard_normal(s) * sc).astype(np.float32).view(np.uint32) >> 16)  # noqa: E731
                                        .astype(np.uint16))
    w = dict(w_qkv_a=bf(QL + ROW, H), w_q_b=bf(NH * (DN + 64), QL), w_uk_t=bf(NH, LAT, DN), w_uv=bf(NH, DV, LAT),
             w_o=bf(H, NH * DV))
    pre_bytes = w["w_qkv_a"].nbytes + w["w_q_b"].nbytes + w["w_uk_t"].nbytes
    post_bytes = w["w_uv"].nbytes + w["w_o"].nbytes
    n_copies = _copies(cp, min(pre_bytes, post_bytes))
    ws = [w] + [{k: cp.roll(v, c, axis=0 if v.ndim == 2 else 1) for k, v in w.items()} for c in range(1, n_copies)]
    h, in_w, q_a_norm, kv_a_norm, o_lat = bf(T, H, sc=1.0), bf(H, sc=1.0), bf(QL, sc=1.0), bf(LAT, sc=1.0), bf(T, NH * LAT)
    rope = RopeConfig(theta=50000.0, kind="yarn", factor=64.0, original_max_position_embeddings=4096,
                      beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)
    inv_freq = cp.asarray(yarn_inv_freq(rope, 64).astype(np.float32))
    positions = cp.asarray(np.arange(4096, 4096 + T, dtype=np.int32))
    stream_ids = cp.zeros(T, np.int32)
    kv_pos = positions.copy()
    block_table = cp.asarray(np.arange(128, dtype=np.int32)[None])
    pool = cp.zeros((128, PAGE, ROW), np.uint16)
    z = lambda *s: cp.zeros(s, np.uint16)                   # noqa: E731
    bufs = dict(normed=z(T, H), qkv=z(T, QL + ROW), c_q=z(T, QL), q=z(T, NH * (DN + 64)), q_full=z(T, NH * ROW),
                o=z(T, NH * DV), attn_part=z(T, H))
    today = {k: z(*v.shape) for k, v in bufs.items()}
    eps, amp = 1e-6, 1.25

    def pre_k(k):
        t, wk = today, ws[k]
        q3, qf = t["q"].reshape(T, NH, DN + 64), t["q_full"].reshape(T, NH, ROW)

        def run():
            layers.rms_norm(h, in_w, eps, out=t["normed"])
            gemm.gemm_bf16(t["normed"], wk["w_qkv_a"], t["qkv"])
            fused.mla_qkv_a_post(t["qkv"], q_a_norm, kv_a_norm, eps, t["c_q"], positions, inv_freq, amp, stream_ids,
                                 kv_pos, pool, block_table)
            gemm.gemm_bf16(t["c_q"], wk["w_q_b"], t["q"])
            fused.mla_head_gemm(q3[:, :, :DN], wk["w_uk_t"], qf[:, :, :LAT], pe=q3[:, :, DN:], pe_out=qf[:, :, LAT:],
                                positions=positions, inv_freq=inv_freq, amplitude=amp)
        return run

    def post_k(k):
        t, wk = today, ws[k]

        def run():
            fused.mla_head_gemm(o_lat.reshape(T, NH, LAT), wk["w_uv"], t["o"].reshape(T, NH, DV))
            gemm.gemm_bf16(t["o"], wk["w_o"], t["attn_part"])
        return run

    grid = default_grid()
    sh = S.LayerShape("dense", 1, T, H=H, nh=NH, ql=QL, dn=DN, dv=DV, F=18432 // 8)
    sc = S.build_layer(sh, grid, parts=("attention",), attention="segment", bytes_per_us_per_block=4.0e6 / grid)
    segs = []
    for k, wk in enumerate(ws):
        ops = bind_attention_half(sc, h=h, input_norm_w=in_w, eps=eps, q_a_norm=q_a_norm, kv_a_norm=kv_a_norm,
                                  latent_eps=eps, positions=positions, inv_freq=inv_freq, amplitude=amp,
                                  stream_ids=stream_ids, kv_pos=kv_pos, pool=pool, block_table=block_table,
                                  o_lat=o_lat, **wk, **bufs)
        segs.append((PersistentSegment(sc, 0, ops, trace=timeline and k == 0),
                     PersistentSegment(sc, 2, ops, trace=timeline and k == 0)))
    pre_k(0)()
    post_k(0)()
    segs[0][0].launch()
    segs[0][1].launch()
    segs[0][0].check()
    segs[0][1].check()
    errs = {n: _rel(cp, bufs[n], today[n]) for n in ("qkv", "c_q", "q", "q_full", "o", "attn_part")}
    rows = []
    act = lambda *names: sum(bufs[n].nbytes for n in names)      # noqa: E731
    for part, chain, idx, wbytes, io in (
            ("pre", pre_k, 0, pre_bytes + in_w.nbytes + q_a_norm.nbytes + kv_a_norm.nbytes,
             h.nbytes + 2 * act("normed", "qkv", "c_q", "q") + act("q_full") + T * ROW * 2),
            ("post", post_k, 1, post_bytes, o_lat.nbytes + 2 * act("o") + act("attn_part"))):
        launch.set_pdl(False)
        t_plain = time_graph(_Cycle(chain(k) for k in range(n_copies)))
        launch.set_pdl(True)
        t_pdl = time_graph(_Cycle(chain(k) for k in range(n_copies)))
        launch.set_pdl(False)
        t_pers = time_graph(_Cycle(sg[idx].launch for sg in segs))
        for sg in segs:
            sg[idx].check()
        floor = (wbytes + io) / (read_gbs * 1e3)
        row = {"T": T, "part": part, "blocks": grid, "items": sum(1 for it in sc.items if it.segment == 2 * idx),
               "today_us": t_plain, "today_pdl_us": t_pdl, "persistent_us": t_pers, "floor_us": floor,
               "weight_copies": n_copies, "rel_err_vs_today": errs}
        if timeline:
            cp.cuda.Stream.null.synchronize()
            row["stage_spans_us"] = stage_spans(segs[0][idx])
        rows.append(row)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.persistent_attention", description=__doc__.splitlines()[0])
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 8, 16])
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--timeline", action="store_true")
    args = ap.parse_args(argv)
    import cupy as cp
    read = measure_read_bandwidth()
    print(f"read ceiling {read:.0f} GB/s (this run)")
    print(f"{'T':>3} {'launch':6} {'blocks':>6} {'items':>5} {'today':>7} {'today PDL':>9} {'persist':>7} "
          f"{'floor':>6} {'pers/PDL':>8} {'pers/fl':>7}   (us)")
    rows = []
    for T in args.rows:
        for r in run_shape(cp, T, read, args.timeline):
            rows.append(r)
            print(f"{T:3d} {r['part']:6} {r['blocks']:6d} {r['items']:5d} {r['today_us']:7.1f} {r['today_pdl_us']:9.1f} "
                  f"{r['persistent_us']:7.1f} {r['floor_us']:6.1f} {r['persistent_us'] / r['today_pdl_us']:8.2f} "
                  f"{r['persistent_us'] / r['floor_us']:7.2f}")
            if args.timeline:
                for op, (a, e) in r["stage_spans_us"].items():
                    print(f"      {op:12} {a:8.2f} .. {e:8.2f}")
        print("    rel err vs today: " + ", ".join(f"{k} {v:.1e}" for k, v in rows[-1]["rel_err_vs_today"].items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"read_gbs": read, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
