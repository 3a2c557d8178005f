"""The custom all-reduce's choices without a GPU: the topology reader on recorded `nvidia-smi topo -m` outputs
(tests/data/topo: a two-socket PCIe box with 4 + 4 GPUs, a PCIe-switch box, NVLink boxes) and the algorithm
choice from a calibration table in bench/allreduce.py's JSON format."""
import json
from pathlib import Path

import pytest

from ddtree_cupy.comm import calibration as C
from ddtree_cupy.comm.topology import parse_topo_matrix

TOPO = Path(__file__).parent / "data" / "topo"


def test_topology_pcie_two_sockets():
    t = parse_topo_matrix((TOPO / "pcie_2socket_8gpu.txt").read_text())
    assert t.n == 8
    assert t.link(0, 1) == "NODE" and t.link(0, 4) == "SYS" and t.link(5, 6) == "NODE"
    assert t.numa == (0, 0, 0, 0, 1, 1, 1, 1)
    assert t.islands() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert t.two_level()
    assert not t.nvlink(0, 1)
    assert t.islands([0, 1, 4, 5]) == [[0, 1], [4, 5]]
    assert not t.two_level([0, 4])                 # islands of one GPU: nothing to do inside them
    assert "islands [[0, 1, 2, 3], [4, 5, 6, 7]]" in t.describe()


def test_topology_pcie_switch_and_nvlink():
    sw = parse_topo_matrix((TOPO / "pcie_switch_4gpu.txt").read_text())
    assert sw.n == 4 and sw.link(0, 1) == "PIX" and sw.link(1, 2) == "PXB"
    assert sw.islands() == [[0, 1, 2, 3]] and not sw.two_level()
    nv = parse_topo_matrix((TOPO / "nvlink_8gpu.txt").read_text())
    assert nv.n == 8 and all(nv.nvlink(i, j) for i in range(8) for j in range(8) if i != j)
    assert nv.islands() == [list(range(8))]        # NVLink everywhere: the NUMA split does not matter
    assert nv.numa[4] == 1
    two = parse_topo_matrix((TOPO / "nvlink_2gpu.txt").read_text())
    assert two.n == 2 and two.link(0, 1) == "NV18"


def test_topology_errors():
    with pytest.raises(ValueError, match="no header"):
        parse_topo_matrix("nothing here")
    bad = (TOPO / "pcie_switch_4gpu.txt").read_text().replace("GPU1\tPIX\t X", "GPU1\tPXB\t X")
    with pytest.raises(ValueError, match="one way"):
        parse_topo_matrix(bad)
    bad = (TOPO / "pcie_switch_4gpu.txt").read_text().replace("GPU2\tPXB\tPXB\t X", "GPU2\tPXB\tQQQ\t X")
    with pytest.raises(ValueError, match="unknown link word 'QQQ'"):
        parse_topo_matrix(bad)
    one = "\tGPU0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\nGPU0\t X \t0-7\t0\t\tN/A\n"
    t = parse_topo_matrix(one)
    assert t.n == 1 and t.numa == (0,)


def _bench_json(ranks=8):
    # the shape bench/allreduce.py --json writes: custom wins small payloads, two-shot the middle, NCCL large
    H = 7168
    rows = []
    for T, nccl, one, two in ((1, 26.0, 9.0, 14.0), (8, 30.0, 14.0, 16.0), (32, 44.0, 40.0, 28.0),
                              (80, 70.0, 95.0, 60.0), (160, 100.0, 180.0, 112.0), (320, 160.0, 350.0, 215.0)):
        rows.append({"tokens": T, "bytes": T * H * 2, "nccl_graph_us": nccl, "nccl_eager_us": nccl + 3,
                     "oneshot_graph_us": one, "twoshot_graph_us": two})
    return {"ranks": ranks, "device": "test", "rows": rows}


def test_choice_from_table(tmp_path):
    p = tmp_path / "ar.json"
    p.write_text(json.dumps(_bench_json()))
    t = C.load_table(str(p))
    H2 = 7168 * 2
    assert t.choose(1 * H2) == "oneshot"
    assert t.choose(8 * H2) == "oneshot"
    assert t.choose(32 * H2) == "twoshot"
    assert t.choose(80 * H2) == "twoshot"
    assert t.choose(160 * H2) == "nccl"
    assert t.choose(320 * H2) == "nccl"
    assert t.choose(16 * H2) == "twoshot"          # interpolated: one-shot 22.7 us, two-shot 20.0 us
    assert t.time_us("oneshot", 16 * H2) == pytest.approx(14 + (40 - 14) * 8 / 24)
    assert t.time_us("twoshot", 16 * H2) == pytest.approx(16 + (28 - 16) * 8 / 24)
    assert t.choose(1 * H2, cap_bytes=H2 - 2) == "nccl"      # above the buffers' capacity: never custom
    assert t.choose(1000 * H2) == "nccl"                      # beyond every measured custom size
    assert t.choose(8 * H2, allowed=("nccl", "twoshot")) == "twoshot"
    assert [c["algo"] for c in t.crossovers()] == ["oneshot", "twoshot", "nccl"]
    rt = C.table_from_json(t.to_json())
    assert rt.choose(32 * H2) == "twoshot" and rt.sizes == t.sizes


def test_choice_nccl_only_file_and_errors(tmp_path):
    old = {"ranks": 2, "rows": [{"tokens": 1, "bytes": 14336, "eager_us": 8.6, "graph_us": 7.4},
                                {"tokens": 8, "bytes": 114688, "eager_us": 10.8, "graph_us": 7.0}]}
    t = C.table_from_json(old)
    assert t.choose(14336) == "nccl" and list(t.times) == ["nccl"]
    with pytest.raises(ValueError, match="'ranks' and 'rows'"):
        C.table_from_json({"rows": []})
    with pytest.raises(ValueError, match="ascending"):
        C.CalibrationTable(2, [10, 5], {"nccl": [1.0, 2.0]})
    with pytest.raises(ValueError, match="non-positive"):
        C.CalibrationTable(2, [5, 10], {"oneshot": [1.0, -2.0]})
    with pytest.raises(ValueError, match="unknown algorithm"):
        C.CalibrationTable(2, [5], {"ring": [1.0]})
    bad = tmp_path / "x.json"
    bad.write_text("{")
    with pytest.raises(ValueError, match="not JSON"):
        C.load_table(str(bad))


class _FakeNccl:
    backend = "nccl"

    def __init__(self, rank=0, size=4):
        self.rank, self.size, self.calls = rank, size, []

    def all_reduce(self, x):
        self.calls.append(("nccl", x.nbytes))
        return x

    def broadcast_obj(self, obj, root=0):
        return obj


class _FakeAr:
    def __init__(self, mpi, cap, p2p=True, island=0):
        self.cap, self.p2p_ok, self.calls, self.island = cap, p2p, [], island
        self.algos = ("oneshot", "twoshot") + (("twolevel",) if island else ())
        self.matrix = [[True, p2p], [p2p, True]]

    def all_reduce(self, x, algo="oneshot", out=None):
        self.calls.append((algo, x.nbytes))
        return x

    def all_reduce_add_norm(self, x, residual, weight, eps, normed, algo="oneshot", residual_out=None):
        self.calls.append(("fused-" + algo, x.nbytes))
        return normed


def test_custom_comm_routes_by_table_and_capacity():
    import numpy as np
    from ddtree_cupy.comm.custom import CustomComm
    H2 = 7168 * 2
    nccl, ar = _FakeNccl(), _FakeAr(None, cap=100 * 7168)
    c = CustomComm(nccl, ar, C.table_from_json(_bench_json(4)))
    for T in (1, 32, 80, 160):
        c.all_reduce(np.zeros((T, 7168), np.uint16))
    assert ar.calls == [("oneshot", H2), ("twoshot", 32 * H2), ("twoshot", 80 * H2)]
    assert nccl.calls == [("nccl", 160 * H2)]                # NCCL faster there, and above the capacity anyway
    c.all_reduce(np.zeros((4, 7168), np.float32))             # not bf16: NCCL
    assert nccl.calls[-1] == ("nccl", 4 * 7168 * 4)
    c.all_reduce_add_norm(np.zeros((8, 7168), np.uint16), None, None, 1e-6, None)
    assert ar.calls[-1] == ("fused-oneshot", 8 * H2) and c.fused_calls == 1
    assert c.counts == {"nccl": 2, "oneshot": 2, "twoshot": 2, "twolevel": 0}
    forced = CustomComm(nccl, ar, None, mode="custom", oneshot_max_bytes=16 * H2)
    assert forced.choose(16 * H2) == "oneshot" and forced.choose(17 * H2) == "twoshot"
    assert forced.choose(101 * H2) == "nccl"
    assert CustomComm(nccl, ar, None).choose(H2) == "nccl"    # auto without a table: NCCL
    assert "from" in c.describe()
    # a table that measured two-level faster: chosen only where the group has islands
    js = _bench_json(4)
    for r in js["rows"]:
        r["twolevel_graph_us"] = r["twoshot_graph_us"] * 0.5
    t2 = C.table_from_json(js)
    assert CustomComm(nccl, ar, t2).choose(32 * H2) == "twoshot"
    assert CustomComm(nccl, _FakeAr(None, 100 * 7168, island=2), t2).choose(32 * H2) == "twolevel"
    with pytest.raises(ValueError, match="mode"):
        CustomComm(nccl, ar, None, mode="fast")


def test_make_custom_comm_without_p2p_falls_back_once(monkeypatch, capsys):
    from ddtree_cupy.comm import custom
    monkeypatch.setattr(custom, "P2PAllReduce", lambda mpi, cap: _FakeAr(mpi, cap, p2p=False))
    monkeypatch.setattr(custom, "_NOTICE_GIVEN", set())
    nccl = _FakeNccl(size=2)
    assert custom.make_custom_comm(nccl, 7168, mode="auto") is nccl
    assert custom.make_custom_comm(nccl, 7168, mode="auto") is nccl
    err = capsys.readouterr().err
    assert err.count("no peer-to-peer access") == 1 and "using NCCL" in err
    assert custom.make_custom_comm(nccl, 7168, mode="nccl") is nccl
    monkeypatch.setenv("DDT_ALLREDUCE", "bogus")
    with pytest.raises(ValueError, match="DDT_ALLREDUCE"):
        custom.make_custom_comm(nccl, 7168)


def test_make_custom_comm_reads_table(monkeypatch, tmp_path):
    from ddtree_cupy.comm import custom
    monkeypatch.setattr(custom, "P2PAllReduce", lambda mpi, cap: _FakeAr(mpi, cap))
    p = tmp_path / "t.json"
    p.write_text(json.dumps(_bench_json(4)))
    c = custom.make_custom_comm(_FakeNccl(size=4), 320 * 7168, mode="auto", table_path=str(p))
    assert isinstance(c, custom.CustomComm) and c.choose(7168 * 2) == "oneshot"
    with pytest.raises(ValueError, match="calibrated for 4 ranks"):
        custom.make_custom_comm(_FakeNccl(size=2), 320 * 7168, mode="auto", table_path=str(p))
    assert custom.DEFAULT_MODE == "nccl"


def test_island_size_of_ranks():
    from ddtree_cupy.comm.topology import island_size_of_ranks, normalize_bus_id
    t = parse_topo_matrix((TOPO / "pcie_2socket_8gpu.txt").read_text())
    assert island_size_of_ranks(t, list(range(8))) == 4
    assert island_size_of_ranks(t, [0, 1, 4, 5]) == 2
    assert island_size_of_ranks(t, [0, 4, 1, 5]) == 0          # islands are not rank ranges: no two-level
    assert island_size_of_ranks(t, [0, 1, 2, 4]) == 0          # unequal islands
    nv = parse_topo_matrix((TOPO / "nvlink_8gpu.txt").read_text())
    assert island_size_of_ranks(nv, list(range(8))) == 0       # one island
    assert normalize_bus_id("00000000:17:00.0") == normalize_bus_id("0000:17:00.0") == "0000:17:00.0"
    assert normalize_bus_id("0000:AB:00.0") == "0000:ab:00.0"
    with pytest.raises(ValueError, match="cannot parse"):
        normalize_bus_id("17:00")


def test_step_projection_reads_the_fastest_algorithm_fit(tmp_path):
    """bench/allreduce.py's JSON carries NCCL's fit and the fastest algorithm's; bench.step picks one."""
    import sys
    sys.path.insert(0, str(Path(__file__).parent.parent))
    from bench.allreduce import fit_latency_bandwidth
    from bench.step import load_allreduce_fit
    js = _bench_json(8)
    rows = js["rows"]
    js["fit"] = fit_latency_bandwidth([{"bytes": r["bytes"], "graph_us": r["nccl_graph_us"]} for r in rows], 8)
    best = [{"bytes": r["bytes"], "graph_us": min(r["nccl_graph_us"], r["oneshot_graph_us"], r["twoshot_graph_us"])}
            for r in rows]
    js["fit_best"] = fit_latency_bandwidth(best, 8)
    assert js["fit_best"]["latency_us"] < js["fit"]["latency_us"]
    p = tmp_path / "ar.json"
    p.write_text(json.dumps(js))
    us_n, _, note_n = load_allreduce_fit(str(p), 40.0)
    us_b, _, note_b = load_allreduce_fit(str(p), 40.0, "best")
    assert us_n == pytest.approx(js["fit"]["latency_us"]) and us_b == pytest.approx(js["fit_best"]["latency_us"])
    assert "NCCL" in note_n and "fastest" in note_b
    del js["fit_best"]
    p.write_text(json.dumps(js))
    with pytest.raises(SystemExit, match="fit_best"):
        load_allreduce_fit(str(p), 40.0, "best")
