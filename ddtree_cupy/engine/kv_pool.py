"""The paged KV pool's bookkeeping: pages, per-stream block tables, admission and release (host side).

The GPU holds, per layer, a pool of ``num_pages`` pages of ``page_size`` token rows (docs/CONTRACTS.md);
this class decides which pages belong to which stream slot and keeps the block table that the kernels
read (a host numpy mirror the engine copies into its static device buffer after every change).

Admission reserves, up front, every page a request can ever need: prompt + max new tokens + the tree
rows a verify step writes past the committed length. A request that does not fit is refused with
``KVPoolFull`` before anything is allocated, so an admitted stream can never run out of cache mid-run
and a refusal never disturbs the streams already running. Releasing a stream returns its pages.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import numpy as np


INT32_MAX = 2 ** 31 - 1       # block tables and cache positions are int32 on the GPU


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


class KVPoolFull(RuntimeError):
    """The request cannot be admitted: not enough free pages or no free stream slot."""


@dataclass
class _Slot:
    request_id: object
    pages: List[int]
    capacity: int          # tokens the reserved pages hold


class KVPool:
    def __init__(self, num_pages: int, page_size: int, max_streams: int, max_pages_per_stream: int,
                 tree_rows: int):
        for nm, v in (("num_pages", num_pages), ("page_size", page_size), ("max_streams", max_streams),
                      ("max_pages_per_stream", max_pages_per_stream)):
            if not _is_int(v) or not 1 <= v <= INT32_MAX:
                raise ValueError(f"KVPool: {nm} must be an integer in [1, 2^31), got {v!r}")
        if not _is_int(tree_rows) or not 0 <= tree_rows <= INT32_MAX:
            raise ValueError(f"KVPool: tree_rows must be an integer in [0, 2^31), got {tree_rows!r}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.max_streams = max_streams
        self.max_pages_per_stream = max_pages_per_stream
        self.tree_rows = tree_rows
        # Pop from the end: low page ids are handed out first, which keeps dumps readable.
        self._free: List[int] = list(range(num_pages - 1, -1, -1))
        self._slots: Dict[int, _Slot] = {}
        # -1 marks "no page": a kernel that reads it has a bug the tests catch.
        self.block_table = np.full((max_streams, max_pages_per_stream), -1, dtype=np.int32)

    # ------------------------------------------------------------------------------------------
    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def active_slots(self) -> List[int]:
        return sorted(self._slots)

    def pages_needed(self, prompt_len: int, max_new_tokens: int) -> int:
        tokens = prompt_len + max_new_tokens + self.tree_rows
        return -(-tokens // self.page_size)

    def max_tokens_per_stream(self) -> int:
        return self.max_pages_per_stream * self.page_size - self.tree_rows

    def admit(self, request_id, prompt_len: int, max_new_tokens: int) -> int:
        """Reserve a slot and its pages; returns the slot index. Raises KVPoolFull, changing nothing."""
        if not _is_int(prompt_len) or not 1 <= prompt_len <= INT32_MAX:
            raise ValueError(f"request {request_id!r}: prompt length must be an integer in [1, 2^31), "
                             f"got {prompt_len!r}" if _is_int(prompt_len) and prompt_len > 0 else
                             f"request {request_id!r}: empty prompt" if _is_int(prompt_len) else
                             f"request {request_id!r}: prompt length must be an integer, got {prompt_len!r}")
        if not _is_int(max_new_tokens) or not 0 <= max_new_tokens <= INT32_MAX:
            raise ValueError(f"request {request_id!r}: max_new_tokens must be an integer in [0, 2^31), "
                             f"got {max_new_tokens!r}")
        need = self.pages_needed(prompt_len, max_new_tokens)
        if need > self.max_pages_per_stream:
            raise KVPoolFull(
                f"request {request_id!r}: prompt {prompt_len} + max_new_tokens {max_new_tokens} + {self.tree_rows} "
                f"tree rows needs {need * self.page_size} cache tokens, more than one stream may hold "
                f"({self.max_pages_per_stream * self.page_size}); shorten the prompt or max_new_tokens")
        if need > len(self._free):
            raise KVPoolFull(
                f"request {request_id!r}: KV pool full: needs {need} pages of {self.page_size} tokens, "
                f"{len(self._free)} of {self.num_pages} free; retry when a stream finishes")
        slot = next((i for i in range(self.max_streams) if i not in self._slots), None)
        if slot is None:
            raise KVPoolFull(f"request {request_id!r}: all {self.max_streams} stream slots are busy")
        pages = [self._free.pop() for _ in range(need)]
        self._slots[slot] = _Slot(request_id, pages, need * self.page_size)
        self.block_table[slot, :need] = pages
        return slot

    def release(self, slot: int) -> None:
        s = self._slots.pop(slot, None)
        if s is None:
            raise KeyError(f"KV pool: slot {slot} is not in use")
        self._free.extend(reversed(s.pages))
        self.block_table[slot, :] = -1

    def capacity(self, slot: int) -> int:
        return self._slots[slot].capacity

    def request_of(self, slot: int):
        return self._slots[slot].request_id

    def check_invariants(self) -> None:
        """Every page is either free or owned by exactly one slot; tables match ownership."""
        owned = [p for s in self._slots.values() for p in s.pages]
        allp = owned + self._free
        if sorted(allp) != list(range(self.num_pages)):
            raise AssertionError("KV pool: pages lost or double-owned")
        for i in range(self.max_streams):
            row = self.block_table[i]
            if i in self._slots:
                n = len(self._slots[i].pages)
                if list(row[:n]) != self._slots[i].pages or (row[n:] != -1).any():
                    raise AssertionError(f"KV pool: block table row {i} does not match its pages")
            elif (row != -1).any():
                raise AssertionError(f"KV pool: free slot {i} has pages in its block table")
