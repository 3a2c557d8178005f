"""Kimi's tiktoken tokenizer and chat format, loaded offline from a checkpoint directory.

Files read from the directory:
  * ``tiktoken.model``: one ``base64(token bytes) rank`` pair per line; ranks are the token ids 0..N-1.
  * ``tokenizer_config.json`` (optional): ``added_tokens_decoder`` ``{"id": {"content": name}, ...}`` names
    special ids.

Kimi reserves 256 special ids right after the N byte-pair ranks. Their names follow Kimi's layout
(``[BOS]`` N+0, ``[EOS]`` N+1, ``<|im_end|>`` N+2, ...), ``tokenizer_config.json`` may rename any of them,
and the rest are ``<|reserved_token_{id}|>``.

Pre-tokenization uses Kimi's pattern as published in its ``tokenization_kimi.py``: o200k-like, with Han
characters split into their own pieces (class intersection ``&&[^\\p{Han}]``) and a ``\\s+(?!\\S)``
lookahead; tiktoken's regex engine accepts both as written.
"""
from __future__ import annotations

import base64
import binascii
import json
import os
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

NUM_SPECIAL_TOKENS = 256

# Kimi's pre-tokenization regex (tokenization_kimi.py, TikTokenTokenizer.pat_str), one alternative a line.
KIMI_PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])

# Kimi's named special ids, as offsets from the first special id (= number of BPE ranks).
KIMI_SPECIAL_OFFSETS: Dict[str, int] = {
    "[BOS]": 0, "[EOS]": 1, "<|im_end|>": 2, "<|im_user|>": 3, "<|im_assistant|>": 4,
    "<|im_system|>": 10, "<|im_middle|>": 17, "<think>": 22, "</think>": 23, "[UNK]": 254, "[PAD]": 255,
}

STOP_TOKEN_NAMES = ("<|im_end|>", "[EOS]")

# Kimi's encode cuts the text before pre-tokenization, so that tiktoken's byte-pair merge (quadratic in a
# piece's length) never sees a huge piece: chunks of at most 400k characters, and inside them no run of more
# than 25k consecutive whitespace or consecutive non-whitespace characters. Same limits here, so long
# inputs tokenize as Kimi's reference does at the seams.
MAX_ENCODE_CHARS = 400_000
MAX_RUN_CHARS = 25_000


def split_for_encoding(text: str, max_chars: int = MAX_ENCODE_CHARS, max_run: int = MAX_RUN_CHARS) -> List[str]:
    """Slices of ``text`` (concatenating to it) with at most ``max_chars`` characters each and no run of more
    than ``max_run`` consecutive same-class (whitespace / non-whitespace) characters."""
    out: List[str] = []
    for i in range(0, len(text), max_chars):
        chunk = text[i:i + max_chars]
        start, run, prev = 0, 0, None
        for j, ch in enumerate(chunk):
            cls = ch.isspace()
            run = run + 1 if cls == prev else 1
            prev = cls
            if run > max_run:
                out.append(chunk[start:j])
                start, run = j, 1
        out.append(chunk[start:])
    return [p for p in out if p]


class TokenizerError(ValueError):
    """The tokenizer files are missing or malformed, or an input cannot be tokenized."""


def _read_ranks(path: str) -> Dict[bytes, int]:
    if not os.path.exists(path):
        raise TokenizerError(f"{path}: tiktoken.model not found")
    ranks: Dict[bytes, int] = {}
    try:
        f = open(path, "rb")
    except OSError as e:
        raise TokenizerError(f"{path}: cannot read: {e}") from None
    with f:
        for lineno, raw in enumerate(f, 1):
            line = raw.strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) != 2:
                raise TokenizerError(f"{path}:{lineno}: expected 'base64_token rank', got {raw[:80]!r}")
            try:
                tok = base64.b64decode(parts[0], validate=True)
                rank = int(parts[1])
            except (binascii.Error, ValueError) as e:
                raise TokenizerError(f"{path}:{lineno}: malformed line {raw[:80]!r} ({e})") from None
            if tok in ranks:
                raise TokenizerError(f"{path}:{lineno}: token {tok!r} listed twice")
            ranks[tok] = rank
    if not ranks:
        raise TokenizerError(f"{path}: tiktoken.model is empty")
    # Token ids must be exactly 0..N-1: the special ids start at N and the embedding is indexed by id.
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise TokenizerError(f"{path}: ranks must be exactly 0..{len(ranks) - 1} (each once)")
    return ranks


def _read_special_names(path: str, n_base: int) -> Dict[int, str]:
    names = {n_base + off: name for name, off in KIMI_SPECIAL_OFFSETS.items()}
    if not os.path.exists(path):
        return names
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{path}: malformed JSON: {e}") from None
    except OSError as e:
        raise TokenizerError(f"{path}: cannot read: {e}") from None
    if not isinstance(cfg, dict):
        raise TokenizerError(f"{path}: must hold a JSON object")
    dec = cfg.get("added_tokens_decoder") or {}
    if not isinstance(dec, dict):
        raise TokenizerError(f"{path}: 'added_tokens_decoder' must be an object")
    for key, meta in dec.items():
        try:
            tid = int(key)
        except ValueError:
            raise TokenizerError(f"{path}: added_tokens_decoder key {key!r} is not a token id") from None
        if not n_base <= tid < n_base + NUM_SPECIAL_TOKENS:
            raise TokenizerError(f"{path}: added_tokens_decoder id {tid} outside the special range "
                                 f"[{n_base}, {n_base + NUM_SPECIAL_TOKENS})")
        content = meta.get("content") if isinstance(meta, dict) else None
        if not isinstance(content, str) or not content:
            raise TokenizerError(f"{path}: added_tokens_decoder[{key!r}] has no 'content' string")
        names[tid] = content
    return names


class KimiTokenizer:
    """Encode/decode text and render Kimi's chat format. ``vocab_size`` = BPE ranks + 256 specials."""

    def __init__(self, mergeable_ranks: Dict[bytes, int], special_names: Dict[int, str], name: str = "kimi"):
        import tiktoken

        self.n_base = len(mergeable_ranks)
        self.vocab_size = self.n_base + NUM_SPECIAL_TOKENS
        self.id_to_special: Dict[int, str] = {}
        for i in range(self.n_base, self.vocab_size):
            self.id_to_special[i] = special_names.get(i, f"<|reserved_token_{i}|>")
        self.special_to_id = {v: k for k, v in self.id_to_special.items()}
        if len(self.special_to_id) != NUM_SPECIAL_TOKENS:
            raise TokenizerError(f"{name}: two special ids share one name")
        self._enc = tiktoken.Encoding(name, pat_str=KIMI_PAT_STR, mergeable_ranks=mergeable_ranks,
                                      special_tokens=self.special_to_id)

    @staticmethod
    def from_dir(path: str) -> "KimiTokenizer":
        if not os.path.isdir(path):
            raise TokenizerError(f"{path}: tokenizer directory does not exist")
        ranks = _read_ranks(os.path.join(path, "tiktoken.model"))
        names = _read_special_names(os.path.join(path, "tokenizer_config.json"), len(ranks))
        return KimiTokenizer(ranks, names, name=os.path.basename(os.path.abspath(path)) or "kimi")

    # ---- ids ----------------------------------------------------------------------------------
    def token_id(self, name: str) -> int:
        """Id of a special token by name, e.g. ``"<|im_end|>"``."""
        if name not in self.special_to_id:
            raise TokenizerError(f"special token {name!r} is not in this tokenizer")
        return self.special_to_id[name]

    @property
    def stop_ids(self) -> Tuple[int, ...]:
        return tuple(self.special_to_id[n] for n in STOP_TOKEN_NAMES if n in self.special_to_id)

    def is_special(self, tid: int) -> bool:
        return self.n_base <= tid < self.vocab_size

    # ---- text ---------------------------------------------------------------------------------
    def encode(self, text: str, allow_special: bool = False) -> List[int]:
        """Token ids of ``text``. Special-token strings inside it become their ids only when
        ``allow_special``; otherwise they are ordinary text (never an error)."""
        if not isinstance(text, str):
            raise TokenizerError(f"encode: text must be str, got {type(text).__name__}")
        ids: List[int] = []
        for piece in split_for_encoding(text):
            if allow_special:
                ids.extend(self._enc.encode(piece, allowed_special="all"))
            else:
                ids.extend(self._enc.encode_ordinary(piece))
        return ids

    def _check_ids(self, ids: Sequence[int]) -> List[int]:
        out = [int(i) for i in ids]
        bad = [i for i in out if not 0 <= i < self.vocab_size]
        if bad:
            raise TokenizerError(f"decode: token ids {bad[:8]} outside [0, {self.vocab_size})")
        return out

    def decode_bytes(self, ids: Sequence[int], skip_special: bool = False) -> bytes:
        ids = self._check_ids(ids)
        if skip_special:
            ids = [i for i in ids if not self.is_special(i)]
        return self._enc.decode_bytes(ids)

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """Text of ``ids``; bytes that are not valid UTF-8 (a split character) become U+FFFD."""
        return self.decode_bytes(ids, skip_special).decode("utf-8", errors="replace")

    # ---- chat ---------------------------------------------------------------------------------
    def render_chat(self, messages: Iterable[Tuple[str, str]], add_generation_prompt: bool = True,
                    thinking: bool = True) -> str:
        """Chat prompt text for ``[(role, text), ...]``, roles 'system' | 'user' | 'assistant'."""
        return "".join(piece for piece, _ in self._chat_pieces(messages, add_generation_prompt, thinking))

    def encode_chat(self, messages: Iterable[Tuple[str, str]], add_generation_prompt: bool = True,
                    thinking: bool = True) -> List[int]:
        """Chat prompt ids. Message text is encoded with specials disallowed, so a user cannot inject
        ``<|im_end|>`` by typing it."""
        ids: List[int] = []
        for piece, is_special in self._chat_pieces(messages, add_generation_prompt, thinking):
            ids.extend([self.token_id(piece)] if is_special else self.encode(piece))
        return ids

    def _chat_pieces(self, messages, add_generation_prompt, thinking):
        tags = {"system": "<|im_system|>", "user": "<|im_user|>", "assistant": "<|im_assistant|>"}
        for role, text in messages:
            if role not in tags:
                raise TokenizerError(f"chat: unknown role {role!r} (expected one of {sorted(tags)})")
            if not isinstance(text, str):
                raise TokenizerError(f"chat: {role} message must be str, got {type(text).__name__}")
            yield tags[role], True
            yield role, False
            yield "<|im_middle|>", True
            if text:
                yield text, False
            yield "<|im_end|>", True
        if add_generation_prompt:
            yield from generation_prompt_pieces(thinking)


def generation_prompt_pieces(thinking: bool = True):
    """(text, is_special) pieces that open the assistant's turn: K2.5 / K2.6 open a <think> block (closed at
    once when thinking is off). Shared by every chat renderer (this one, serve/chat.py's OpenAI messages)."""
    yield "<|im_assistant|>", True
    yield "assistant", False
    yield "<|im_middle|>", True
    yield "<think>", True
    if not thinking:
        yield "</think>", True


def load_tokenizer(path: str) -> KimiTokenizer:
    return KimiTokenizer.from_dir(path)
