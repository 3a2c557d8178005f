"""``python -m ddtree_cupy.run``: the JSON contract, text/chat prompts, human output, and every bad-input error
(exit code 2, a message naming the problem, no traceback)."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from _specs import SMALL

from ddtree_cupy.run import main
from ddtree_cupy.tinymodel import ensure_tiny_checkpoints
from ddtree_cupy.tokenizer import load_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return ensure_tiny_checkpoints(str(tmp_path_factory.mktemp("cli_ckpt")), seed=5, spec=SMALL)


def call(capsys, *args):
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return rc, out, err


def last_json(out):
    lines = out.strip().splitlines()
    return json.loads(lines[-1])


def test_json_contract(dirs, capsys):
    t, d = dirs
    base = ["--model", t, "--drafter", d, "--prompt-ids", "1,2,3,4", "--prompt-ids", "9,8,7,6,5,4,3,2,1",
            "--max-new-tokens", 24, "--backend", "numpy", "--dtype", "float64", "--json", "--ignore-eos"]
    rc, out, _ = call(capsys, *base, "--mode", "ddtree", "--budget", 16)
    assert rc == 0
    js = last_json(out)
    assert set(js) == {"streams", "stats"}
    assert [s["prompt_ids"] for s in js["streams"]] == [[1, 2, 3, 4], [9, 8, 7, 6, 5, 4, 3, 2, 1]]
    assert all(len(s["output_ids"]) == 24 and s["finish_reason"] == "length" for s in js["streams"])
    st = js["stats"]
    for k in ("steps", "mean_accept_len", "tokens_per_s", "accept_lens", "phase_ms"):
        assert k in st
    assert set(st["phase_ms"]) == {"prefill", "draft", "tree", "verify", "accept"}
    assert st["mean_accept_len"] == pytest.approx(np.mean(st["accept_lens"])) and st["tokens_per_s"] > 0
    # the text is the tokenizer's decoding of the output ids
    tok = load_tokenizer(t)
    assert [s["text"] for s in js["streams"]] == [tok.decode(s["output_ids"]) for s in js["streams"]]
    # greedy: every mode emits the same tokens
    for mode in ("ar", "chain"):
        rc, out, _ = call(capsys, *base, "--mode", mode)
        assert rc == 0
        assert [s["output_ids"] for s in last_json(out)["streams"]] == [s["output_ids"] for s in js["streams"]]
        assert last_json(out)["stats"]["mean_accept_len"] >= 1.0
    # drafter options are accepted and (greedy) still lossless
    rc, out, _ = call(capsys, *base, "--budget", 8, "--cap-k", 2, "--include-chain", "--draft-window", 4,
                      "--rope-amplitude", 1.4159)
    assert rc == 0 and [s["output_ids"] for s in last_json(out)["streams"]] == [s["output_ids"] for s in js["streams"]]


def test_text_and_chat_prompts(dirs, capsys):
    t, d = dirs
    tok = load_tokenizer(t)
    common = ["--model", t, "--drafter", d, "--max-new-tokens", 6, "--backend", "numpy", "--json"]
    rc, out, _ = call(capsys, *common, "--prompt", "The river town")
    assert rc == 0 and last_json(out)["streams"][0]["prompt_ids"] == tok.encode("The river town")
    rc, out, _ = call(capsys, *common, "--chat", "hello", "--system", "Be brief.", "--no-thinking")
    assert rc == 0
    assert last_json(out)["streams"][0]["prompt_ids"] == tok.encode_chat(
        [("system", "Be brief."), ("user", "hello")], thinking=False)
    # sampling with a fixed seed is reproducible through the CLI
    samp = common + ["--prompt", "The river town", "--temperature", 0.9, "--top-k", 40, "--top-p", 0.95, "--seed", 3]
    rc1, o1, _ = call(capsys, *samp)
    rc2, o2, _ = call(capsys, *samp)
    assert rc1 == rc2 == 0 and last_json(o1)["streams"] == last_json(o2)["streams"]


def test_stops_on_eos(dirs, capsys):
    t, d = dirs
    tok = load_tokenizer(t)
    common = ["--model", t, "--drafter", d, "--prompt-ids", "5,6,7", "--max-new-tokens", 30, "--backend", "numpy",
              "--json", "--mode", "ar"]
    rc, out, _ = call(capsys, *common, "--ignore-eos")
    ids = last_json(out)["streams"][0]["output_ids"]
    assert rc == 0 and len(ids) == 30
    # the model does not emit a stop id by itself here; check the stop list it would use instead
    assert set(tok.stop_ids) == {tok.token_id("<|im_end|>"), tok.token_id("[EOS]")}
    rc, out, _ = call(capsys, *common)
    s = last_json(out)["streams"][0]
    hit = [i for i, x in enumerate(ids) if x in tok.stop_ids]
    assert s["output_ids"] == (ids[:hit[0] + 1] if hit else ids)


def test_human_output(dirs, capsys):
    t, d = dirs
    rc, out, err = call(capsys, "--model", t, "--drafter", d, "--prompt", "The river", "--max-new-tokens", 5,
                        "--backend", "numpy")
    assert rc == 0
    summary = out.strip().splitlines()[-1]
    assert "tok/s" in summary and "mean acceptance length" in summary and "steps" in summary
    assert "loaded in" in err
    rc, out, _ = call(capsys, "--model", t, "--drafter", d, "--prompt-ids", "1,2", "--prompt-ids", "3,4,5",
                      "--max-new-tokens", 5, "--backend", "numpy")
    assert rc == 0 and "--- stream 0" in out and "--- stream 1" in out


def _copy(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def _edit_config(path, **changes):
    p = os.path.join(path, "config.json")
    with open(p) as f:
        cfg = json.load(f)
    for k, v in changes.items():
        node = cfg
        keys = k.split("__")
        for kk in keys[:-1]:
            node = node[kk]
        node[keys[-1]] = v
    with open(p, "w") as f:
        json.dump(cfg, f)


def test_bad_input_errors(dirs, capsys, tmp_path):
    t, d = dirs
    ok = ["--model", t, "--drafter", d, "--backend", "numpy"]
    broken_json = _copy(t, tmp_path / "broken_json")
    with open(os.path.join(broken_json, "config.json"), "w") as f:
        f.write("{not json")
    no_weights = _copy(t, tmp_path / "no_weights")
    for f in os.listdir(no_weights):
        if f.endswith(".safetensors"):
            os.remove(os.path.join(no_weights, f))
    wide = _copy(d, tmp_path / "wide_drafter")
    _edit_config(wide, hidden_size=128)
    deep = _copy(d, tmp_path / "deep_drafter")
    _edit_config(deep, dflash_config__target_layer_ids=[0, 1, 7])
    big_block = _copy(d, tmp_path / "big_block")
    _edit_config(big_block, block_size=16)
    cases = [
        (["--model", t, "--drafter", big_block, "--prompt-ids", "1"], "block_size 16 is not supported"),
        (["--model", tmp_path / "nope", "--drafter", d, "--prompt-ids", "1"], "directory does not exist"),
        (["--model", broken_json, "--drafter", d, "--prompt-ids", "1"], "malformed JSON"),
        (["--model", no_weights, "--drafter", d, "--prompt-ids", "1"], "safetensors"),
        (["--model", t, "--drafter", wide, "--prompt-ids", "1"], "hidden_size 128 != target hidden_size 64"),
        (["--model", t, "--drafter", deep, "--prompt-ids", "1"], r"target_layer_ids \[7\] out of range"),
        (["--model", t, "--prompt-ids", "1"], "--drafter DIR is required for --mode ddtree"),
        (ok + ["--prompt-ids", ",".join(["1"] * 128)], "context limit is 128"),
        (ok + ["--prompt", ""], "prompt is empty"),
        (ok + ["--prompt-ids", ""], "prompt is empty"),
        (ok + ["--prompt-ids", "1,x"], "comma-separated integers"),
        (ok + ["--prompt-ids", "1,512"], r"outside the vocabulary \[0, 512\)"),
        (ok + ["--prompt-ids", "1", "--budget", 0], r"--budget must be in \[1, 128\]"),
        (ok + ["--prompt-ids", "1", "--budget", 129], r"--budget must be in \[1, 128\]"),
        (ok + ["--prompt-ids", "1", "--max-new-tokens", 0], "--max-new-tokens"),
        (ok + ["--prompt-ids", "1", "--top-p", 1.5], "--top-p"),
        (ok + ["--prompt-ids", "1", "--draft-window", 0], "--draft-window"),
        (ok + ["--prompt-ids", "1", "--rope-amplitude", 0], "--rope-amplitude"),
        (ok, "no prompt"),
    ]
    if not _gpu_usable():      # without a GPU, --backend cupy is refused with the reason
        cases.append((ok[:-2] + ["--backend", "cupy", "--prompt-ids", "1"], "--backend cupy: (no CUDA GPU found|"
                      "no usable CUDA GPU|cupy not importable|the NVIDIA driver is older)"))
    for args, msg in cases:
        rc, out, err = call(capsys, *args)
        assert rc == 2, (args, err)
        assert err.strip().splitlines()[-1].startswith("error: "), err
        assert re.search(msg, err), (msg, err)
    # argparse-level errors: unknown mode, unknown dtype
    for args, msg in ((ok + ["--prompt-ids", "1", "--mode", "beam"], "invalid choice: 'beam'"),
                      (ok + ["--prompt-ids", "1", "--dtype", "float16"], "invalid choice: 'float16'")):
        rc, out, err = call(capsys, *args)
        assert rc == 2 and msg in err


def _gpu_usable():
    from ddtree_cupy import backend
    return backend.gpu_status()[0]


def test_auto_backend_falls_back_with_notice(dirs, capsys):
    from ddtree_cupy import backend
    assert backend.gpu_engine_available()
    if _gpu_usable():          # a GPU machine: auto picks the GPU engine, silently
        notes = []
        assert backend.select_backend("auto", notes.append) == "cupy" and notes == []
        return
    notes = []
    assert backend.select_backend("auto", notes.append) == "numpy"
    assert len(notes) == 1 and "numpy" in notes[0] and "\n" not in notes[0]
    assert backend.select_backend("numpy", notes.append) == "numpy" and len(notes) == 1
    with pytest.raises(backend.BackendError, match="--backend cupy: "):
        backend.select_backend("cupy", notes.append)


def test_subprocess_demo_json(tmp_path):
    """The real entry point, once: --demo builds the default tiny checkpoints into $DDTREE_CUPY_CACHE."""
    env = dict(os.environ, DDTREE_CUPY_CACHE=str(tmp_path / "cache"), PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, "-m", "ddtree_cupy.run", "--demo", "--max-new-tokens", "3", "--json",
                        "--budget", "4", "--ignore-eos"], capture_output=True, text=True, env=env, cwd=str(tmp_path),
                       timeout=300)
    assert p.returncode == 0, p.stderr
    js = json.loads(p.stdout.strip().splitlines()[-1])
    assert len(js["streams"]) == 1 and len(js["streams"][0]["output_ids"]) == 3
    assert js["streams"][0]["prompt_ids"] and js["stats"]["steps"] >= 1
    assert os.path.isdir(tmp_path / "cache" / "tiny")
    assert ("backend auto -> numpy" in p.stderr) != _gpu_usable()


def test_newcomer_messages(dirs, capsys, tmp_path):
    """Empty chat refused like an empty prompt, sampling filters without sampling refused, a file given as a
    directory named as such, stream numbers from 0 in every message (the order: --prompt, --prompt-ids, --chat)."""
    t, d = dirs
    ok = ["--model", t, "--drafter", d, "--backend", "numpy"]
    a_file = tmp_path / "config.json"
    a_file.write_text("{}")
    cases = [
        (ok + ["--chat", ""], r"stream 0 \(--chat\): message is empty"),
        (ok + ["--prompt", "hi", "--chat", ""], r"stream 1 \(--chat\): message is empty"),
        (ok + ["--prompt-ids", "1", "--prompt-ids", ""], r"stream 1 \(--prompt-ids\): prompt is empty"),
        (ok + ["--prompt", "x", "--prompt-ids", "1,y"], r"stream 1 \(--prompt-ids\): expected comma-separated"),
        (ok + ["--prompt-ids", "1", "--top-p", 0.9], r"--top-p / --top-k filter sampling, but --temperature is 0"),
        (ok + ["--prompt-ids", "1", "--top-k", 5], r"--top-p / --top-k filter sampling, but --temperature is 0"),
        (["--model", a_file, "--drafter", d, "--prompt-ids", "1"], r"config\.json: is a file, not a directory"),
        (["--model", t, "--drafter", a_file, "--prompt-ids", "1"], r"config\.json: is a file, not a directory"),
        (ok + ["--prompt-ids", "1", "--prompt-ids", ",".join(["1"] * 128)], r"stream 1: .*context limit is 128"),
    ]
    for args, msg in cases:
        rc, out, err = call(capsys, *args)
        assert rc == 2, (args, err)
        assert re.search(msg, err), (msg, err)
    # with a temperature the same filters are accepted
    rc, out, err = call(capsys, *ok, "--prompt-ids", "1,2", "--temperature", 0.8, "--top-k", 5, "--top-p", 0.9,
                        "--max-new-tokens", 2, "--mode", "ar", "--ignore-eos")
    assert rc == 0, err


def test_one_step_is_singular(dirs, capsys):
    t, d = dirs
    rc, out, err = call(capsys, "--model", t, "--prompt-ids", "1,2,3", "--mode", "ar", "--max-new-tokens", 1,
                        "--backend", "numpy", "--ignore-eos")
    assert rc == 0, err
    summary = out.strip().splitlines()[-1]
    m = re.search(r"(\d+) steps?\b", summary)
    assert m, summary
    assert (m.group(0) == "1 step") == (m.group(1) == "1"), summary


def test_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        from ddtree_cupy.run import build_parser
        build_parser().parse_args(["--help"])
    out = capsys.readouterr().out
    out = out[out.index("options:"):]                   # the option list, not the usage line
    for opt, default in (("--max-new-tokens", "64"), ("--budget", "auto"), ("--temperature", "0.0"),
                         ("--top-p", "1.0"), ("--backend", "auto"), ("--dtype", "float32"), ("--mode", "ddtree")):
        seg = out[out.index("  " + opt + " "):]
        seg = seg[:seg.find("\n  --", 2) if seg.find("\n  --", 2) > 0 else len(seg)]
        assert f"(default: {default})" in " ".join(seg.split()), (opt, seg)


@pytest.mark.parametrize("module,want", [
    ("ddtree_cupy.serve.main", {"--port": "8000", "--host": "127.0.0.1", "--backend": "auto", "--mode": "ddtree",
                                "--max-streams": "8", "--budget": "auto"}),
    ("ddtree_cupy.build", {"--arch": "['sm_120', 'sm_90']"}),
    ("ddtree_cupy.tinymodel", {"--seed": "0"})])
def test_every_command_help_shows_defaults_once(capsys, module, want):
    """The other command lines' --help as the CLI's: each default once, none for flags or unset options."""
    import importlib
    mod = importlib.import_module(module)
    with pytest.raises(SystemExit):
        if hasattr(mod, "build_parser"):
            mod.build_parser().parse_args(["--help"])
        else:
            mod.main(["--help"])
    out = capsys.readouterr().out
    text = " ".join(out[out.index("options:"):].split())
    assert "(default: None)" not in text and "(default: False)" not in text, text
    for seg in re.split(r" (?=--[a-z])", text):             # a help that names its default gets no second one
        assert seg.count("(default:") <= 1, seg
    segs = re.split(r" (?=--[a-z])", text)
    for opt, default in want.items():
        assert any(seg.startswith(opt + " ") and f"(default: {default})" in seg for seg in segs), opt


def test_counts_are_singular_when_one(dirs, capsys):
    """A one-token run says '1 token' and '0 steps'; the weights line says '1 rank'."""
    t, d = dirs
    rc, out, err = call(capsys, "--model", t, "--drafter", d, "--backend", "numpy", "--prompt-ids", "1,2,3",
                        "--max-new-tokens", 1)
    assert rc == 0
    summary = [line for line in out.splitlines() + err.splitlines() if line.startswith("--- ")][-1]
    assert summary.startswith("--- 1 token in ") and ", 0 steps," in summary, summary
    assert "read by 1 rank in" in err, err
