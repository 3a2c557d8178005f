"""engine.profile.count_launches swaps get_kernel in every kernel wrapper module, those of subpackages too (the
MoE launches from kernels/moe/forward.py), and restores them on exit. CPU only: no kernel is compiled."""
import importlib
import pkgutil

from ddtree_cupy import kernels
from ddtree_cupy.engine.profile import count_launches


def _wrapper_modules():
    out = {}
    for info in pkgutil.walk_packages(kernels.__path__, prefix=f"{kernels.__name__}."):
        mod = importlib.import_module(info.name)
        if info.name.rsplit(".", 1)[-1] not in ("compile", "launch", "checks") and hasattr(mod, "get_kernel"):
            out[info.name] = mod
    return out


def test_every_wrapper_module_patched_and_restored(monkeypatch):
    mods = _wrapper_modules()
    assert "ddtree_cupy.kernels.moe.forward" in mods and "ddtree_cupy.kernels.gemm" in mods
    moe_fwd = mods["ddtree_cupy.kernels.moe.forward"]
    ran = []
    monkeypatch.setattr(moe_fwd, "get_kernel", lambda spec, name, *a, **k: (lambda *x: ran.append(name)))
    before = {n: m.get_kernel for n, m in mods.items()}
    with count_launches() as c:
        assert {m.__name__ for m, _ in c._patched} == set(mods)
        assert all(m.get_kernel is not before[n] for n, m in mods.items())
        k = moe_fwd.get_kernel(None, "moe_gemm_bulk<0, 1, 8>")
        k(1)
        k(2)
    assert c.counts == {"moe_gemm_bulk": 2} and ran == ["moe_gemm_bulk<0, 1, 8>"] * 2
    assert all(m.get_kernel is before[n] for n, m in mods.items())
