"""PDL launch path (ddtree_cupy/kernels/launch.py) without a GPU: argument marshalling, the C structure
layout handed to cuLaunchKernelEx, the switch, and which callable get_kernel hands out."""
import ctypes
import struct

import numpy as np
import pytest

from ddtree_cupy.kernels import launch


class FakeDeviceArray:
    """Stands in for a cupy.ndarray: a device pointer exposed through __cuda_array_interface__."""

    def __init__(self, ptr):
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": (4,), "typestr": "<u2", "version": 3}


def test_marshal_scalars_keep_their_dtype_bytes():
    args = (np.int32(-7), np.int64(1 << 40), np.float32(1.5), np.uint64(0), np.uint16(0xBEEF), np.float64(-2.25),
            np.bool_(True))
    got = [bytes(h) for h in launch.marshal_args(args)]
    want = [struct.pack("<i", -7), struct.pack("<q", 1 << 40), struct.pack("<f", 1.5), struct.pack("<Q", 0),
            struct.pack("<H", 0xBEEF), struct.pack("<d", -2.25), b"\x01"]
    assert got == want


def test_marshal_device_arrays_as_pointers():
    ptr = 0x7F00_1234_5670
    (h,) = launch.marshal_args([FakeDeviceArray(ptr)])
    assert isinstance(h, ctypes.c_uint64) and h.value == ptr and ctypes.sizeof(h) == 8


@pytest.mark.parametrize("bad", [3, 2.0, True, "x", np.zeros(3)])
def test_marshal_rejects_untyped_or_host_values(bad):
    with pytest.raises(TypeError, match="argument 1"):
        launch.marshal_args([np.int32(0), bad])


def test_param_array_points_at_the_values():
    """The void** kernelParams array built by launch_pdl: each entry points at that argument's bytes."""
    holders = launch.marshal_args([np.int32(11), FakeDeviceArray(0xABC0), np.float32(0.5)])
    params = (ctypes.c_void_p * 3)(*[ctypes.cast(ctypes.pointer(h), ctypes.c_void_p) for h in holders])
    assert ctypes.c_int32.from_address(params[0]).value == 11
    assert ctypes.c_uint64.from_address(params[1]).value == 0xABC0
    assert ctypes.c_float.from_address(params[2]).value == 0.5


def test_launch_config_layout_matches_cuda_h():
    # CUlaunchConfig: 7 x uint32, pad to 8, CUstream, CUlaunchAttribute*, uint32 (+ pad) on LP64
    assert launch._LaunchConfig.hStream.offset == 32
    assert launch._LaunchConfig.attrs.offset == 40
    assert launch._LaunchConfig.numAttrs.offset == 48
    # CUlaunchAttribute: 4-byte id, 4 bytes pad, 64-byte value union
    assert launch._Attr.value.offset == 8 and ctypes.sizeof(launch._Attr) == 72
    assert launch._dims(5, "grid") == (5, 1, 1) and launch._dims((2, 3), "grid") == (2, 3, 1)
    with pytest.raises(ValueError, match="grid"):
        launch._dims((0, 1), "grid")


def test_switch_and_env(monkeypatch):
    before = launch.pdl_enabled()
    try:
        launch.set_pdl(True)
        assert launch.pdl_enabled()
        launch.set_pdl(False)
        assert not launch.pdl_enabled()
    finally:
        launch.set_pdl(before)
    monkeypatch.setenv("DDT_PDL", "1")
    assert launch.env_flag("DDT_PDL", False) is True
    monkeypatch.setenv("DDT_PDL", "0")
    assert launch.env_flag("DDT_PDL", True) is False
    monkeypatch.setenv("DDT_PDL", "yes")
    with pytest.raises(ValueError, match="DDT_PDL"):
        launch.env_flag("DDT_PDL", False)


class _RecordingRaw:
    def __init__(self):
        self.calls = []
        self.max_dynamic_shared_size_bytes = 0
        self.num_regs = 42

    def __call__(self, grid, block, args, shared_mem=0):
        self.calls.append((grid, block, tuple(args), shared_mem))


def test_pdl_kernel_falls_back_to_an_ordinary_launch(monkeypatch):
    """Disabled, or on a GPU older than sm_90, a PdlKernel is exactly the RawKernel call."""
    raw = _RecordingRaw()
    monkeypatch.setattr(launch, "launch_pdl", lambda *a, **k: pytest.fail("PDL launch while disabled"))
    k = launch.PdlKernel(raw, 90)
    launch.set_pdl(False)
    k((3,), (128,), (np.int32(1),), shared_mem=64)
    old = launch.PdlKernel(raw, 80)
    try:
        launch.set_pdl(True)
        old((1,), (32,), ())
    finally:
        launch.set_pdl(False)
    assert raw.calls == [((3,), (128,), (np.int32(1),), 64), ((1,), (32,), (), 0)]
    k.max_dynamic_shared_size_bytes = 70000
    assert raw.max_dynamic_shared_size_bytes == 70000 and k.num_regs == 42


def test_pdl_kernel_uses_launch_pdl_when_enabled(monkeypatch):
    seen = []
    monkeypatch.setattr(launch, "launch_pdl", lambda ptr, g, b, a, smem: seen.append((ptr, g, b, smem)))

    class Raw(_RecordingRaw):
        class kernel:
            ptr = 0x5555
    raw = Raw()
    k = launch.PdlKernel(raw, 120)
    try:
        launch.set_pdl(True)
        k((7, 2), (256,), (np.int32(0),), shared_mem=1024)
    finally:
        launch.set_pdl(False)
    assert seen == [(0x5555, (7, 2), (256,), 1024)] and raw.calls == []
