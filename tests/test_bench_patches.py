"""The measurement patches in bench/patches (variants built and CPU-tested, waiting for a GPU run) still apply
to the tree: a patch that no longer applies would be a variant nobody can measure."""
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PATCHES = sorted((ROOT / "bench" / "patches").glob("*.patch"))


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs a git checkout")
@pytest.mark.parametrize("patch", PATCHES, ids=[p.name for p in PATCHES])
def test_patch_applies(patch):
    r = subprocess.run(["git", "apply", "--check", str(patch)], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, f"{patch.name} no longer applies: {r.stderr}"
