"""Checkpoint loading: safetensors shards through memory maps, name mapping, tensor-parallel slices, INT4 experts.

Why our own safetensors parser: the ``safetensors`` package's numpy API has no bfloat16 (numpy has no such
dtype), and every non-expert tensor of Kimi is bf16. The format is simple (8-byte little-endian header
length, a JSON header ``{name: {dtype, shape, data_offsets}}``, then the raw little-endian data), so we parse
the header ourselves, ``np.memmap`` the file and hand out views: bf16 comes back as ``uint16`` bit
patterns (see ``bf16.py``), and a tensor-parallel slice reads only its rows (or its columns) from disk.
Headers of all shards are parsed and checked eagerly when a ``Checkpoint`` opens, so a truncated shard or an
index entry pointing at the wrong file fails at once with a message naming the tensor and the file.

Names: callers use HF names WITHOUT the ``language_model.`` prefix of the K2.5/K2.6 wrapper
(``model.layers.3.self_attn.q_a_proj.weight``). ``vision_tower.*`` and ``mm_projector.*`` are skipped.
See docs/CHECKPOINTS.md for the formats and the tensor-parallel plan (``tp_split``).
"""
from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from .bf16 import bf16_bits_to_f32
from .config import DrafterConfig, TargetConfig
from .int4 import GROUP, PACK, dequantize


class CheckpointError(ValueError):
    """A checkpoint file is missing, malformed, or lacks/mis-shapes a tensor. The message names the tensor
    and the file."""


# safetensors dtype string -> numpy dtype of the stored bits (bf16 as its uint16 bit pattern)
ST_DTYPES: Dict[str, np.dtype] = {
    "BF16": np.dtype("<u2"), "F16": np.dtype("<f2"), "F32": np.dtype("<f4"), "F64": np.dtype("<f8"),
    "I8": np.dtype("i1"), "U8": np.dtype("u1"), "I16": np.dtype("<i2"), "U16": np.dtype("<u2"),
    "I32": np.dtype("<i4"), "U32": np.dtype("<u4"), "I64": np.dtype("<i8"), "U64": np.dtype("<u8"),
    "BOOL": np.dtype("?"), "F8_E4M3": np.dtype("u1"), "F8_E5M2": np.dtype("u1"),
}
_NP_TO_ST = {np.dtype(np.float16): "F16", np.dtype(np.float32): "F32", np.dtype(np.float64): "F64",
             np.dtype(np.int8): "I8", np.dtype(np.uint8): "U8", np.dtype(np.int16): "I16",
             np.dtype(np.uint16): "U16", np.dtype(np.int32): "I32", np.dtype(np.uint32): "U32",
             np.dtype(np.int64): "I64", np.dtype(np.uint64): "U64", np.dtype(np.bool_): "BOOL"}

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
WRAPPER_PREFIX = "language_model."
SKIPPED_PREFIXES = ("vision_tower.", "mm_projector.")
_MAX_HEADER = 1 << 30      # a header beyond 1 GiB is corruption, not a checkpoint


# --------------------------------------------------------------------------------------------------
# safetensors files

@dataclass(frozen=True)
class TensorInfo:
    stored_name: str        # the name inside the file (with any prefix)
    file: str               # path of the shard
    dtype: str              # safetensors dtype string ("BF16", "I32", ...)
    shape: Tuple[int, ...]
    offset: int             # absolute byte offset of the data in the file
    nbytes: int


def read_safetensors_header(path: str) -> Tuple[Dict[str, TensorInfo], Dict[str, str]]:
    """Parse and check one safetensors file's header -> ({stored name: TensorInfo}, __metadata__)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: file is {size} bytes, too short for a safetensors header")
            n = int.from_bytes(head, "little")
            if n > size - 8 or n > _MAX_HEADER:
                raise CheckpointError(f"{path}: header length {n} exceeds the file size {size} "
                                      f"(truncated or not a safetensors file)")
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read shard: {e}") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: malformed safetensors header JSON: {e}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: safetensors header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise CheckpointError(f"{path}: __metadata__ must be an object of string values")
    data_start = 8 + n
    infos: Dict[str, TensorInfo] = {}
    for name, ent in header.items():
        where = f"tensor {name!r} in {path}"
        if not isinstance(ent, dict):
            raise CheckpointError(f"{where}: header entry is not an object")
        dt, shape, offs = ent.get("dtype"), ent.get("shape"), ent.get("data_offsets")
        if not isinstance(dt, str) or dt not in ST_DTYPES:
            raise CheckpointError(f"{where}: unsupported dtype {dt!r}")
        if (not isinstance(shape, list) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                                                   for s in shape)):
            raise CheckpointError(f"{where}: malformed shape {shape!r}")
        if (not isinstance(offs, list) or len(offs) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) for o in offs)
                or not 0 <= offs[0] <= offs[1]):
            raise CheckpointError(f"{where}: malformed data_offsets {offs!r}")
        nbytes = math.prod(shape) * ST_DTYPES[dt].itemsize
        if offs[1] - offs[0] != nbytes:
            raise CheckpointError(f"{where}: data_offsets {offs} span {offs[1] - offs[0]} bytes but dtype {dt} "
                                  f"shape {shape} needs {nbytes}")
        if data_start + offs[1] > size:
            raise CheckpointError(f"{where}: data_offsets {offs} run past the end of the file "
                                  f"({size} bytes; truncated shard?)")
        infos[name] = TensorInfo(name, path, dt, tuple(shape), data_start + offs[0], nbytes)
    _check_disjoint(infos, path)
    return infos, meta


def _check_disjoint(infos: Mapping[str, TensorInfo], path: str) -> None:
    """No two tensors may share bytes (safetensors itself refuses such a file): one tensor's data read
    through another's name would be a silent wrong weight."""
    spans = sorted((i.offset, i.offset + i.nbytes, name) for name, i in infos.items() if i.nbytes)
    reach = None               # the span reaching furthest so far
    for b0, b1, bn in spans:
        if reach is not None and b0 < reach[1]:
            a0, a1, an = reach
            raise CheckpointError(f"{path}: tensors {an!r} (bytes {a0}..{a1}) and {bn!r} (bytes {b0}..{b1}) "
                                  f"overlap: data_offsets must not share bytes")
        if reach is None or b1 > reach[1]:
            reach = (b0, b1, bn)


def save_safetensors(path: str, tensors: Mapping[str, Union[np.ndarray, Tuple[str, np.ndarray]]],
                     metadata: Optional[Mapping[str, str]] = None) -> int:
    """Write a safetensors file; returns the bytes of tensor data written.

    A value is an array (dtype taken from it) or ``(dtype_string, array)``; bf16 is ``("BF16", uint16 bits)``.
    Tensors are laid out in the mapping's order and the header is padded with spaces to a multiple of 8, so
    the same input always gives the same bytes.
    """
    header: Dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    blobs: List[np.ndarray] = []
    off = 0
    for name, v in tensors.items():
        dt, arr = v if isinstance(v, tuple) else (None, v)
        arr = np.asarray(arr)
        if dt is None:
            if arr.dtype.newbyteorder("=") not in _NP_TO_ST:
                raise ValueError(f"save_safetensors: tensor {name!r} has unsupported dtype {arr.dtype}")
            dt = _NP_TO_ST[arr.dtype.newbyteorder("=")]
        if dt not in ST_DTYPES or ST_DTYPES[dt].itemsize != arr.dtype.itemsize or arr.dtype.kind not in "biuf":
            raise ValueError(f"save_safetensors: tensor {name!r}: array dtype {arr.dtype} cannot be stored as {dt}")
        arr = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<"))
        header[name] = {"dtype": dt, "shape": list(arr.shape), "data_offsets": [off, off + arr.nbytes]}
        blobs.append(arr)
        off += arr.nbytes
    hb = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hb += b" " * (-len(hb) % 8)
    with open(path, "wb") as f:
        f.write(len(hb).to_bytes(8, "little"))
        f.write(hb)
        for a in blobs:
            f.write(a.tobytes())
    return off


# --------------------------------------------------------------------------------------------------
# the tensor-parallel plan

_L = r"(?:model\.)?layers\.\d+\."           # target layers are "model.layers.i.", drafter layers "layers.i."
_EXPERT = r"(?:shared_experts\.|experts\.\d+\.)?"
_TP_RULES: List[Tuple["re.Pattern[str]", Optional[int]]] = [(re.compile(p), d) for p, d in [
    # vocabulary-parallel embedding and head
    (r"model\.embed_tokens\.weight|lm_head\.weight", 0),
    # model-level norms; DFlash's feature projection and its norm (small, every rank needs the whole context)
    (r"model\.norm\.weight|norm\.weight|fc\.weight|hidden_norm\.weight", None),
    (_L + r"(?:input_layernorm|post_attention_layernorm)\.weight", None),
    # MLA: the down-projections and their norms are replicated (the latent cache is replicated)
    (_L + r"self_attn\.(?:q_a_proj|kv_a_proj_with_mqa|q_a_layernorm|kv_a_layernorm)\.weight", None),
    # per-head projections split by heads (rows are head-major); DFlash/Qwen3 per-head norms are replicated
    (_L + r"self_attn\.(?:q_b_proj|kv_b_proj|q_proj|k_proj|v_proj)\.weight", 0),
    (_L + r"self_attn\.(?:q_norm|k_norm)\.weight", None),
    (_L + r"self_attn\.o_proj\.weight", 1),
    # MoE router: replicated
    (_L + r"mlp\.gate\.(?:weight|e_score_correction_bias)", None),
    # SwiGLU MLPs (dense, shared expert, routed experts bf16 or INT4): gate/up by rows, down by columns
    (_L + r"mlp\." + _EXPERT + r"(?:gate_proj|up_proj)\.(?:weight|weight_packed|weight_scale)", 0),
    (_L + r"mlp\." + _EXPERT + r"down_proj\.(?:weight|weight_packed|weight_scale)", 1),
    # the logical [N, K] of an INT4 linear: tiny, replicated (get_int4 returns the shard's own shape)
    (_L + r"mlp\." + _EXPERT + r"(?:gate_proj|up_proj|down_proj)\.weight_shape", None),
]]


def tp_split(name: str) -> Optional[int]:
    """How tensor ``name`` (target or drafter, with or without the wrapper prefix) is split across
    tensor-parallel ranks: None = replicated, 0 = by rows (output features), 1 = by columns (input features).
    Raises CheckpointError for a name the plan does not know, so nothing is silently replicated."""
    n = name[len(WRAPPER_PREFIX):] if name.startswith(WRAPPER_PREFIX) else name
    for pat, dim in _TP_RULES:
        if pat.fullmatch(n):
            return dim
    raise CheckpointError(f"tensor {name!r}: no tensor-parallel rule (unknown tensor name)")


def _shard_range(extent: int, tp_rank: int, tp_size: int, what: str, unit: int = 1) -> Tuple[int, int]:
    if extent % tp_size or (extent // tp_size) % unit:
        extra = f" in whole units of {unit}" if unit > 1 else ""
        raise CheckpointError(f"{what}: extent {extent} cannot be split evenly over {tp_size} ranks{extra}")
    step = extent // tp_size
    return tp_rank * step, (tp_rank + 1) * step


# --------------------------------------------------------------------------------------------------
# progress

_BYTES_READ_TOTAL = 0   # every Checkpoint of this process together (the CLI reports the aggregate)


def bytes_read_total() -> int:
    """Bytes copied out of checkpoint files by this process so far (all Checkpoint objects)."""
    return _BYTES_READ_TOTAL


class _Progress:
    """Counts bytes copied out of the memory maps; reports GB/s through a callback or to stderr."""

    def __init__(self, progress: Union[bool, Callable[[int, float], None], None], label: str):
        if progress is True:
            def cb(nbytes: int, secs: float, _label=label) -> None:
                rate = nbytes / secs / 1e9 if secs > 0 else float("inf")
                print(f"[{_label}] read {nbytes / 1e9:.3f} GB in {secs:.2f} s ({rate:.2f} GB/s)", file=sys.stderr)
            self.cb: Optional[Callable[[int, float], None]] = cb
        else:
            self.cb = progress or None
        self.bytes = 0
        self.t0 = time.perf_counter()
        self._last = self.t0

    def add(self, nbytes: int) -> None:
        global _BYTES_READ_TOTAL
        _BYTES_READ_TOTAL += nbytes
        self.bytes += nbytes
        if self.cb is not None:
            now = time.perf_counter()
            if now - self._last >= 2.0:      # at most one interim report every 2 s
                self._last = now
                self.cb(self.bytes, now - self.t0)

    def done(self) -> None:
        if self.cb is not None:
            self.cb(self.bytes, time.perf_counter() - self.t0)


# --------------------------------------------------------------------------------------------------
# the reader

class Checkpoint:
    """Read-only view of a checkpoint directory: ``model.safetensors.index.json`` + shards, or a single
    ``model.safetensors``. Tensors are addressed by unprefixed names.

    ``prefix``: the stored-name prefix of the language model (``TargetConfig.weight_prefix``); None detects it
    (``language_model.`` if any stored name carries it, else ""). Stored names outside the prefix (the vision
    tower and projector of K2.5/K2.6) are skipped and listed in ``skipped``.
    ``progress``: True prints bytes read and GB/s to stderr; a callable gets ``(bytes, seconds)``.
    """

    def __init__(self, path: str, prefix: Optional[str] = None,
                 progress: Union[bool, Callable[[int, float], None], None] = False):
        self.dir = path
        if not os.path.isdir(path):
            raise CheckpointError(f"{path}: checkpoint directory not found")
        index = os.path.join(path, INDEX_FILE)
        single = os.path.join(path, SINGLE_FILE)
        if os.path.exists(index):
            self.index_path: Optional[str] = index
            weight_map = self._read_index(index)
        elif os.path.exists(single):
            self.index_path = None
            weight_map = None
        else:
            raise CheckpointError(f"{path}: neither {INDEX_FILE} nor {SINGLE_FILE} found")

        stored: Dict[str, TensorInfo] = {}
        if weight_map is None:
            stored, _ = read_safetensors_header(single)
        else:
            by_file: Dict[str, List[str]] = {}
            for name, fname in weight_map.items():
                by_file.setdefault(fname, []).append(name)
            for fname, names in by_file.items():
                fpath = os.path.join(path, fname)
                if not os.path.exists(fpath):
                    raise CheckpointError(f"{fpath}: shard file missing (the index maps {len(names)} tensors to it, "
                                          f"e.g. {names[0]!r})")
                infos, _ = read_safetensors_header(fpath)
                for name in names:
                    if name not in infos:
                        raise CheckpointError(f"tensor {name!r}: the index {index} maps it to {fpath}, "
                                              f"but that file does not contain it")
                    stored[name] = infos[name]

        if prefix is None:
            prefix = WRAPPER_PREFIX if any(n.startswith(WRAPPER_PREFIX) for n in stored) else ""
        self.prefix = prefix
        self.skipped: List[str] = []
        self._infos: Dict[str, TensorInfo] = {}
        for name, info in stored.items():
            if name.startswith(SKIPPED_PREFIXES) or not name.startswith(prefix):
                self.skipped.append(name)
                continue
            self._infos[name[len(prefix):]] = info
        self._maps: Dict[str, np.memmap] = {}
        self._int4_shapes: Dict[str, Tuple[int, int]] = {}
        self._progress = _Progress(progress, os.path.basename(os.path.normpath(path)) or path)

    @staticmethod
    def _read_index(index: str) -> Dict[str, str]:
        try:
            with open(index) as f:
                d = json.load(f)
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{index}: malformed index JSON: {e}") from None
        wm = d.get("weight_map") if isinstance(d, dict) else None
        if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
            raise CheckpointError(f"{index}: missing or malformed 'weight_map' object")
        for name, fname in wm.items():
            # shard names are plain file names: a path would escape the checkpoint directory
            if os.path.basename(fname) != fname or fname in ("", ".", ".."):
                raise CheckpointError(f"tensor {name!r}: index {index} maps it to an invalid file name {fname!r}")
        return wm

    # ---- lookup ---------------------------------------------------------------------------------
    def names(self) -> List[str]:
        """Unprefixed names of all (non-skipped) tensors."""
        return list(self._infos)

    def __contains__(self, name: str) -> bool:
        return self._key(name) in self._infos

    def _key(self, name: str) -> str:
        if self.prefix and name.startswith(self.prefix):
            return name[len(self.prefix):]
        return name

    def info(self, name: str) -> TensorInfo:
        key = self._key(name)
        info = self._infos.get(key)
        if info is None:
            src = self.index_path or os.path.join(self.dir, SINGLE_FILE)
            hint = ""
            if not self.prefix and WRAPPER_PREFIX + key in self._infos:
                hint = f" (the file stores {WRAPPER_PREFIX + key!r}: is the weight prefix {WRAPPER_PREFIX!r}?)"
            elif self.prefix and key in self.skipped:
                hint = f" (the file stores {key!r} without the prefix {self.prefix!r})"
            raise CheckpointError(f"tensor {self.prefix + key!r} not found in {src}{hint}")
        return info

    def _view(self, info: TensorInfo) -> np.ndarray:
        mm = self._maps.get(info.file)
        if mm is None:
            mm = self._maps[info.file] = np.memmap(info.file, dtype=np.uint8, mode="r")
        return np.ndarray(info.shape, dtype=ST_DTYPES[info.dtype], buffer=mm, offset=info.offset)

    def _check_dtype(self, info: TensorInfo, dtype) -> None:
        if dtype is None:
            return
        allowed = (dtype,) if isinstance(dtype, str) else tuple(dtype)
        if info.dtype not in allowed:
            raise CheckpointError(f"tensor {info.stored_name!r} in {info.file}: dtype {info.dtype}, "
                                  f"expected {' or '.join(allowed)}")

    # ---- reads ----------------------------------------------------------------------------------
    def get(self, name: str, dtype: Union[str, Sequence[str], None] = None, tp_rank: int = 0, tp_size: int = 1,
            dim: Optional[int] = None) -> np.ndarray:
        """Read a tensor (bf16 as uint16 bits) into memory; with ``dim`` 0/1 only rank ``tp_rank``'s slice of
        rows/columns is read. ``dtype``: expected safetensors dtype string(s), checked."""
        info = self.info(name)
        self._check_dtype(info, dtype)
        where = f"tensor {info.stored_name!r} in {info.file}"
        if not (isinstance(tp_size, (int, np.integer)) and tp_size >= 1 and 0 <= tp_rank < tp_size):
            raise CheckpointError(f"{where}: invalid tensor-parallel rank {tp_rank!r} of size {tp_size!r}")
        view = self._view(info)
        if dim is not None and tp_size > 1:
            if dim >= view.ndim:
                raise CheckpointError(f"{where}: cannot split dim {dim} of a {view.ndim}-d tensor")
            unit = 1
            if dim == 1 and info.stored_name.endswith(".weight_packed"):
                unit = GROUP // PACK          # a K split of packed words must fall on scale-group boundaries
            a, b = _shard_range(view.shape[dim], tp_rank, tp_size, where, unit)
            view = view[a:b] if dim == 0 else view[:, a:b]
        out = np.array(view, copy=True)
        self._progress.add(out.nbytes)
        return out

    def get_shard(self, name: str, tp_rank: int = 0, tp_size: int = 1,
                  dtype: Union[str, Sequence[str], None] = None) -> np.ndarray:
        """``get`` with the split dimension taken from the TP plan (``tp_split``)."""
        return self.get(name, dtype, tp_rank, tp_size, tp_split(name))

    def int4_shape(self, base: str) -> Tuple[int, int]:
        """The logical [N, K] of INT4 linear ``base`` (``...experts.3.up_proj``) from its weight_shape,
        checked against the packed and scale tensors' shapes."""
        key = self._key(base)
        if key in self._int4_shapes:
            return self._int4_shapes[key]
        sinfo = self.info(base + ".weight_shape")
        self._check_dtype(sinfo, ("I32", "I64"))
        where = f"tensor {sinfo.stored_name!r} in {sinfo.file}"
        vals = np.array(self._view(sinfo)).reshape(-1)
        self._progress.add(vals.nbytes)
        if vals.shape != (2,) or (vals <= 0).any():
            raise CheckpointError(f"{where}: weight_shape must hold two positive ints [N, K], got {vals.tolist()}")
        n, k = int(vals[0]), int(vals[1])
        pinfo, cinfo = self.info(base + ".weight_packed"), self.info(base + ".weight_scale")
        self._check_dtype(pinfo, "I32")
        self._check_dtype(cinfo, "BF16")
        if k % GROUP or pinfo.shape != (n, k // PACK):
            raise CheckpointError(f"tensor {pinfo.stored_name!r} in {pinfo.file}: shape {list(pinfo.shape)} does not "
                                  f"match weight_shape [{n}, {k}] (expected [{n}, {k // PACK}], K a multiple of {GROUP})")
        if cinfo.shape != (n, k // GROUP):
            raise CheckpointError(f"tensor {cinfo.stored_name!r} in {cinfo.file}: shape {list(cinfo.shape)} does not "
                                  f"match weight_shape [{n}, {k}] (expected [{n}, {k // GROUP}])")
        self._int4_shapes[key] = (n, k)
        return n, k

    def get_int4(self, base: str, tp_rank: int = 0, tp_size: int = 1) -> Tuple[np.ndarray, np.ndarray, Tuple[int, int]]:
        """Rank ``tp_rank``'s shard of INT4 linear ``base``: (packed int32 [n, k/8], scale bf16 bits [n, k/32],
        (n, k)) where (n, k) is the SHARD's logical shape (gate/up split N, down splits K on group bounds)."""
        n, k = self.int4_shape(base)
        dim = tp_split(base + ".weight_packed")
        packed = self.get(base + ".weight_packed", "I32", tp_rank, tp_size, dim)
        scale = self.get(base + ".weight_scale", "BF16", tp_rank, tp_size, dim)
        if tp_size > 1:
            n, k = (n // tp_size, k) if dim == 0 else (n, k // tp_size)
        return packed, scale, (n, k)

    def get_int4_stack(self, bases: Sequence[str], tp_rank: int = 0, tp_size: int = 1
                       ) -> Tuple[np.ndarray, np.ndarray, Tuple[int, int]]:
        """Shards of several INT4 linears of one shape (e.g. all experts' down_proj of a layer), stacked:
        (packed int32 [len(bases), n, k/8], scale uint16 [len(bases), n, k/32], (n, k)). The GPU loader uploads
        the two arrays as one contiguous buffer each."""
        if not bases:
            raise CheckpointError("get_int4_stack: no tensors given")
        packed = scale = None
        shape = None
        for j, base in enumerate(bases):
            p, s, sh = self.get_int4(base, tp_rank, tp_size)
            if packed is None:
                shape = sh
                packed = np.empty((len(bases),) + p.shape, p.dtype)
                scale = np.empty((len(bases),) + s.shape, s.dtype)
            elif sh != shape:
                info = self.info(base + ".weight_packed")
                raise CheckpointError(f"tensor {info.stored_name!r} in {info.file}: shard shape {list(sh)} differs from "
                                      f"{list(shape)} of {bases[0]!r} (cannot stack)")
            packed[j], scale[j] = p, s
        return packed, scale, shape

    def get_experts_int4(self, layer: int, proj: str, n_experts: int, tp_rank: int = 0, tp_size: int = 1
                         ) -> Tuple[np.ndarray, np.ndarray, Tuple[int, int]]:
        """``get_int4_stack`` over ``model.layers.{layer}.mlp.experts.{0..n_experts-1}.{proj}``."""
        if proj not in ("gate_proj", "up_proj", "down_proj"):
            raise CheckpointError(f"get_experts_int4: proj must be gate_proj, up_proj or down_proj, got {proj!r}")
        return self.get_int4_stack([f"model.layers.{layer}.mlp.experts.{e}.{proj}" for e in range(n_experts)],
                                   tp_rank, tp_size)

    # ---- validation -----------------------------------------------------------------------------
    def validate(self, expected: Mapping[str, Tuple[Tuple[int, ...], Tuple[str, ...]]]) -> None:
        """Check that every expected tensor exists with the expected shape and dtype, and that INT4
        weight_shape values agree with their packed/scale tensors. Raises one CheckpointError listing
        every problem (each naming the tensor and the file)."""
        problems: List[str] = []
        for name, (shape, dtypes) in expected.items():
            try:
                info = self.info(name)
            except CheckpointError as e:
                problems.append(str(e))
                continue
            where = f"tensor {info.stored_name!r} in {info.file}"
            if info.dtype not in dtypes:
                problems.append(f"{where}: dtype {info.dtype}, expected {' or '.join(dtypes)}")
            if info.shape != tuple(shape):
                problems.append(f"{where}: shape {list(info.shape)}, expected {list(shape)}")
            elif name.endswith(".weight_shape"):
                base = name[: -len(".weight_shape")]
                try:
                    n, k = self.int4_shape(base)
                    want = expected.get(base + ".weight_packed", ((0, 0),))[0]
                    if (n, k // PACK) != tuple(want):
                        problems.append(f"{where}: values [{n}, {k}] disagree with the config "
                                        f"(expected [{want[0]}, {want[1] * PACK}])")
                except CheckpointError as e:
                    problems.append(str(e))
        if problems:
            more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
            raise CheckpointError(f"checkpoint {self.dir}: {len(problems)} problem(s):\n  "
                                  + "\n  ".join(problems[:20]) + more)

    # ---- progress / cleanup -----------------------------------------------------------------------
    @property
    def bytes_read(self) -> int:
        return self._progress.bytes

    def report(self) -> None:
        self._progress.done()

    def close(self) -> None:
        self._maps.clear()

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# --------------------------------------------------------------------------------------------------
# expected tensors

_BF16 = ("BF16",)
Expected = Dict[str, Tuple[Tuple[int, ...], Tuple[str, ...]]]


def _int4(out: Expected, base: str, n: int, k: int, group: int) -> None:
    out[base + ".weight_packed"] = ((n, k // PACK), ("I32",))
    out[base + ".weight_scale"] = ((n, k // group), _BF16)
    out[base + ".weight_shape"] = ((2,), ("I32", "I64"))   # Moonshot writes int32, compressed-tensors int64


def expected_target_tensors(cfg: TargetConfig) -> Expected:
    """{unprefixed name: (shape, allowed safetensors dtypes)} for every tensor the engine reads."""
    H, nh = cfg.hidden_size, cfg.num_attention_heads
    out: Expected = {"model.embed_tokens.weight": ((cfg.vocab_size, H), _BF16)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = ((H,), _BF16)
        out[p + "post_attention_layernorm.weight"] = ((H,), _BF16)
        a = p + "self_attn."
        out[a + "q_a_proj.weight"] = ((cfg.q_lora_rank, H), _BF16)
        out[a + "q_a_layernorm.weight"] = ((cfg.q_lora_rank,), _BF16)
        out[a + "q_b_proj.weight"] = ((nh * cfg.qk_head_dim, cfg.q_lora_rank), _BF16)
        out[a + "kv_a_proj_with_mqa.weight"] = ((cfg.kv_lora_rank + cfg.qk_rope_head_dim, H), _BF16)
        out[a + "kv_a_layernorm.weight"] = ((cfg.kv_lora_rank,), _BF16)
        out[a + "kv_b_proj.weight"] = ((nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank), _BF16)
        out[a + "o_proj.weight"] = ((H, nh * cfg.v_head_dim), _BF16)
        m = p + "mlp."
        if not cfg.is_moe_layer(i):
            I = cfg.intermediate_size
            out[m + "gate_proj.weight"] = ((I, H), _BF16)
            out[m + "up_proj.weight"] = ((I, H), _BF16)
            out[m + "down_proj.weight"] = ((H, I), _BF16)
            continue
        E, I = cfg.n_routed_experts, cfg.moe_intermediate_size
        out[m + "gate.weight"] = ((E, H), _BF16)
        out[m + "gate.e_score_correction_bias"] = ((E,), ("F32",))
        if cfg.n_shared_experts:
            Is = I * cfg.n_shared_experts
            out[m + "shared_experts.gate_proj.weight"] = ((Is, H), _BF16)
            out[m + "shared_experts.up_proj.weight"] = ((Is, H), _BF16)
            out[m + "shared_experts.down_proj.weight"] = ((H, Is), _BF16)
        for e in range(E):
            x = f"{m}experts.{e}."
            for proj, n, k in (("gate_proj", I, H), ("up_proj", I, H), ("down_proj", H, I)):
                if cfg.quant is not None:
                    _int4(out, x + proj, n, k, cfg.quant.group_size)
                else:
                    out[x + proj + ".weight"] = ((n, k), _BF16)
    out["model.norm.weight"] = ((H,), _BF16)
    out["lm_head.weight"] = ((cfg.vocab_size, H), _BF16)
    return out


def expected_drafter_tensors(dcfg: DrafterConfig) -> Expected:
    """{name: (shape, dtypes)} of a DFlash drafter (no embedding / lm_head: it uses the target's)."""
    H, hd, I = dcfg.hidden_size, dcfg.head_dim, dcfg.intermediate_size
    nq, nkv = dcfg.num_attention_heads * hd, dcfg.num_key_value_heads * hd
    out: Expected = {}
    for i in range(dcfg.num_hidden_layers):
        p = f"layers.{i}."
        out[p + "input_layernorm.weight"] = ((H,), _BF16)
        out[p + "post_attention_layernorm.weight"] = ((H,), _BF16)
        out[p + "self_attn.q_proj.weight"] = ((nq, H), _BF16)
        out[p + "self_attn.k_proj.weight"] = ((nkv, H), _BF16)
        out[p + "self_attn.v_proj.weight"] = ((nkv, H), _BF16)
        out[p + "self_attn.o_proj.weight"] = ((H, nq), _BF16)
        out[p + "self_attn.q_norm.weight"] = ((hd,), _BF16)
        out[p + "self_attn.k_norm.weight"] = ((hd,), _BF16)
        out[p + "mlp.gate_proj.weight"] = ((I, H), _BF16)
        out[p + "mlp.up_proj.weight"] = ((I, H), _BF16)
        out[p + "mlp.down_proj.weight"] = ((H, I), _BF16)
    out["norm.weight"] = ((H,), _BF16)
    out["fc.weight"] = ((H, dcfg.num_context_features * H), _BF16)
    out["hidden_norm.weight"] = ((H,), _BF16)
    return out


# --------------------------------------------------------------------------------------------------
# whole-model loads for the numpy reference

def _to_float(a: np.ndarray, info: TensorInfo, dtype) -> np.ndarray:
    if info.dtype == "BF16":
        return bf16_bits_to_f32(a).astype(dtype, copy=False)
    return a.astype(dtype, copy=False)


def _load_all(ck: Checkpoint, expected: Expected, dtype, tp_rank: int, tp_size: int) -> Dict[str, np.ndarray]:
    ck.validate(expected)
    out: Dict[str, np.ndarray] = {}
    for name in expected:
        if name.endswith((".weight_scale", ".weight_shape")):
            continue                                 # read together with their weight_packed
        if name.endswith(".weight_packed"):
            base = name[: -len(".weight_packed")]
            packed, scale, shape = ck.get_int4(base, tp_rank, tp_size)
            out[base + ".weight"] = dequantize(packed, scale, shape, dtype)
            continue
        out[name] = _to_float(ck.get_shard(name, tp_rank, tp_size), ck.info(name), dtype)
    ck.report()
    return out


def load_reference_weights(model_dir: str, dtype=np.float64, tp_rank: int = 0, tp_size: int = 1,
                           progress: Union[bool, Callable[[int, float], None], None] = False,
                           cfg: Optional[TargetConfig] = None) -> Dict[str, np.ndarray]:
    """All target weights as float arrays with unprefixed HF names (rank ``tp_rank``'s slices when
    ``tp_size`` > 1). Routed experts come dequantized as ``...experts.{e}.{gate,up,down}_proj.weight`` with
    the exact product q * scale (what a bf16 kernel multiplying q by the scale computes)."""
    dtype = np.dtype(dtype)
    if dtype not in (np.float32, np.float64):
        raise ValueError(f"load_reference_weights: dtype must be float32 or float64, got {dtype}")
    cfg = cfg or TargetConfig.load(model_dir)
    if tp_size > 1:
        cfg.validate_tp(tp_size)
    with Checkpoint(model_dir, prefix=cfg.weight_prefix, progress=progress) as ck:
        return _load_all(ck, expected_target_tensors(cfg), dtype, tp_rank, tp_size)


def load_drafter_weights(drafter_dir: str, dtype=np.float64, tp_rank: int = 0, tp_size: int = 1,
                         progress: Union[bool, Callable[[int, float], None], None] = False,
                         cfg: Optional[DrafterConfig] = None) -> Dict[str, np.ndarray]:
    """All DFlash drafter weights as float arrays (names as stored: ``layers.0.self_attn.q_proj.weight``)."""
    dtype = np.dtype(dtype)
    if dtype not in (np.float32, np.float64):
        raise ValueError(f"load_drafter_weights: dtype must be float32 or float64, got {dtype}")
    cfg = cfg or DrafterConfig.load(drafter_dir)
    if tp_size > 1:
        cfg.validate_tp(tp_size)
    with Checkpoint(drafter_dir, prefix="", progress=progress) as ck:
        return _load_all(ck, expected_drafter_tensors(cfg), dtype, tp_rank, tp_size)
