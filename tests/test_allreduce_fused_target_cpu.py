"""tests/gpu/test_target_fused_comm.py on the CPU emulation of CuPy and the kernels (tests/_kernel_emul.py), in a
subprocess: the target's fused all-reduce + norm stage sequence equals the unfused one bit for bit."""
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def test_fused_target_stages_on_cpu_emulation():
    root = os.path.dirname(HERE)
    gpu = os.path.join(HERE, "gpu")
    code = ("import sys; sys.path[:0] = [%r, %r, %r]; import _kernel_emul; _kernel_emul.install(); "
            "import pytest; "
            "sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', %r]))"
            % (root, HERE, gpu, os.path.join(gpu, "test_target_fused_comm.py")))
    r = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=600)
    tail = (r.stdout + r.stderr)[-3000:]
    assert r.returncode == 0 and "2 passed" in r.stdout, tail
