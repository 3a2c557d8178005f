"""Multi-GPU check: the GPU engine under ``mpirun -np N`` (tensor parallel N, NCCL) against one GPU.

    python bench/tp_check.py --np 2 --out LOGDIR [--mpirun mpirun] [--tokens 160]

On the tiny demo checkpoint, for ``ar``, ``chain`` and ``ddtree`` (greedy, 3 streams of different prompt
lengths), it runs ``python -m ddtree_cupy.run --backend cupy --json`` once on one GPU and once under
``mpirun -np N launcher/bind.sh`` and compares the output tokens stream by stream.

TP = N sums bf16 partial results in another order than TP = 1 (NCCL's all-reduce of the row-parallel
projections), so the two runs are equal only up to bf16 rounding. Where they differ, the float64 numpy
reference judges both (tests/_teacher_forced.py, the same rules as the engine's GPU tests): every token of
either run must be the reference's argmax on its own prefix or a measured near-tie there. A real TP bug (a
wrong shard, a missing all-reduce, a rank taking another decision) gives gaps of order one logit std and
fails. Exit status 1 on any failure; the table is printed last.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

PROMPT_LENS = (5, 37, 90)


def run_cli(cmd, log_path):
    t0 = time.time()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    with open(log_path, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n" + p.stdout + "\n--- stderr ---\n" + p.stderr)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])}... exited {p.returncode}; see {log_path}:\n{p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1]), time.time() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--np", type=int, default=2, help="ranks (= GPUs) of the tensor-parallel run")
    ap.add_argument("--out", required=True, help="directory for logs and tp_check.json")
    ap.add_argument("--mpirun", default="mpirun")
    ap.add_argument("--tokens", type=int, default=160, help="new tokens per stream")
    ap.add_argument("--modes", nargs="+", default=["ar", "chain", "ddtree"])
    ap.add_argument("--budget", type=int, default=16)
    ap.add_argument("--backend", default="cupy", help="cupy (the point); numpy checks this script on a CPU")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)

    import numpy as np
    from ddtree_cupy.checkpoint import load_reference_weights
    from ddtree_cupy.config import TargetConfig
    from ddtree_cupy.reference.target import ReferenceTarget
    from ddtree_cupy.tinymodel import default_cache_dir, ensure_tiny_checkpoints
    import _teacher_forced as tf

    # An mpirun of another MPI implementation than mpi4py's starts N singletons (each rank 0 of 1) that
    # would all run TP = 1 and "agree": prove the launcher forms one world of N ranks first.
    probe = subprocess.run([a.mpirun, "-np", str(a.np), sys.executable, "-c",
                            "from mpi4py import MPI; c = MPI.COMM_WORLD; print(f'<rank {c.rank} of {c.size}>', flush=True)"],
                           capture_output=True, text=True)
    seen = sorted((int(r), int(n)) for r, n in re.findall(r"<rank (\d+) of (\d+)>", probe.stdout))
    if probe.returncode != 0 or seen != [(r, a.np) for r in range(a.np)]:
        print(f"{a.mpirun} -np {a.np} did not form one MPI world of {a.np} ranks (got rank/size {seen}; "
              f"exit {probe.returncode}): use the mpirun of the MPI that mpi4py was built with.\n{probe.stderr[-1500:]}")
        return 2
    tdir, ddir = ensure_tiny_checkpoints(default_cache_dir())       # made once, before any rank starts
    cfg = TargetConfig.load(tdir)
    rng = np.random.default_rng(77)
    prompts = [rng.integers(0, cfg.vocab_size - 256, n).tolist() for n in PROMPT_LENS]
    base = ["-m", "ddtree_cupy.run", "--backend", a.backend, "--json", "--model", str(tdir), "--drafter", str(ddir),
            "--ignore-eos", "--max-new-tokens", str(a.tokens), "--budget", str(a.budget)]
    for p in prompts:
        base += ["--prompt-ids", ",".join(map(str, p))]
    ref = ReferenceTarget(cfg, load_reference_weights(tdir, np.float64, cfg=cfg), np.float64)

    rows, report, ok = [], {"np": a.np, "tokens": a.tokens, "budget": a.budget, "modes": {}}, True
    for mode in a.modes:
        one, t1 = run_cli([sys.executable] + base + ["--mode", mode], os.path.join(a.out, f"tp1_{mode}.log"))
        many, tn = run_cli([a.mpirun, "-np", str(a.np), os.path.join(ROOT, "launcher", "bind.sh"), sys.executable]
                           + base + ["--mode", mode], os.path.join(a.out, f"tp{a.np}_{mode}.log"))
        per = []
        for i, (s1, sn) in enumerate(zip(one["streams"], many["streams"])):
            o1, on = s1["output_ids"], sn["output_ids"]
            same = next((j for j in range(min(len(o1), len(on))) if o1[j] != on[j]), min(len(o1), len(on)))
            verdicts = []
            if o1 != on:     # judge both runs against float64 (near-ties only)
                for what, out in ((f"TP1 {mode} stream {i}", o1), (f"TP{a.np} {mode} stream {i}", on)):
                    lg, m = tf.reference_scores(ref, prompts[i], out)
                    v = tf.judge(lg, m, out)
                    print(tf.describe(what, v))
                    verdicts.append(len(v["bad"]))
            good = all(b == 0 for b in verdicts) and len(on) == len(o1)
            ok &= good
            per.append({"stream": i, "tokens": len(on), "equal_prefix": same, "equal": o1 == on,
                        "bad_tokens": verdicts, "ok": good})
            rows.append((mode, i, len(prompts[i]), len(on), same, "yes" if o1 == on else "no",
                         "ok" if good else "FAIL", many["stats"].get("mean_accept_len", 0.0),
                         one["stats"].get("tokens_per_s", 0.0), many["stats"].get("tokens_per_s", 0.0)))
        report["modes"][mode] = {"streams": per, "tp1_s": t1, "tpn_s": tn,
                                 "tp1_stats": one["stats"], "tpn_stats": many["stats"]}
    with open(os.path.join(a.out, "tp_check.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(f"\nTP={a.np} vs TP=1, GPU engine, tiny checkpoint, greedy, {a.tokens} new tokens per stream")
    print("| mode | stream | prompt | tokens | equal prefix | identical | verdict | accept len | tok/s TP1 | tok/s TPN |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print("| %s | %d | %d | %d | %d | %s | %s | %.2f | %.1f | %.1f |" % r)
    print("ALL OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
