"""Variants of the tree measured taking turns in one run: each variant is a copy of the tree with a patch
applied (bench/patches/*.patch, or none for the tree itself), and the same command run in every copy round
after round, so drift in clocks and memory over a run hits every variant alike. The copies share CuPy's
kernel cache, which keys on the source text (kernels/compile.py): a variant's edited kernel is its own entry.

    python -m bench.ab --variant main --variant wide=bench/patches/wider-ring.patch \\
        --rounds 2 --test tests/gpu/test_persistent.py --out /tmp/ab -- python3 -m bench.persistent --gemm

Before the rounds, ``--test`` runs the given pytest targets once in every patched copy (a variant whose tests
fail is reported and left out of the rounds). Each command's full output goes to OUT/<variant>.<round>.txt;
the lines the command prints that start with a word and hold numbers are collected per variant and printed
side by side at the end (the benchmark prints; nothing here judges a time).

    python -m bench.ab --waiting [--only NAME ...] [--rounds N] [--out DIR]

runs every patch waiting in bench/patches against the tree: a patch's header (the text before its first
``diff --git``, which ``git apply`` ignores) names its GPU tests (``Test: TARGET ...``) and its benchmark
(``Measure: COMMAND``, shell words); the patches sharing both run in one comparison with the tree as ``main``."""
import argparse
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from typing import Dict, List, Optional, Tuple

ROOT = pathlib.Path(__file__).resolve().parents[1]
_SKIP = {".git", "__pycache__", ".pytest_cache"}
_SKIP_PATHS = {ROOT / "bench" / "results"}


def parse_variant(spec: str) -> Tuple[str, str]:
    """'name=path.patch' or 'name' (the tree as it is)."""
    name, _, patch = spec.partition("=")
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise ValueError(f"variant name {name!r}: letters, digits, '_', '-', '.' only")
    if patch and not (ROOT / patch).is_file() and not pathlib.Path(patch).is_file():
        raise ValueError(f"variant {name}: patch {patch} not found")
    return name, patch


def make_copy(dst: pathlib.Path, patch: str) -> None:
    """The tree (sources, no caches, results or git data) at ``dst``, with ``patch`` applied."""
    shutil.copytree(ROOT, dst, ignore=lambda d, names: [n for n in names
                                                        if n in _SKIP or pathlib.Path(d) / n in _SKIP_PATHS])
    if patch:
        p = pathlib.Path(patch)
        p = p if p.is_absolute() else (ROOT / p)
        tool = ["git", "apply"] if shutil.which("git") else ["patch", "-p1", "--batch", "-i"]
        r = subprocess.run(tool + [str(p)], cwd=dst, capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"{p.name} does not apply: {(r.stderr or r.stdout).strip()}")


def _env(copy: pathlib.Path) -> Dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(copy)                # the copy's package, ahead of any installed one
    return env


def summary_rows(text: str) -> List[str]:
    """The table-like lines of a benchmark's output: a leading word and at least two numbers."""
    out = []
    for line in text.splitlines():
        if re.match(r"^[A-Za-z][\w|]*\s", line) and len(re.findall(r"\d+\.\d+", line)) >= 2:
            out.append(line.rstrip())
    return out


PATCH_DIR = ROOT / "bench" / "patches"


def patch_header(path: pathlib.Path) -> Dict[str, str]:
    """A waiting patch's 'Test:' and 'Measure:' lines (its header, before the first 'diff --git')."""
    head = path.read_text().split("\ndiff --git", 1)[0]
    if head.startswith("diff --git"):
        head = ""
    out = {}
    for line in head.splitlines():
        key, sep, val = line.partition(":")
        if sep and key in ("Test", "Measure") and val.strip():
            out[key] = val.strip()
    return out


def waiting_groups(folder: Optional[pathlib.Path] = None) -> List[Tuple[List[str], List[str], List[pathlib.Path]]]:
    """(test targets, benchmark argv, patches) per distinct header, in patch-name order (``folder``: default
    bench/patches). A patch without a Measure line cannot be measured: an error naming it."""
    groups: Dict[Tuple[str, str], List[pathlib.Path]] = {}
    for p in sorted((folder or PATCH_DIR).glob("*.patch")):
        h = patch_header(p)
        if "Measure" not in h:
            raise ValueError(f"{p.name}: no 'Measure: COMMAND' line before its first 'diff --git'")
        groups.setdefault((h.get("Test", ""), h["Measure"]), []).append(p)
    return [(shlex.split(t), shlex.split(m), ps) for (t, m), ps in groups.items()]


def run_waiting(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.ab --waiting")
    ap.add_argument("--waiting", action="store_true")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--timeout", type=int, default=300)
    ap.add_argument("--only", nargs="+", default=None, metavar="NAME",
                    help="only these patches (file names without .patch), e.g. one comparison per run")
    args = ap.parse_args(argv)
    groups = waiting_groups()
    if args.only:
        known = {p.stem for _t, _c, ps in groups for p in ps}
        unknown = sorted(set(args.only) - known)
        if unknown:
            ap.error(f"--only: no waiting patch named {', '.join(unknown)} (waiting: {', '.join(sorted(known))})")
        groups = [(t, c, [p for p in ps if p.stem in args.only]) for t, c, ps in groups]
        groups = [g for g in groups if g[2]]
    if not groups:
        print("no patches wait in bench/patches")
        return 0
    out = pathlib.Path(args.out or tempfile.mkdtemp(prefix="ab_"))
    rc = 0
    for g, (tests, cmd, patches) in enumerate(groups):
        sub = ["--variant", "main"]
        for p in patches:
            sub += ["--variant", f"{p.stem}={p}"]
        for t in tests:
            sub += ["--test", t]
        sub += ["--rounds", str(args.rounds), "--out", str(out / f"group{g}"), "--timeout", str(args.timeout),
                "--", *cmd]
        print(f"== waiting group {g}: {', '.join(p.name for p in patches)}: {' '.join(cmd)}", flush=True)
        rc |= main(sub)
    return rc


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--waiting" in argv:
        return run_waiting(argv)
    if "--" not in argv:
        print("usage: python -m bench.ab --variant NAME[=PATCH] ... [--rounds N] [--test T ...] -- COMMAND ...",
              file=sys.stderr)
        return 2
    cut = argv.index("--")
    ap = argparse.ArgumentParser(prog="python -m bench.ab", description=__doc__.splitlines()[0])
    ap.add_argument("--variant", action="append", required=True, help="NAME or NAME=PATCH (repeatable)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--test", action="append", default=[], help="pytest target run once per variant first")
    ap.add_argument("--out", default=None, help="folder for the full outputs (default: a temporary one)")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per command")
    args = ap.parse_args(argv[:cut])
    cmd = argv[cut + 1:]
    if not cmd:
        ap.error("no command after --")
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    variants = [parse_variant(v) for v in args.variant]
    if len({n for n, _ in variants}) != len(variants):
        ap.error("variant names must differ")
    out = pathlib.Path(args.out or tempfile.mkdtemp(prefix="ab_"))
    out.mkdir(parents=True, exist_ok=True)
    work = pathlib.Path(tempfile.mkdtemp(prefix="ab_trees_"))
    copies = {}
    for name, patch in variants:
        copies[name] = work / name
        make_copy(copies[name], patch)
        print(f"variant {name}: {patch or 'the tree'} -> {copies[name]}", flush=True)
    live = [n for n, _ in variants]
    if args.test:
        for name in list(live):
            # a test file a patch adds exists only in its own copy: each variant runs the targets it has
            targets = [t for t in args.test if (copies[name] / t.split("::")[0]).exists() or t.startswith("-")]
            if not targets:
                print(f"tests {name}: none of {args.test} in this variant", flush=True)
                continue
            r = subprocess.run([sys.executable, "-m", "pytest", "-q", *targets], cwd=copies[name],
                               env=_env(copies[name]), capture_output=True, text=True,
                               timeout=args.timeout)
            (out / f"{name}.tests.txt").write_text(r.stdout + r.stderr)
            last = (r.stdout.strip().splitlines() or ["(no output)"])[-1]
            print(f"tests {name}: rc {r.returncode}: {last}", flush=True)
            if r.returncode:
                live.remove(name)
    rows: Dict[str, List[List[str]]] = {n: [] for n in live}
    for rnd in range(args.rounds):
        for name in live:
            try:
                r = subprocess.run(cmd, cwd=copies[name], env=_env(copies[name]),
                                   capture_output=True, text=True, timeout=args.timeout)
                text, rc = r.stdout + r.stderr, r.returncode
            except subprocess.TimeoutExpired as e:
                text, rc = f"{e.stdout or ''}{e.stderr or ''}\ntimed out after {args.timeout} s", 124
            (out / f"{name}.{rnd}.txt").write_text(text)
            rows[name].append(summary_rows(text))
            print(f"round {rnd} {name}: rc {rc}, {len(rows[name][-1])} rows", flush=True)
    print(f"\nfull outputs in {out}")
    for name in live:
        print(f"\n== {name}")
        for rnd, rr in enumerate(rows[name]):
            for line in rr:
                print(f"  r{rnd} {line}")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
