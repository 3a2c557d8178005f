"""Checkpoint reader: round trips on tiny real-format checkpoints, TP slices, prefix mapping, every malformed case."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from _specs import MICRO

from ddtree_cupy.bf16 import bf16_bits_to_f32
from ddtree_cupy.checkpoint import (INDEX_FILE, ST_DTYPES, Checkpoint, CheckpointError, expected_drafter_tensors,
                                    expected_target_tensors, load_drafter_weights, load_reference_weights,
                                    read_safetensors_header, save_safetensors, tp_split)
from ddtree_cupy.config import DrafterConfig, TargetConfig
from ddtree_cupy.int4 import dequantize
from ddtree_cupy.tinymodel import (TinySpec, drafter_tensors, ensure_tiny_checkpoints, target_tensors,
                                   write_tiny_drafter, write_tiny_target)

SEED = 3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return ensure_tiny_checkpoints(str(tmp_path_factory.mktemp("tinycache")), seed=SEED)


@pytest.fixture
def micro(tmp_path):
    t = write_tiny_target(str(tmp_path / "target"), 1, MICRO)
    d = write_tiny_drafter(str(tmp_path / "drafter"), 1, MICRO)
    return t, d


def _as_float(v):
    # float32 holds bf16 values and INT4 products (4-bit x 8-bit mantissas) exactly
    dt, a = v if isinstance(v, tuple) else (None, v)
    return bf16_bits_to_f32(a) if dt == "BF16" else np.asarray(a, dtype=np.float32)


def _expected_weights(tensors):
    """What load_*_weights must return, computed from the generator's raw tensors."""
    out = {}
    for name, v in tensors.items():
        if name.endswith(".weight_packed"):
            base = name[: -len(".weight_packed")]
            shape = tensors[base + ".weight_shape"]
            out[base + ".weight"] = dequantize(v, tensors[base + ".weight_scale"][1], shape, np.float32)
        elif not name.endswith((".weight_scale", ".weight_shape")):
            out[name] = _as_float(v)
    return out


# ---- round trips ------------------------------------------------------------------------------------

def test_reference_weights_round_trip(tiny):
    target_dir, drafter_dir = tiny
    spec = TinySpec()
    want = _expected_weights(target_tensors(SEED, spec))
    got = load_reference_weights(target_dir, np.float64)
    assert set(got) == set(want)
    for name, a in want.items():
        assert got[name].dtype == np.float64
        assert np.array_equal(got[name], a), name
    # the routed experts really are INT4: at most 16 distinct values per group of 32
    w = got["model.layers.2.mlp.experts.5.down_proj.weight"]
    assert all(len(np.unique(w[r, :32])) <= 16 for r in range(8))
    dwant = _expected_weights(drafter_tensors(SEED, spec))
    dgot = load_drafter_weights(drafter_dir, np.float32)
    assert set(dgot) == set(dwant)
    for name, a in dwant.items():
        assert dgot[name].dtype == np.float32
        assert np.array_equal(dgot[name], a), name


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_tp_slices_reassemble(tiny, tp):
    target_dir, drafter_dir = tiny
    for loader, d in ((load_reference_weights, target_dir), (load_drafter_weights, drafter_dir)):
        whole = loader(d, np.float32)
        parts = [loader(d, np.float32, tp_rank=r, tp_size=tp) for r in range(tp)]
        for name, w in whole.items():
            dim = tp_split(name)
            if dim is None:
                for p in parts:
                    np.testing.assert_array_equal(p[name], w, err_msg=name)
            else:
                assert parts[0][name].shape[dim] * tp == w.shape[dim], name
                np.testing.assert_array_equal(np.concatenate([p[name] for p in parts], axis=dim), w, err_msg=name)


def test_get_int4_shards(tiny):
    target_dir, _ = tiny
    ck = Checkpoint(target_dir)
    spec = TinySpec()
    H, I = spec.hidden_size, spec.moe_intermediate_size
    for proj, (n, k), dim in (("gate_proj", (I, H), 0), ("down_proj", (H, I), 1)):
        base = f"model.layers.1.mlp.experts.7.{proj}"
        packed, scale, shape = ck.get_int4(base)
        assert shape == (n, k) and packed.dtype == np.int32 and scale.dtype == np.uint16
        for tp in (2, 4, 8):
            shards = [ck.get_int4(base, r, tp) for r in range(tp)]
            want = (n // tp, k) if dim == 0 else (n, k // tp)
            assert all(s[2] == want for s in shards)
            np.testing.assert_array_equal(np.concatenate([s[0] for s in shards], axis=dim), packed)
            np.testing.assert_array_equal(np.concatenate([s[1] for s in shards], axis=dim), scale)
            # each shard dequantizes on its own to the matching slice of the whole weight
            whole = dequantize(packed, scale, (n, k))
            r = tp - 1
            sl = np.split(whole, tp, axis=dim)[r]
            np.testing.assert_array_equal(dequantize(*shards[r]), sl)


def test_experts_int4_stack(micro):
    target_dir, _ = micro
    ck = Checkpoint(target_dir)
    for tp, r in ((1, 0), (2, 1)):
        for proj in ("up_proj", "down_proj"):
            packed, scale, shape = ck.get_experts_int4(1, proj, MICRO.n_routed_experts, r, tp)
            assert packed.shape[0] == scale.shape[0] == MICRO.n_routed_experts
            for e in range(MICRO.n_routed_experts):
                p, s, sh = ck.get_int4(f"model.layers.1.mlp.experts.{e}.{proj}", r, tp)
                assert sh == shape
                np.testing.assert_array_equal(packed[e], p)
                np.testing.assert_array_equal(scale[e], s)
    with pytest.raises(CheckpointError, match="cannot stack"):
        ck.get_int4_stack(["model.layers.1.mlp.experts.0.up_proj", "model.layers.1.mlp.experts.0.down_proj"], 0, 2)
    with pytest.raises(CheckpointError, match="proj must be"):
        ck.get_experts_int4(1, "gate", 4)


def test_int4_split_off_group_boundary(micro):
    target_dir, _ = micro
    ck = Checkpoint(target_dir)
    # down_proj K = 64: 4 ranks would cut a 32-group in half
    with pytest.raises(CheckpointError, match=r"experts\.0\.down_proj\.weight_packed.*units of 4"):
        ck.get_int4("model.layers.1.mlp.experts.0.down_proj", 0, 4)
    with pytest.raises(CheckpointError, match="cannot be split evenly"):
        ck.get_shard("model.layers.0.self_attn.q_b_proj.weight", 0, 5)
    with pytest.raises(CheckpointError, match=r"q_b_proj\.weight.*invalid tensor-parallel rank 2 of size 2"):
        ck.get_shard("model.layers.0.self_attn.q_b_proj.weight", 2, 2)
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight.*invalid tensor-parallel rank -1"):
        ck.get_shard("model.norm.weight", -1, 2)


def test_progress_reports_bytes(micro):
    target_dir, _ = micro
    calls = []
    w = load_reference_weights(target_dir, np.float32, progress=lambda b, s: calls.append((b, s)))
    assert calls and calls[-1][0] > 0 and calls[-1][1] >= 0
    total = sum(i.nbytes for i in (Checkpoint(target_dir).info(n) for n in Checkpoint(target_dir).names()))
    assert calls[-1][0] == total          # every tensor read exactly once, nothing else
    assert w


def test_progress_true_prints_gbps(micro, capsys):
    load_drafter_weights(micro[1], progress=True)
    err = capsys.readouterr().err
    assert "GB/s" in err and "GB in" in err


# ---- names and prefixes ----------------------------------------------------------------------------

def test_prefix_mapping_wrapper_and_plain(tmp_path):
    w = write_tiny_target(str(tmp_path / "wrap"), 1, MICRO)
    p = write_tiny_target(str(tmp_path / "plain"), 1, MICRO, plain=True)
    cw, cp = Checkpoint(w), Checkpoint(p)
    assert cw.prefix == "language_model." and cp.prefix == ""
    assert sorted(cw.names()) == sorted(cp.names()) == sorted(expected_target_tensors(TargetConfig.load(p)))
    name = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert cw.info(name).stored_name == "language_model." + name and cp.info(name).stored_name == name
    np.testing.assert_array_equal(cw.get(name, "F32"), cp.get(name, "F32"))
    np.testing.assert_array_equal(cw.get("language_model." + name), cw.get(name))   # prefixed name also works
    # explicit prefixes: the config's weight_prefix
    assert TargetConfig.load(w).weight_prefix == "language_model." and TargetConfig.load(p).weight_prefix == ""
    assert Checkpoint(w, prefix=TargetConfig.load(w).weight_prefix).names() == cw.names()
    # the wrong prefix: every tensor is "missing", with a hint
    with pytest.raises(CheckpointError, match="is the weight prefix"):
        Checkpoint(w, prefix="").get("model.norm.weight")
    with pytest.raises(CheckpointError, match="without the prefix"):
        Checkpoint(p, prefix="language_model.").get("model.norm.weight")


def test_vision_tensors_skipped(micro):
    ck = Checkpoint(micro[0])
    assert sorted(ck.skipped) and all(n.startswith(("vision_tower.", "mm_projector.")) for n in ck.skipped)
    assert {n.split(".")[0] for n in ck.skipped} == {"vision_tower", "mm_projector"}
    assert not any("vision" in n or "mm_projector" in n for n in ck.names())
    with pytest.raises(CheckpointError, match="vision_tower.patch_embed.proj.weight"):
        ck.get("vision_tower.patch_embed.proj.weight")


def test_tp_split_plan():
    cases = {
        "model.embed_tokens.weight": 0, "lm_head.weight": 0, "model.norm.weight": None,
        "model.layers.0.input_layernorm.weight": None, "model.layers.9.post_attention_layernorm.weight": None,
        "model.layers.0.self_attn.q_a_proj.weight": None, "model.layers.0.self_attn.q_a_layernorm.weight": None,
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": None,
        "model.layers.0.self_attn.kv_a_layernorm.weight": None,
        "model.layers.0.self_attn.q_b_proj.weight": 0, "model.layers.0.self_attn.kv_b_proj.weight": 0,
        "model.layers.0.self_attn.o_proj.weight": 1,
        "model.layers.0.mlp.gate_proj.weight": 0, "model.layers.0.mlp.up_proj.weight": 0,
        "model.layers.0.mlp.down_proj.weight": 1,
        "model.layers.5.mlp.gate.weight": None, "model.layers.5.mlp.gate.e_score_correction_bias": None,
        "model.layers.5.mlp.shared_experts.gate_proj.weight": 0,
        "model.layers.5.mlp.shared_experts.down_proj.weight": 1,
        "model.layers.5.mlp.experts.383.up_proj.weight_packed": 0,
        "model.layers.5.mlp.experts.383.up_proj.weight_scale": 0,
        "model.layers.5.mlp.experts.0.down_proj.weight_packed": 1,
        "model.layers.5.mlp.experts.0.down_proj.weight_scale": 1,
        "model.layers.5.mlp.experts.0.down_proj.weight_shape": None,
        "model.layers.5.mlp.experts.0.gate_proj.weight": 0,
        "language_model.model.layers.5.mlp.experts.0.down_proj.weight": 1,
        "layers.0.self_attn.q_proj.weight": 0, "layers.0.self_attn.k_proj.weight": 0,
        "layers.0.self_attn.v_proj.weight": 0, "layers.0.self_attn.o_proj.weight": 1,
        "layers.0.self_attn.q_norm.weight": None, "layers.0.self_attn.k_norm.weight": None,
        "layers.1.mlp.gate_proj.weight": 0, "layers.1.mlp.down_proj.weight": 1,
        "fc.weight": None, "hidden_norm.weight": None, "norm.weight": None,
    }
    for name, dim in cases.items():
        assert tp_split(name) == dim, name
    for bad in ("model.layers.0.self_attn.rotary_emb.inv_freq", "vision_tower.x.weight", "model.layers.0.mlp.gate",
                "model.layers.x.mlp.gate_proj.weight"):
        with pytest.raises(CheckpointError, match="no tensor-parallel rule"):
            tp_split(bad)
    # every tensor of the real-size configs has a rule
    here = os.path.dirname(__file__)
    tcfg = TargetConfig.load(os.path.join(here, "data", "kimi-k2.6-text.json"))
    dcfg = DrafterConfig.load(os.path.join(here, "data", "kimi-k2.5-dflash-drafter.json"))
    for name in list(expected_target_tensors(tcfg)) + list(expected_drafter_tensors(dcfg)):
        tp_split(name)


def test_expected_tensors_real_shapes():
    here = os.path.dirname(__file__)
    tcfg = TargetConfig.load(os.path.join(here, "data", "kimi-k2.6-text.json"))
    e = expected_target_tensors(tcfg)
    assert e["model.layers.0.self_attn.kv_b_proj.weight"] == ((16384, 512), ("BF16",))
    assert e["model.layers.0.self_attn.q_b_proj.weight"] == ((12288, 1536), ("BF16",))
    assert e["model.layers.0.self_attn.o_proj.weight"] == ((7168, 8192), ("BF16",))
    assert e["model.layers.60.mlp.experts.383.gate_proj.weight_packed"] == ((2048, 896), ("I32",))
    assert e["model.layers.60.mlp.experts.383.down_proj.weight_scale"] == ((7168, 64), ("BF16",))
    assert e["model.layers.1.mlp.gate.e_score_correction_bias"] == ((384,), ("F32",))
    assert "model.layers.0.mlp.gate.weight" not in e and "model.layers.0.mlp.down_proj.weight" in e
    n_int4 = sum(n.endswith(".weight_packed") for n in e)
    assert n_int4 == 60 * 384 * 3


# ---- safetensors files -----------------------------------------------------------------------------

def test_safetensors_files_readable_by_the_safetensors_package(micro):
    from safetensors import safe_open
    target_dir, _ = micro
    ck = Checkpoint(target_dir)
    fname = ck.info("model.layers.1.mlp.gate.e_score_correction_bias").file
    with safe_open(fname, framework="numpy") as f:
        infos, meta = read_safetensors_header(fname)
        assert set(f.keys()) == set(infos) and f.metadata() == meta == {"format": "pt"}
        for name, info in infos.items():
            if info.dtype != "BF16":        # the numpy framework has no bf16
                np.testing.assert_array_equal(f.get_tensor(name), ck.get(name))


@pytest.mark.oracle
def test_bf16_tensors_match_safetensors_torch(micro):
    import torch
    from safetensors.torch import load_file
    ck = Checkpoint(micro[0])
    for fname in sorted({ck.info(n).file for n in ck.names()}):
        theirs = load_file(fname)
        for name, t in theirs.items():
            if name.startswith(("vision_tower.", "mm_projector.")):
                continue
            ours = ck.get(name)
            if t.dtype == torch.bfloat16:
                np.testing.assert_array_equal(t.view(torch.int16).numpy().view(np.uint16), ours)
            else:
                np.testing.assert_array_equal(t.numpy(), ours)


def test_save_safetensors_rejects_bad_dtype(tmp_path):
    with pytest.raises(ValueError, match="'x'"):
        save_safetensors(str(tmp_path / "a.safetensors"), {"x": ("BF16", np.zeros(3, np.float32))})
    with pytest.raises(ValueError, match="'y'"):
        save_safetensors(str(tmp_path / "a.safetensors"), {"y": np.zeros(3, np.complex64)})


# ---- malformed checkpoints -------------------------------------------------------------------------

def _shard_of(target_dir, name):
    return Checkpoint(target_dir).info(name).file


def _rewrite_shard(path, change):
    """Re-save one shard with ``change(dict)`` applied to its {stored name: (dtype, array)}."""
    infos, meta = read_safetensors_header(path)
    raw = np.memmap(path, np.uint8, "r")
    t = {n: (i.dtype, np.ndarray(i.shape, ST_DTYPES[i.dtype], raw, i.offset).copy()) for n, i in infos.items()}
    del raw
    change(t)
    save_safetensors(path, t, meta)


def _load(target_dir):
    return load_reference_weights(target_dir, np.float32)


P = "language_model."


def test_missing_directory_and_files(tmp_path, micro):
    with pytest.raises(CheckpointError, match="nowhere"):
        Checkpoint(str(tmp_path / "nowhere"))
    os.makedirs(tmp_path / "empty")
    with pytest.raises(CheckpointError, match="model.safetensors"):
        Checkpoint(str(tmp_path / "empty"))
    target_dir, _ = micro
    shard = _shard_of(target_dir, "model.norm.weight")
    os.remove(shard)
    with pytest.raises(CheckpointError, match=os.path.basename(shard)):
        _load(target_dir)


def test_missing_tensor(micro):
    target_dir, _ = micro
    name = "model.layers.1.mlp.experts.2.up_proj.weight_scale"
    ip = os.path.join(target_dir, INDEX_FILE)
    idx = json.load(open(ip))
    del idx["weight_map"][P + name]
    json.dump(idx, open(ip, "w"))
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        _load(target_dir)


def test_index_points_at_wrong_file(micro):
    target_dir, _ = micro
    name = P + "model.layers.0.self_attn.o_proj.weight"
    ip = os.path.join(target_dir, INDEX_FILE)
    idx = json.load(open(ip))
    right = idx["weight_map"][name]
    wrong = next(f for f in sorted(set(idx["weight_map"].values())) if f != right)
    idx["weight_map"][name] = wrong
    json.dump(idx, open(ip, "w"))
    with pytest.raises(CheckpointError, match=rf"{name}.*{wrong}.*does not contain"):
        Checkpoint(target_dir)


def test_bad_index(micro):
    target_dir, _ = micro
    ip = os.path.join(target_dir, INDEX_FILE)
    open(ip, "w").write("{not json")
    with pytest.raises(CheckpointError, match="malformed index JSON"):
        Checkpoint(target_dir)
    json.dump({"metadata": {}}, open(ip, "w"))
    with pytest.raises(CheckpointError, match="weight_map"):
        Checkpoint(target_dir)
    json.dump({"weight_map": {"a": "../x.safetensors"}}, open(ip, "w"))
    with pytest.raises(CheckpointError, match="invalid file name"):
        Checkpoint(target_dir)


def test_wrong_shape_vs_config(micro):
    target_dir, _ = micro
    cp = os.path.join(target_dir, "config.json")
    c = json.load(open(cp))
    c["text_config"]["intermediate_size"] = 96            # the dense layer-0 MLP is 64 wide in the files
    json.dump(c, open(cp, "w"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight.*shape \[64, 64\], "
                                              r"expected \[96, 64\]") as ei:
        _load(target_dir)
    assert ".safetensors" in str(ei.value)


def test_wrong_dtype(micro):
    target_dir, _ = micro
    name = P + "model.layers.1.mlp.gate.e_score_correction_bias"
    shard = _shard_of(target_dir, name)

    def to_bf16(t):
        t[name] = ("BF16", np.zeros(t[name][1].shape, np.uint16))
    _rewrite_shard(shard, to_bf16)
    with pytest.raises(CheckpointError, match=rf"{name}.*{os.path.basename(shard)}.*dtype BF16, expected F32"):
        _load(target_dir)
    with pytest.raises(CheckpointError, match="dtype BF16, expected F32"):
        Checkpoint(target_dir).get(name, "F32")


def test_weight_shape_int64_accepted_and_checked(micro):
    target_dir, _ = micro
    base = P + "model.layers.1.mlp.experts.3.down_proj"
    shard = _shard_of(target_dir, base + ".weight_shape")
    before = _load(target_dir)

    def to_i64(t):
        t[base + ".weight_shape"] = ("I64", t[base + ".weight_shape"][1].astype(np.int64))
    _rewrite_shard(shard, to_i64)
    assert Checkpoint(target_dir).info(base + ".weight_shape").dtype == "I64"
    after = _load(target_dir)
    np.testing.assert_array_equal(after["model.layers.1.mlp.experts.3.down_proj.weight"],
                                  before["model.layers.1.mlp.experts.3.down_proj.weight"])

    def wrong_values(t):
        t[base + ".weight_shape"] = ("I64", np.array([64, 128], np.int64))
    _rewrite_shard(shard, wrong_values)
    with pytest.raises(CheckpointError, match=r"experts\.3\.down_proj\.weight_packed.*does not match weight_shape"):
        Checkpoint(target_dir).get_int4(base)
    with pytest.raises(CheckpointError, match=r"experts\.3\.down_proj"):
        _load(target_dir)

    def as_float(t):
        t[base + ".weight_shape"] = ("F32", np.array([64, 64], np.float32))
    _rewrite_shard(shard, as_float)
    with pytest.raises(CheckpointError, match=r"weight_shape.*dtype F32, expected I32 or I64"):
        Checkpoint(target_dir).get_int4(base)


def test_truncated_shard(micro):
    target_dir, _ = micro
    shard = _shard_of(target_dir, "lm_head.weight")
    size = os.path.getsize(shard)
    with open(shard, "r+b") as f:
        f.truncate(size - 100)
    # the error names the first tensor whose data the cut removed (here a skipped vision tensor at the end)
    with pytest.raises(CheckpointError, match=rf"tensor '[\w.]+' in .*{os.path.basename(shard)}.*past the end"):
        Checkpoint(target_dir)


def test_corrupt_headers(micro):
    target_dir, _ = micro
    shard = _shard_of(target_dir, "model.layers.0.self_attn.q_b_proj.weight")
    base = os.path.basename(shard)
    orig = open(shard, "rb").read()
    # header length beyond the file
    open(shard, "wb").write((len(orig) * 2).to_bytes(8, "little") + orig[8:])
    with pytest.raises(CheckpointError, match=rf"{base}.*header length .* exceeds the file size"):
        Checkpoint(target_dir)
    # bad JSON in the header
    n = int.from_bytes(orig[:8], "little")
    open(shard, "wb").write(orig[:8] + b"{" * n + orig[8 + n:])
    with pytest.raises(CheckpointError, match=rf"{base}.*malformed safetensors header JSON"):
        Checkpoint(target_dir)
    # data_offsets inconsistent with dtype/shape
    hdr = json.loads(orig[8:8 + n])
    name = next(k for k in hdr if k != "__metadata__")
    hdr[name]["shape"] = [hdr[name]["shape"][0] + 1] + hdr[name]["shape"][1:]
    hb = json.dumps(hdr).encode()
    hb += b" " * (-len(hb) % 8)
    open(shard, "wb").write(len(hb).to_bytes(8, "little") + hb + orig[8 + n:])
    with pytest.raises(CheckpointError, match=rf"{name}.*{base}.*data_offsets"):
        Checkpoint(target_dir)
    # a file too short to hold the length
    open(shard, "wb").write(b"\x01\x02")
    with pytest.raises(CheckpointError, match=rf"{base}.*too short"):
        Checkpoint(target_dir)


def test_single_file_checkpoint_and_drafter_errors(micro):
    _, drafter_dir = micro
    assert not os.path.exists(os.path.join(drafter_dir, INDEX_FILE))
    ck = Checkpoint(drafter_dir)
    assert ck.prefix == "" and ck.index_path is None
    assert sorted(ck.names()) == sorted(expected_drafter_tensors(DrafterConfig.load(drafter_dir)))
    cp = os.path.join(drafter_dir, "config.json")
    c = json.load(open(cp))
    c["dflash_config"]["target_layer_ids"] = [0]             # fc would be [64, 64]: files hold [64, 128]
    json.dump(c, open(cp, "w"))
    with pytest.raises(CheckpointError, match=r"'fc\.weight'.*model\.safetensors.*shape \[64, 128\], expected \[64, 64\]"):
        load_drafter_weights(drafter_dir)
