"""The documentation tells the truth about the tree it ships in.

* every repository path a document names exists (no paths outside the repository, no absolute paths);
* every "figures of record" table equals what bench/figures.py makes of the results file it names;
* the repository speaks of the project only (its revisions, dates and measurements), not of how the work
  was organised.
"""
from __future__ import annotations

import glob
import pathlib
import re
import subprocess

import pytest

from bench import figures

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = sorted([*ROOT.glob("docs/*.md"), *ROOT.glob("docs/history/*.md"), ROOT / "README.md",
               ROOT / "launcher" / "README.md"])
TOP = ("ddtree_cupy", "cuda_src", "bench", "tests", "docs", "launcher", ".ci")
# a repository path: one of the top-level folders, then path characters (globs allowed)
PATH_RE = re.compile(r"(?<![\w./-])((?:%s)/[\w./*-]*[\w*])" % "|".join(re.escape(t) for t in TOP))
LINK_RE = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _cited_paths(text: str):
    for m in PATH_RE.finditer(text):
        yield m.group(1)


def _exists(p: str) -> bool:
    p = re.sub(r"(::\w.*|:\d+)$", "", p)
    if "*" in p:
        return bool(glob.glob(str(ROOT / p)))
    return (ROOT / p).exists()


def _in_git_history(p: str) -> bool:
    """A removed file a history document may still name: it existed in some commit."""
    p = re.sub(r"(::\w.*|:\d+)$", "", p)
    r = subprocess.run(["git", "log", "--all", "-1", "--format=%h", "--", p], cwd=ROOT, capture_output=True, text=True)
    return r.returncode == 0 and bool(r.stdout.strip())


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_doc_cites_only_existing_paths(doc):
    text = doc.read_text()
    missing = sorted({p for p in _cited_paths(text) if not _exists(p)})
    if doc.parent.name == "history":       # the history may name what was removed, if git still has it
        missing = [p for p in missing if not _in_git_history(p)]
    assert not missing, f"{doc.relative_to(ROOT)} names paths that do not exist: {missing}"
    bad_links = []
    for target in LINK_RE.findall(text):
        if re.match(r"[a-z]+://", target):
            continue
        if not (doc.parent / target).resolve().exists():
            bad_links.append(target)
    assert not bad_links, f"{doc.relative_to(ROOT)} links to missing files: {bad_links}"
    outside = re.findall(r"\.\./shared/\S*|(?<![\w.])/(?:work|home|tmp|root)/\S+", text)
    assert not outside, f"{doc.relative_to(ROOT)} names paths outside the repository: {outside}"


def test_path_check_catches_a_missing_path():
    text = "see `ddtree_cupy/kernels/no_such_module.py` and cuda_src/common.cuh"
    found = list(_cited_paths(text))
    assert found == ["ddtree_cupy/kernels/no_such_module.py", "cuda_src/common.cuh"]
    assert not _exists(found[0]) and _exists(found[1])


@pytest.mark.parametrize("name", sorted(figures.TABLES))
def test_figures_of_record_match_the_results_file(name):
    doc, _ = figures.TABLES[name]
    text = (ROOT / doc).read_text()
    block = figures.doc_block(text, name)
    assert block is not None, f"{doc} has no figures:{name} block"
    assert block == figures.block(name), (f"{doc}'s figures:{name} table differs from bench/results; "
                                          "run `python -m bench.figures --write`")


def test_one_results_file_per_benchmark_is_cited():
    results = {p.name for p in (ROOT / "bench" / "results").iterdir()}
    cited = set()
    for doc in DOCS:
        cited |= {pathlib.Path(p).name for p in _cited_paths(doc.read_text()) if p.startswith("bench/results/")}
    assert results <= cited, f"results files no document names: {sorted(results - cited)}"


# How the work was organised is not part of the project: no session numbers, issue numbers, machine loans
# or people's roles in code, docs or commit-visible text.
# "session" alone is a word of the product (a profiling session); a numbered or work-time session is not.
ORG_WORDS = re.compile(r"\b[Ss]essions?\s+#?\d|\b(?:[Tt]his|[Ee]arlier|[Pp]revious|[Nn]ext|[Ll]ast|[Ll]ater|[Tt]hat)\s+sessions?\b|\b[Ii]ssue #\d|\blead's\b|\bengineers?\b|\bnvidia-h200-x\d|\bdevice time\b"
                       r"|\bwas lent\b")


def test_repository_speaks_of_the_project_only():
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    hits = []
    for f in files:
        if f.startswith("bench/results/") or not f.endswith((".py", ".md", ".cu", ".cuh", ".sh", ".toml", "run")):
            continue
        if f == "tests/test_docs.py":
            continue
        p = ROOT / f
        if not p.is_file():
            continue
        for i, line in enumerate(p.read_text(errors="replace").split("\n"), 1):
            if ORG_WORDS.search(line):
                hits.append(f"{f}:{i}: {line.strip()[:100]}")
    assert not hits, "words about how the work was organised:\n" + "\n".join(hits[:40])
