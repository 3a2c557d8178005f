"""bench/ab.py on the CPU: every variant runs in its own patched copy of the tree, with the copy's package
imported, round after round; a variant whose tests fail is left out."""
import difflib
import shutil
import subprocess
import sys

import pytest

from bench import ab

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git apply makes the patched copies")

MARK = """diff --git a/ab_marker.txt b/ab_marker.txt
new file mode 100644
--- /dev/null
+++ b/ab_marker.txt
@@ -0,0 +1 @@
+patched 1.25 2.5
"""


def _failing_patch() -> str:
    """A patch that adds a failing test to a small existing test file (which passes or skips unpatched)."""
    rel = "tests/test_bench_patches.py"
    old = (ab.ROOT / rel).read_text().splitlines(keepends=True)
    new = old + ["\n", "\n", "def test_fails():\n", "    assert False\n"]
    return "".join(difflib.unified_diff(old, new, f"a/{rel}", f"b/{rel}"))


PROBE = ("import pathlib, ddtree_cupy; p = pathlib.Path('ab_marker.txt'); "
         "print(p.read_text().strip() if p.exists() else 'plain 0.50 0.75'); "
         "print('pkg', pathlib.Path(ddtree_cupy.__file__).resolve().parents[1])")


def test_variants_run_in_their_own_patched_copies(tmp_path, capsys):
    (tmp_path / "mark.patch").write_text(MARK)
    (tmp_path / "fails.patch").write_text(_failing_patch())
    out = tmp_path / "out"
    rc = ab.main(["--variant", "base", "--variant", f"mark={tmp_path / 'mark.patch'}",
                  "--variant", f"bad={tmp_path / 'fails.patch'}", "--rounds", "2",
                  "--test", "tests/test_bench_patches.py", "--out", str(out), "--", sys.executable, "-c", PROBE])
    assert rc == 0
    text = capsys.readouterr().out
    assert "tests bad: rc 1" in text                      # its own test fails: no rounds for it
    assert not (out / "bad.0.txt").exists()
    for rnd in (0, 1):
        base, mark = (out / f"base.{rnd}.txt").read_text(), (out / f"mark.{rnd}.txt").read_text()
        assert "plain 0.50 0.75" in base and "patched 1.25 2.5" in mark
        # each copy imports its own package, not the tree's
        assert f"pkg {out}" not in base and str(ab.ROOT) not in base.split("pkg ")[1]
        assert base.split("pkg ")[1].strip() != mark.split("pkg ")[1].strip()
    assert "r1 patched 1.25 2.5" in text and "r0 plain 0.50 0.75" in text


def test_bad_variants_are_refused(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        ab.parse_variant("x=no/such.patch")
    with pytest.raises(ValueError, match="variant name"):
        ab.parse_variant("a b")
    (tmp_path / "bad.patch").write_text(MARK.replace("/dev/null", "a/missing.txt").replace("new file mode 100644\n", ""))
    with pytest.raises(RuntimeError, match="does not apply"):
        ab.make_copy(tmp_path / "copy", str(tmp_path / "bad.patch"))


def test_git_apply_works_outside_a_repository(tmp_path):
    # the device machine's copy of the tree may have no .git: the copies are plain folders either way
    (tmp_path / "p.patch").write_text(MARK)
    d = tmp_path / "plain"
    d.mkdir()
    r = subprocess.run(["git", "apply", str(tmp_path / "p.patch")], cwd=d, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert (d / "ab_marker.txt").read_text().strip() == "patched 1.25 2.5"


def test_waiting_patches_grouped_by_their_headers(tmp_path, monkeypatch, capsys):
    # each waiting patch names its tests and its benchmark before its first 'diff --git'; patches sharing both
    # run in one comparison against the tree, the others in their own; a patch with no Measure line is refused
    probe = f"{sys.executable} -c \"{PROBE}\""
    (tmp_path / "a.patch").write_text(f"Why: a marker\nTest: tests/test_bench_patches.py\nMeasure: {probe}\n\n" + MARK)
    (tmp_path / "b.patch").write_text(f"Measure: {probe}\n" + MARK)
    (tmp_path / "c.patch").write_text(f"Test: tests/test_bench_patches.py\nMeasure: {probe}\n" + MARK)
    groups = ab.waiting_groups(tmp_path)
    assert [[p.name for p in ps] for _t, _c, ps in groups] == [["a.patch", "c.patch"], ["b.patch"]]
    assert groups[0][0] == ["tests/test_bench_patches.py"] and groups[1][0] == []
    assert groups[0][1][0] == sys.executable and groups[0][1][1] == "-c"
    assert ab.patch_header(tmp_path / "b.patch") == {"Measure": probe}
    monkeypatch.setattr(ab, "PATCH_DIR", tmp_path)
    assert ab.main(["--waiting", "--rounds", "1", "--out", str(tmp_path / "out"), "--timeout", "120"]) == 0
    text = capsys.readouterr().out
    assert "== waiting group 0: a.patch, c.patch" in text and "== waiting group 1: b.patch" in text
    assert text.count("r0 patched 1.25 2.5") == 3 and text.count("r0 plain 0.50 0.75") == 2   # main in each group
    assert ab.main(["--waiting", "--only", "b", "--rounds", "1", "--out", str(tmp_path / "o2")]) == 0
    text = capsys.readouterr().out
    assert "== waiting group 0: b.patch" in text and "a.patch" not in text
    with pytest.raises(SystemExit):
        ab.main(["--waiting", "--only", "nosuch"])
    assert "no waiting patch named nosuch" in capsys.readouterr().err
    (tmp_path / "d.patch").write_text(MARK)
    with pytest.raises(ValueError, match="d.patch: no 'Measure: COMMAND'"):
        ab.waiting_groups(tmp_path)


def test_the_kept_patches_name_their_measurement():
    for _tests, cmd, patches in ab.waiting_groups():
        assert cmd and patches
