"""Every bad input is refused before any weight is read: exit 2, one line naming the file and the field,
never a traceback, never exit 0 with a corrupted model. Values HF allows (an eos_token_id list) work.
Also: a stream the engine refuses prints its reason and fails the run."""
from __future__ import annotations

import copy
import json
import math
import os
import shutil
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _specs import SMALL

from ddtree_cupy.checkpoint import CheckpointError, read_safetensors_header, save_safetensors
from ddtree_cupy.config import ConfigError, TargetConfig
from ddtree_cupy.run import EXIT_REFUSED, main
from ddtree_cupy.tinymodel import ensure_tiny_checkpoints


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return ensure_tiny_checkpoints(str(tmp_path_factory.mktemp("valid_ckpt")), seed=7, spec=SMALL)


def _copy_configs(src: str, dst: str) -> str:
    """A checkpoint directory whose weights are links to ``src``'s, config files copied (editable)."""
    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        s, d = os.path.join(src, f), os.path.join(dst, f)
        if os.path.exists(d):
            os.remove(d)
        if f.endswith(".json"):
            shutil.copyfile(s, d)
        else:
            os.symlink(s, d)
    return dst


def _edit(path: str, fn) -> None:
    with open(path) as f:
        d = json.load(f)
    fn(d)
    with open(path, "w") as f:
        json.dump(d, f)          # allow_nan: NaN / Infinity are written as Python's json reads them


def run(capsys, *args):
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return rc, out, err


def base_args(t, d, *extra):
    return ["--model", t, "--drafter", d, "--prompt-ids", "1,2,3", "--max-new-tokens", 3, "--backend", "numpy",
            "--json", *extra]


def text(d):
    return d["text_config"]


TARGET_CASES = [
    (lambda d: text(d)["rope_scaling"].update(factor=float("nan")), "factor"),
    (lambda d: text(d).update(rms_norm_eps=float("nan")), "rms_norm_eps"),
    (lambda d: text(d)["rope_scaling"].update(mscale_all_dim=float("nan")), "mscale_all_dim"),
    (lambda d: text(d).update(routed_scaling_factor=float("nan")), "routed_scaling_factor"),
    (lambda d: text(d).update(routed_scaling_factor=-2.5), "routed_scaling_factor"),
    (lambda d: text(d).update(rope_theta=float("inf")), "rope_theta"),
    (lambda d: text(d).update(rope_theta="abc"), "rope_theta"),
    (lambda d: text(d).update(norm_topk_prob="false"), "norm_topk_prob"),
    (lambda d: text(d).update(eos_token_id=10 ** 6), "eos_token_id"),
    (lambda d: text(d).update(eos_token_id=[1, True]), "eos_token_id"),
    (lambda d: d.update(quantization_config="int4"), "quantization_config"),
    (lambda d: d["quantization_config"].update(config_groups=[{"weights": {}}]), "config_groups"),
    (lambda d: d["quantization_config"]["config_groups"]["group_0"].update(weights=[4]), "weights"),
    (lambda d: text(d).update(hidden_size=True), "hidden_size"),
    (lambda d: text(d).update(vocab_size=2 ** 40), "vocab_size"),
]


@pytest.mark.parametrize("mutate, field", TARGET_CASES)
def test_bad_target_config_names_file_and_field(dirs, tmp_path, capsys, mutate, field):
    t, d = dirs
    bad = _copy_configs(t, str(tmp_path / "t"))
    _edit(os.path.join(bad, "config.json"), mutate)
    rc, out, err = run(capsys, *base_args(bad, d))
    assert rc == 2, (rc, err)
    line = [l for l in err.splitlines() if l.startswith("error:")]
    assert len(line) == 1 and os.path.join(bad, "config.json") in line[0] and field in line[0], err


DRAFTER_CASES = [
    (lambda d: d.update(num_target_layers="4"), "num_target_layers"),
    (lambda d: d["dflash_config"].update(target_layer_ids=[0, True, 2]), "target_layer_ids"),
    (lambda d: d["dflash_config"].update(mask_token_id=False), "mask_token_id"),
    (lambda d: d.update(rms_norm_eps=float("-inf")), "rms_norm_eps"),
    (lambda d: d.update(block_size="8"), "block_size"),
]


@pytest.mark.parametrize("mutate, field", DRAFTER_CASES)
def test_bad_drafter_config_names_file_and_field(dirs, tmp_path, capsys, mutate, field):
    t, d = dirs
    bad = _copy_configs(d, str(tmp_path / "d"))
    _edit(os.path.join(bad, "config.json"), mutate)
    rc, out, err = run(capsys, *base_args(t, bad))
    assert rc == 2, (rc, err)
    assert os.path.join(bad, "config.json") in err and field in err, err


def test_eos_token_id_list_without_tokenizer_stops_on_each(dirs, tmp_path, capsys):
    """HF allows a list: every id in it ends a stream (here the model's first greedy token)."""
    t, d = dirs
    rc, out, _ = run(capsys, *base_args(t, d, "--mode", "ar", "--max-new-tokens", 6, "--ignore-eos"))
    first = json.loads(out.strip().splitlines()[-1])["streams"][0]["output_ids"][0]
    m = _copy_configs(t, str(tmp_path / "t"))
    for f in ("tiktoken.model", "tokenizer_config.json"):
        os.remove(os.path.join(m, f))
    _edit(os.path.join(m, "config.json"), lambda c: text(c).update(eos_token_id=[(first + 1) % 512, first]))
    assert TargetConfig.load(m).eos_token_ids == ((first + 1) % 512, first)
    rc, out, err = run(capsys, *base_args(m, d, "--mode", "ar", "--max-new-tokens", 6))
    assert rc == 0, err
    s = json.loads(out.strip().splitlines()[-1])["streams"][0]
    assert s["output_ids"] == [first] and s["finish_reason"] == "stop"


@pytest.mark.parametrize("args, fragment", [
    (["--temperature", "5e-324"], "--temperature"),
    (["--temperature", "1e39"], "--temperature"),
    (["--temperature", "nan"], "--temperature"),
    (["--top-k", str(2 ** 31)], "--top-k"),
    (["--draft-window", "100000"], "--draft-window"),
    (["--draft-window", str(2 ** 40)], "--draft-window"),
    (["--max-new-tokens", str(2 ** 40)], "--max-new-tokens"),
])
def test_limits_checked_before_the_weights_load(dirs, capsys, monkeypatch, args, fragment):
    import ddtree_cupy.backend as backend

    def no_load(*a, **k):
        raise AssertionError("weights loaded before the limit was checked")
    monkeypatch.setattr(backend, "create_engine", no_load)
    t, d = dirs
    rc, _, err = run(capsys, *base_args(t, d, *args))
    assert rc == 2 and fragment in err, err


def test_huge_top_k_is_all_of_the_vocabulary(dirs, capsys):
    """top_k beyond the vocabulary keeps every id (as HF), and must not wrap around in an int32 cast."""
    t, d = dirs
    common = base_args(t, d, "--temperature", "0.9", "--seed", "5", "--mode", "ar", "--ignore-eos")
    rc0, out0, _ = run(capsys, *common, "--top-k", "0")
    rc1, out1, _ = run(capsys, *common, "--top-k", str(2 ** 31 - 1))
    assert rc0 == rc1 == 0
    ids = [json.loads(o.strip().splitlines()[-1])["streams"][0]["output_ids"] for o in (out0, out1)]
    assert ids[0] == ids[1]


def test_engine_top_k_cast_is_bounded():
    from ddtree_cupy.engine.step import top_k_i32
    assert top_k_i32(2 ** 40, 163840) == 163840 and top_k_i32(0, 10) == 0 and top_k_i32(7, 10) == 7
    with pytest.raises(ValueError, match="top_k"):
        top_k_i32(-1, 10)


def test_context_memory_check():
    from ddtree_cupy.run import context_fits
    # 61 layers x 1152 B per token: 100k tokens need 7.0 GB of cache next to the weights
    assert context_fits(100_000, 61, 60 << 30, 96 << 30)
    assert not context_fits(1_000_000, 61, 60 << 30, 96 << 30)


# ---- refused streams ------------------------------------------------------------------------------

def test_refused_stream_prints_its_reason_and_fails_the_run(dirs, capsys, monkeypatch):
    import ddtree_cupy.backend as backend
    orig = backend.NumpyEngine.generate

    def refuse_second(self, requests, *a, **k):
        res = orig(self, requests, *a, **k)
        s = res.streams[1]
        s.output_ids, s.finish_reason = [], "error"
        s.error = "request 1: KV pool full: needs 9 pages of 64 tokens, 2 of 8 free"
        return res
    monkeypatch.setattr(backend.NumpyEngine, "generate", refuse_second)
    t, d = dirs
    for one in (False, True):
        args = base_args(t, d, "--prompt-ids", "4,5", "--mode", "ar")
        if one:
            args = [a for a in args if a != "--json"]
        rc, out, err = run(capsys, *args)
        assert rc == EXIT_REFUSED != 0
        assert "error: stream 1 refused: request 1: KV pool full" in err, err
        if not one:
            js = json.loads(out.strip().splitlines()[-1])
            assert js["streams"][1]["finish_reason"] == "error" and "KV pool full" in js["streams"][1]["error"]
            assert "error" not in js["streams"][0]


def test_kv_pool_admit_validates():
    from ddtree_cupy.engine.kv_pool import KVPool
    pool = KVPool(8, 64, 2, 4, tree_rows=9)
    for bad in [(0, 5), (3, -1), (3, 2.5), (True, 5), (3, 2 ** 40), ("3", 1)]:
        with pytest.raises(ValueError):
            pool.admit("r", *bad)
    pool.check_invariants()
    assert pool.free_pages == 8
    for kw in ({"tree_rows": -1}, {"tree_rows": 1.5}):
        with pytest.raises(ValueError, match="tree_rows"):
            KVPool(8, 64, 2, 4, **kw)


# ---- safetensors headers --------------------------------------------------------------------------

def _write_raw(path, header: dict, data: bytes) -> None:
    h = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + data)


def test_overlapping_data_offsets_refused(tmp_path):
    p = str(tmp_path / "x.safetensors")
    _write_raw(p, {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                   "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}, bytes(16))
    with pytest.raises(CheckpointError, match="overlap") as e:
        read_safetensors_header(p)
    assert "'a'" in str(e.value) and "'b'" in str(e.value) and p in str(e.value)
    # a long tensor covering two later ones is found too (not only neighbours)
    _write_raw(p, {"a": {"dtype": "F32", "shape": [8], "data_offsets": [0, 32]},
                   "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]},
                   "c": {"dtype": "F32", "shape": [1], "data_offsets": [20, 24]}}, bytes(32))
    with pytest.raises(CheckpointError, match="overlap"):
        read_safetensors_header(p)


def test_overlapping_shard_refused_by_the_cli(dirs, tmp_path, capsys):
    t, d = dirs
    bad = str(tmp_path / "t")
    shutil.copytree(t, bad)
    shard = sorted(f for f in os.listdir(bad) if f.endswith(".safetensors"))[0]
    path = os.path.join(bad, shard)
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    names = [k for k in header if k != "__metadata__"]
    a, b = header[names[0]], header[names[1]]
    if a["data_offsets"][1] - a["data_offsets"][0] >= b["data_offsets"][1] - b["data_offsets"][0]:
        a, b = b, a
    size = a["data_offsets"][1] - a["data_offsets"][0]
    a["data_offsets"] = [b["data_offsets"][0], b["data_offsets"][0] + size]     # a now aliases b's bytes
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (n - len(h)) if len(h) <= n else b""
    assert len(h) == n
    open(path, "wb").write(raw[:8] + h + raw[8 + n:])
    rc, _, err = run(capsys, *base_args(bad, d))
    assert rc == 2 and "overlap" in err and shard in err, err


# ---- property tests: random corruptions -----------------------------------------------------------

BAD_VALUES = st.sampled_from([float("nan"), float("inf"), float("-inf"), -1, 0, "abc", "4", True, False, [],
                              [1, 2], {}, {"a": 1}, 2 ** 63, -(2 ** 40)])
# fields for which every value above is invalid (refusing them is the only right answer)
STRICT_FIELDS = ["hidden_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
                 "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "vocab_size", "intermediate_size",
                 "moe_intermediate_size", "rms_norm_eps", "rope_theta", "routed_scaling_factor",
                 "max_position_embeddings", "num_experts_per_tok", "n_group", "topk_group"]
ROPE_STRICT = ["factor", "original_max_position_embeddings"]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(where=st.sampled_from(["text"] * 3 + ["rope"]), pick=st.integers(0, 100), value=BAD_VALUES)
def test_property_corrupted_config_is_refused(dirs, where, pick, value):
    t, _ = dirs
    raw = json.load(open(os.path.join(t, "config.json")))
    d = copy.deepcopy(raw)
    if where == "rope":
        key = ROPE_STRICT[pick % len(ROPE_STRICT)]
        d["text_config"]["rope_scaling"][key] = value
    else:
        key = STRICT_FIELDS[pick % len(STRICT_FIELDS)]
        d["text_config"][key] = value
    with pytest.raises(ConfigError) as e:
        TargetConfig.from_dict(json.loads(json.dumps(d)), "cfg.json")
    assert "cfg.json" in str(e.value)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.sampled_from(STRICT_FIELDS), value=BAD_VALUES)
def test_property_corrupted_config_cli_never_exit_0(dirs, tmp_path_factory, key, value):
    """End to end: the CLI exits 2 with a message, never a traceback, never 0."""
    t, d = dirs
    bad = _copy_configs(t, str(tmp_path_factory.mktemp("pc")))
    _edit(os.path.join(bad, "config.json"), lambda c: text(c).update({key: value}))
    import contextlib
    import io
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main([str(a) for a in base_args(bad, d)])
    assert rc == 2 and "Traceback" not in err.getvalue() and "config.json" in err.getvalue(), err.getvalue()


def _header_strategy():
    mut = st.sampled_from(["dtype", "shape", "offsets", "overlap", "drop", "entry", "meta", "oob"])
    junk = st.one_of(st.just(None), st.booleans(), st.integers(-5, 10 ** 12), st.floats(allow_nan=True),
                     st.text(max_size=4), st.lists(st.integers(-3, 40), max_size=4),
                     st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
    return st.tuples(mut, junk, st.integers(0, 2))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=_header_strategy())
def test_property_corrupted_safetensors_header(tmp_path_factory, spec):
    """Random corruptions of a valid header: a CheckpointError naming the file, never another exception;
    the corruption is refused unless it happens to leave a valid header (then the tensors read back)."""
    kind, junk, which = spec
    rng = np.random.default_rng(0)
    tensors = {"a": rng.standard_normal((2, 3)).astype(np.float32), "b": rng.standard_normal(4).astype(np.float32),
               "c": np.arange(5, dtype=np.int32)}
    p = str(tmp_path_factory.mktemp("st") / "m.safetensors")
    save_safetensors(p, tensors)
    raw = open(p, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    name = "abc"[which]
    ent = header[name]
    if kind == "dtype":
        ent["dtype"] = junk
    elif kind == "shape":
        ent["shape"] = junk
    elif kind == "offsets":
        ent["data_offsets"] = junk
    elif kind == "overlap":
        other = header["abc"[(which + 1) % 3]]
        size = ent["data_offsets"][1] - ent["data_offsets"][0]
        start = other["data_offsets"][0] + (junk if isinstance(junk, int) and not isinstance(junk, bool) else 0) % 4
        ent["data_offsets"] = [start, start + size]
    elif kind == "drop":
        ent.pop(["dtype", "shape", "data_offsets"][which])
    elif kind == "entry":
        header[name] = junk
    elif kind == "meta":
        header["__metadata__"] = junk
    elif kind == "oob":
        ent["data_offsets"] = [o + len(data) for o in ent["data_offsets"]]
    _write_raw(p, header, data)
    try:
        infos, _ = read_safetensors_header(p)
    except CheckpointError as e:
        assert p in str(e)
        return
    # accepted: then it is a valid layout (disjoint spans inside the file) describing each tensor's size
    spans = sorted((i.offset, i.offset + i.nbytes) for i in infos.values() if i.nbytes)
    assert all(b0 >= a1 for (_, a1), (b0, _) in zip(spans, spans[1:]))
    assert all(i.offset + i.nbytes <= os.path.getsize(p) for i in infos.values())
    for i in infos.values():
        assert i.nbytes == math.prod(i.shape) * np.dtype({"F32": np.float32, "I32": np.int32}.get(i.dtype, np.uint8)).itemsize \
            or i.dtype not in ("F32", "I32")
