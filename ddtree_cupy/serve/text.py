"""Token ids -> text as a stream produces them, with OpenAI ``stop`` strings matched across token boundaries.

``StreamText.feed(ids)`` returns the text that is final so far: whole UTF-8 characters only (a character
split over two tokens waits for its second half) and never a tail that could still grow into a stop
string. When a stop string appears, the text before it is returned, ``stopped`` is set and the stream
should be ended (the stop string itself is not emitted). Stop ids (``<|im_end|>``...) are never text.
"""
from __future__ import annotations

import codecs
from typing import Sequence, Tuple


class StreamText:
    def __init__(self, tok, stop_ids: Sequence[int] = (), stop_strings: Sequence[str] = ()):
        self.tok = tok
        self.stop_ids = frozenset(int(i) for i in stop_ids)
        self.stops = tuple(s for s in stop_strings if s)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.pending = ""            # decoded, not yet released (could start a stop string)
        self.stopped = False
        self.text = ""               # everything released

    def _decode(self, ids: Sequence[int]) -> str:
        ids = [int(i) for i in ids if int(i) not in self.stop_ids]
        if self.tok is None:
            return "".join(f"<{i}>" for i in ids)
        return self.dec.decode(self.tok.decode_bytes(ids)) if ids else ""

    def feed(self, ids: Sequence[int]) -> str:
        if self.stopped:
            return ""
        buf = self.pending + self._decode(ids)
        cut = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            out, self.pending = buf[:cut], ""
        else:
            keep = self._held_tail(buf)
            out, self.pending = buf[:len(buf) - keep], buf[len(buf) - keep:]
        self.text += out
        return out

    def _held_tail(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of a stop string."""
        for n in range(min(self.hold, len(buf)), 0, -1):
            tail = buf[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0

    def flush(self) -> str:
        """At the end of the stream: whatever was held back (it did not become a stop string)."""
        if self.stopped:
            return ""
        out = self.pending + (self.dec.decode(b"", final=True) if self.tok is not None else "")
        self.pending = ""
        self.text += out
        return out


def split_held(buf: str, tags: Tuple[str, ...]) -> int:
    """Length of the longest suffix of ``buf`` that is a proper prefix of one of ``tags`` (to hold back)."""
    for n in range(min(max(len(t) for t in tags) - 1, len(buf)), 0, -1):
        tail = buf[-n:]
        if any(t.startswith(tail) for t in tags):
            return n
    return 0
