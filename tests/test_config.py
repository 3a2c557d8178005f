"""config.py: every config.json shape the real checkpoints use, and the validation errors."""
import copy
import json
import math
from pathlib import Path

import pytest

from ddtree_cupy.config import ConfigError, DrafterConfig, RopeConfig, TargetConfig, yarn_mscale

# Copies of the reconstructed real configs (../shared/configs), kept in the repo so the tests run anywhere.
DATA = Path(__file__).parent / "data"
K26 = json.loads((DATA / "kimi-k2.6-text.json").read_text())
DRAFT = json.loads((DATA / "kimi-k2.5-dflash-drafter.json").read_text())


def plain():
    return copy.deepcopy(K26)


def wrapped(quant_where="top"):
    text = plain()
    q = text.pop("quantization_config")
    out = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "text_config": text}
    if quant_where in ("top", "both"):
        out["quantization_config"] = copy.deepcopy(q)
    if quant_where in ("text", "both"):
        text["quantization_config"] = copy.deepcopy(q)
    return out


def test_kimi_k26_plain_config_values():
    c = TargetConfig.from_dict(plain(), "k26")
    assert c.weight_prefix == ""
    assert (c.num_hidden_layers, c.hidden_size, c.n_routed_experts, c.num_experts_per_tok) == (61, 7168, 384, 8)
    assert c.moe_layers == tuple(range(1, 61))
    assert c.kv_cache_dim == 576 and c.qk_head_dim == 192
    assert math.isclose(c.softmax_scale, 0.14467963, rel_tol=1e-7)
    assert c.rope.kind == "yarn" and c.rope.factor == 64 and c.rope.amplitude == 1.0
    assert c.quant is not None and c.quant.group_size == 32
    assert c.is_quantized("model.layers.3.mlp.experts.7.down_proj") and not c.is_quantized("model.layers.3.self_attn.o_proj")
    c.validate_tp(8)


@pytest.mark.parametrize("where", ["top", "text", "both"])
def test_kimi_k25_wrapper_with_quantization_anywhere(where):
    c = TargetConfig.from_dict(wrapped(where), "wrapped")
    assert c.weight_prefix == "language_model."
    assert c.quant is not None and c.quant.num_bits == 4
    assert c.hidden_size == 7168


def test_rope_legacy_type_rope_type_and_rope_parameters_agree():
    a = plain()
    b = plain(); b["rope_scaling"] = dict(b["rope_scaling"]); b["rope_scaling"]["rope_type"] = b["rope_scaling"].pop("type")
    c = plain(); c["rope_parameters"] = dict(c.pop("rope_scaling"), rope_theta=c.pop("rope_theta"))
    ra, rb, rc = (TargetConfig.from_dict(x).rope for x in (a, b, c))
    assert ra == rb == rc


def test_round_trip_through_to_dict():
    c = TargetConfig.from_dict(plain(), "x")
    for wrapper in (True, False):
        d = TargetConfig.from_dict(c.to_dict(wrapper=wrapper), "x")
        assert d.weight_prefix == ("language_model." if wrapper else "")
        assert d == TargetConfig.from_dict(c.to_dict(wrapper=wrapper), "x")
        for f in ("hidden_size", "rope", "quant", "routed_scaling_factor", "n_group", "rms_norm_eps"):
            assert getattr(d, f) == getattr(c, f), f


@pytest.mark.parametrize("mutate, fragment", [
    (lambda d: d.pop("hidden_size"), "'hidden_size'"),
    (lambda d: d.update(kv_lora_rank=0), "'kv_lora_rank' must be positive"),
    (lambda d: d.update(num_experts_per_tok=500), "num_experts_per_tok (500) exceeds"),
    (lambda d: d.update(scoring_func="softmax"), "scoring_func"),
    (lambda d: d.update(n_group=5), "not divisible by n_group"),
    (lambda d: d.update(topk_group=2), "topk_group (2) exceeds n_group (1)"),
    (lambda d: d["rope_scaling"].update(type="longrope"), "unsupported rope type"),
    (lambda d: d["quantization_config"].update(quant_method="awq"), "unsupported quant_method"),
    (lambda d: d["quantization_config"]["config_groups"]["group_0"]["weights"].update(num_bits=8), "num_bits"),
    (lambda d: d["quantization_config"]["config_groups"]["group_0"]["weights"].update(group_size=128), "group_size"),
    (lambda d: d["quantization_config"]["config_groups"]["group_0"]["weights"].update(symmetric=False), "asymmetric"),
    (lambda d: d.update(hidden_size="big"), "'hidden_size' must be an integer"),
])
def test_validation_errors_name_the_field(mutate, fragment):
    d = plain()
    mutate(d)
    with pytest.raises(ConfigError) as e:
        TargetConfig.from_dict(d, "bad.json")
    assert fragment in str(e.value) and "bad.json" in str(e.value)


def test_tp_divisibility():
    c = TargetConfig.from_dict(plain())
    for tp in (1, 2, 4, 8):
        c.validate_tp(tp)
    with pytest.raises(ConfigError, match="num_attention_heads \\(64\\) is not divisible by the tensor-parallel size 3"):
        c.validate_tp(3)
    d = plain(); d["moe_intermediate_size"] = 1024
    with pytest.raises(ConfigError, match="moe_intermediate_size / tp \\(16\\)"):
        TargetConfig.from_dict(d).validate_tp(64)


def test_drafter_config_and_matching():
    t = TargetConfig.from_dict(plain())
    d = DrafterConfig.from_dict(DRAFT, "drafter.json")
    assert d.target_layer_ids == (1, 12, 24, 35, 47, 58) and d.block_size == 8 and d.mask_token_id == 163838
    assert d.num_key_value_heads == 8 and d.head_dim == 128
    d.check_matches(t)
    d.validate_tp(8)
    assert d.effective_rope_amplitude == 1.0
    amp = 1 + 0.1 * math.log(64)
    assert math.isclose(d.with_options(rope_amplitude=amp).effective_rope_amplitude, 1.4159, rel_tol=1e-4)
    d2 = DrafterConfig.from_dict(d.to_dict(), "rt")
    assert (d2.target_layer_ids, d2.rope, d2.block_size) == (d.target_layer_ids, d.rope, d.block_size)


@pytest.mark.parametrize("mutate, fragment", [
    (lambda d: d.pop("dflash_config"), "dflash_config"),
    (lambda d: d["dflash_config"].update(target_layer_ids=[]), "target_layer_ids"),
    (lambda d: d["dflash_config"].pop("mask_token_id"), "mask_token_id"),
    (lambda d: d.update(block_size=1), "block_size must be >= 2"),
    (lambda d: d.update(num_key_value_heads=7), "not divisible by num_key_value_heads"),
    (lambda d: d["dflash_config"].update(mask_token_id=10**7), "outside the vocabulary"),
])
def test_drafter_validation(mutate, fragment):
    d = copy.deepcopy(DRAFT)
    mutate(d)
    with pytest.raises(ConfigError, match=None) as e:
        DrafterConfig.from_dict(d, "drafter.json")
    assert fragment in str(e.value)


@pytest.mark.parametrize("field, value, fragment", [
    ("hidden_size", 4096, "hidden_size 4096 != target hidden_size 7168"),
    ("vocab_size", 200000, "vocab_size 200000 != target"),
])
def test_drafter_mismatch(field, value, fragment):
    t = TargetConfig.from_dict(plain())
    d = copy.deepcopy(DRAFT)
    d[field] = value
    if field == "hidden_size":
        d["head_dim"] = 128
    with pytest.raises(ConfigError) as e:
        DrafterConfig.from_dict(d, "drafter.json").check_matches(t)
    assert fragment in str(e.value)


def test_drafter_layer_ids_out_of_range():
    t = TargetConfig.from_dict(plain())
    d = copy.deepcopy(DRAFT)
    d["dflash_config"]["target_layer_ids"] = [1, 61]
    with pytest.raises(ConfigError, match=r"target_layer_ids \[61\] out of range"):
        DrafterConfig.from_dict(d).check_matches(t)


def test_load_errors(tmp_path):
    with pytest.raises(ConfigError, match="config.json not found"):
        TargetConfig.load(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="malformed JSON"):
        TargetConfig.load(str(tmp_path))


def test_yarn_constants():
    assert yarn_mscale(1.0, 1.0) == 1.0
    assert math.isclose(yarn_mscale(64.0, 1.0), 1 + 0.1 * math.log(64))
    r = RopeConfig.from_dict({"rope_theta": 1e4}, "x")
    assert r.kind == "default" and r.amplitude == 1.0
    with pytest.raises(ConfigError, match="rope_theta"):
        RopeConfig.from_dict({}, "x")
