"""Kimi tokenizer: file parsing, encode/decode round trips, pre-tokenization, special ids, chat format."""
from __future__ import annotations

import base64
import json
import os

import pytest

from ddtree_cupy.tokenizer import (KIMI_SPECIAL_OFFSETS, KimiTokenizer, TokenizerError, load_tokenizer)

HAN_NI = "你".encode()          # e4 bd a0


def _vocab():
    toks = [bytes([i]) for i in range(256)]
    # merges reachable by BPE: "he", "ll", "hell", "hello", " w", " wo", "ab", then "ab" + "你" (crossing the
    # Han boundary: only an encoder WITHOUT Kimi's Han split could ever produce it)
    toks += [b"he", b"ll", b"hell", b"hello", b" w", b" wo", b"ab", HAN_NI[:2], HAN_NI, b"ab" + HAN_NI]
    return toks


def write_tok_dir(path, toks=None, config=None, lines=None):
    os.makedirs(path, exist_ok=True)
    toks = _vocab() if toks is None else toks
    with open(os.path.join(path, "tiktoken.model"), "w") as f:
        if lines is not None:
            f.write(lines)
        else:
            for r, t in enumerate(toks):
                f.write(f"{base64.b64encode(t).decode()} {r}\n")
    if config is not None:
        with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
            f.write(config if isinstance(config, str) else json.dumps(config))
    return str(path)


@pytest.fixture
def tok(tmp_path):
    n = len(_vocab())
    cfg = {"added_tokens_decoder": {str(n + off): {"content": name, "special": True}
                                    for name, off in KIMI_SPECIAL_OFFSETS.items()}}
    cfg["added_tokens_decoder"][str(n + 5)] = {"content": "<|custom|>", "special": True}
    return load_tokenizer(write_tok_dir(tmp_path / "tok", config=cfg))


TEXTS = ["hello world", "Hello  World!\n\n  tabs\tand spaces ", "你好，世界。abc你好", "naïve café 123456789",
         "it's we'LL they'd", "", "\n", "emoji 🙂 and ZWJ 👩‍👩‍👧", "<|im_end|> is text here"]


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < tok.n_base for i in ids)
    assert tok.decode(ids) == text


def test_merges_and_han_split(tok):
    r = {t: i for i, t in enumerate(_vocab())}
    assert tok.encode("hello") == [r[b"hello"]]
    # Kimi's pattern splits Han characters into their own piece: "ab" | "你", never the cross-boundary token.
    assert tok.encode("ab你") == [r[b"ab"], r[HAN_NI]]
    # A leading space joins the following word (" wo" + "r" + ...); digits go in runs of at most 3.
    assert tok.encode(" wor")[0] == r[b" wo"]
    assert tok.decode(tok.encode("1234567")) == "1234567"
    assert len(tok.encode("1234567")) == 7  # single-byte digits: pieces "123","456","7" carry no merges


def test_special_ids(tok):
    n = len(_vocab())
    assert tok.n_base == n and tok.vocab_size == n + 256
    for name, off in KIMI_SPECIAL_OFFSETS.items():
        assert tok.token_id(name) == n + off
    assert tok.token_id("<|custom|>") == n + 5
    assert tok.id_to_special[n + 6] == f"<|reserved_token_{n + 6}|>"
    assert set(tok.stop_ids) == {n + 1, n + 2}
    # specials are text unless allowed
    assert tok.encode("<|im_end|>", allow_special=True) == [n + 2]
    plain = tok.encode("<|im_end|>")
    assert n + 2 not in plain and tok.decode(plain) == "<|im_end|>"
    assert tok.decode([n + 2]) == "<|im_end|>"
    assert tok.decode([tok.encode("a")[0], n + 2], skip_special=True) == "a"
    with pytest.raises(TokenizerError, match="outside"):
        tok.decode([n + 256])
    with pytest.raises(TokenizerError, match="not in this tokenizer"):
        tok.token_id("<|nope|>")


def test_defaults_without_config(tmp_path):
    t = load_tokenizer(write_tok_dir(tmp_path / "t"))
    n = len(_vocab())
    assert t.token_id("<|im_middle|>") == n + 17 and t.token_id("[PAD]") == n + 255


def test_chat_rendering(tok):
    sys_user = [("system", "Be brief."), ("user", "hi there")]
    assert tok.render_chat(sys_user, thinking=True) == (
        "<|im_system|>system<|im_middle|>Be brief.<|im_end|>"
        "<|im_user|>user<|im_middle|>hi there<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think>")
    assert tok.render_chat([("user", "x")], thinking=False) == (
        "<|im_user|>user<|im_middle|>x<|im_end|><|im_assistant|>assistant<|im_middle|><think></think>")
    assert tok.render_chat([("user", "x")], add_generation_prompt=False) == "<|im_user|>user<|im_middle|>x<|im_end|>"
    for thinking in (True, False):
        ids = tok.encode_chat(sys_user, thinking=thinking)
        assert ids == tok.encode(tok.render_chat(sys_user, thinking=thinking), allow_special=True)
    n = tok.n_base
    ids = tok.encode_chat([("user", "a")], thinking=False)
    assert ids[0] == n + 3 and ids[-1] == n + 23 and ids[-2] == n + 22
    # typed special-token text stays text
    inj = tok.encode_chat([("user", "<|im_end|>")])
    assert inj.count(n + 2) == 1
    with pytest.raises(TokenizerError, match="unknown role"):
        tok.render_chat([("tool", "x")])


def test_file_errors(tmp_path):
    with pytest.raises(TokenizerError, match="does not exist"):
        load_tokenizer(str(tmp_path / "missing"))
    os.makedirs(tmp_path / "empty_dir")
    with pytest.raises(TokenizerError, match="tiktoken.model not found"):
        load_tokenizer(str(tmp_path / "empty_dir"))
    with pytest.raises(TokenizerError, match=r"tiktoken.model:2: expected"):
        load_tokenizer(write_tok_dir(tmp_path / "a", lines="YQ== 0\nYg==\n"))
    with pytest.raises(TokenizerError, match=r":1: malformed"):
        load_tokenizer(write_tok_dir(tmp_path / "b", lines="!!!! 0\n"))
    with pytest.raises(TokenizerError, match="ranks must be exactly"):
        load_tokenizer(write_tok_dir(tmp_path / "c", lines="YQ== 0\nYg== 5\n"))
    with pytest.raises(TokenizerError, match="listed twice"):
        load_tokenizer(write_tok_dir(tmp_path / "c2", lines="YQ== 0\nYQ== 1\n"))
    with pytest.raises(TokenizerError, match="is empty"):
        load_tokenizer(write_tok_dir(tmp_path / "d", lines="\n"))
    with pytest.raises(TokenizerError, match="malformed JSON"):
        load_tokenizer(write_tok_dir(tmp_path / "e", config="{nope"))
    with pytest.raises(TokenizerError, match="outside the special range"):
        load_tokenizer(write_tok_dir(tmp_path / "f", config={"added_tokens_decoder": {"3": {"content": "x"}}}))
    with pytest.raises(TokenizerError, match="no 'content'"):
        load_tokenizer(write_tok_dir(tmp_path / "g", config={"added_tokens_decoder": {"266": {}}}))


def test_tiny_checkpoint_tokenizer(tmp_path):
    """The tokenizer files tinymodel writes (the demo's) load, name Kimi's specials, and round-trip text."""
    from ddtree_cupy.tinymodel import SPECIAL_OFFSETS, TinySpec, write_tokenizer
    spec = TinySpec()
    write_tokenizer(str(tmp_path), spec)
    t = load_tokenizer(str(tmp_path))
    assert t.vocab_size == spec.vocab_size and t.n_base == spec.n_ranks
    assert {off: name for name, off in KIMI_SPECIAL_OFFSETS.items()} == SPECIAL_OFFSETS
    for off, name in SPECIAL_OFFSETS.items():
        assert t.token_id(name) == spec.special_id(name)
    text = "The river town woke slowly, and the baker opened his doors at six o'clock.\n  你好 123456"
    ids = t.encode(text)
    assert t.decode(ids) == text
    assert len(ids) < len(text.encode())          # the BPE merges are used
    chat = t.encode_chat([("user", "hello")], thinking=False)
    assert t.decode(chat) == "<|im_user|>user<|im_middle|>hello<|im_end|><|im_assistant|>assistant<|im_middle|><think></think>"


def test_long_runs_are_cut_like_kimi(tok):
    from ddtree_cupy.tokenizer import split_for_encoding
    assert split_for_encoding("") == []
    assert split_for_encoding("ab  cd", max_run=2) == ["ab  cd"]
    assert split_for_encoding("abc  d", max_run=2) == ["ab", "c  d"]
    assert split_for_encoding("a     b", max_run=2) == ["a  ", "  ", " b"]
    assert split_for_encoding("abcdefg", max_chars=3, max_run=10) == ["abc", "def", "g"]
    text = "he" * 20000 + " " + "x" * 30001          # runs of 40000 and 30001 non-space characters
    pieces = split_for_encoding(text)
    assert "".join(pieces) == text and [len(p) for p in pieces] == [25000, 15001 + 25000, 5001]
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert ids == [i for p in pieces for i in tok.encode(p)]
