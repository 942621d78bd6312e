"""A chat's token ids from an earlier chat it extends: an agent's next turn renders the same
history plus the answer and a new message, a retry renders the same text, the idle warm-up
renders the history with its answer, so all but its last messages were encoded before. Encoding
restarts at a turn marker both texts share (a special token the chat template writes, as
`<|im_start|>`); the ids before it are the earlier encoding's.

Why that is exact: a Hugging Face tokenizer first cuts the text at its added tokens (leftmost,
longest match of their literal text; a non-normalized one on the raw text), then normalizes,
pre-tokenizes and encodes each piece between them on its own. A marker that the earlier text's
encoding has at character c was one of those cuts; whether a cut happens at a position depends
only on the text from there to the end of the longest added token, and no other added token's
text contains a marker's (checked at load). So when the new text agrees with the old one up to
the marker's end, the cuts before and at c are the same, and encoding(new) = old ids before the
marker + encoding(new[c:]). tests/eventloop/test_encode_reuse.py compares against plain
encoding. Event loop or the preparation pool (entries behind a lock)."""
from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass
from typing import Any

# Texts shorter than this are neither looked up nor kept (SmolLM2's tokenizer, this length:
# 0.66 ms from scratch, 0.08 ms from a kept head; keeping one costs about what it saves later)
MIN_CHARS = 2048
MAX_ENTRIES = 16          # texts kept, most recent first
MAX_TOKENS = 1 << 20      # their ids together (a few tens of MB of Python ints at most)
BLOCK = 4096              # characters compared per step when finding where two texts part


@dataclass
class Entry:
    """One encoded text and where its markers are: `marks[j]` = (character offset, token
    index) of the j-th marker, `ends[j]` the character just after it."""

    text: str
    ids: list[int]
    marks: list[tuple[int, int]]
    ends: list[int]


def markers(backend: Any, template: str) -> dict[str, int]:
    """The added tokens a cut may restart at: special, matched on the raw text with nothing
    stripped around them, written literally by the chat template, and inside no other added
    token's text. Empty (no reuse) when the template writes none, or the tokenizers library is
    too old to list its added tokens."""
    listed = getattr(backend, "get_added_tokens_decoder", None)
    added = dict(listed()) if listed is not None else {}
    texts = [t.content for t in added.values()]
    out = {}
    for i, t in added.items():
        c = t.content
        if (t.special and not t.normalized and not t.lstrip and not t.rstrip
                and not t.single_word and len(c) > 1 and c in template
                and sum(c in other for other in texts) == 1):
            out[c] = i
    return out


class PrefixReuse:
    """The last MAX_ENTRIES long texts encoded, and the longest shared head of a new one."""

    def __init__(self, marks: dict[str, int]) -> None:
        self.marks = marks
        self.ids = set(marks.values())
        self._content = {i: c for c, i in marks.items()}
        self.entries: list[Entry] = []
        self._lock = threading.Lock()
        self.reused_tokens = 0   # ids taken from earlier encodings instead of encoded again

    def head(self, text: str) -> tuple[Entry, int] | None:
        """The entry sharing the longest head with `text` and the index of its last marker
        inside the shared part; None when no entry shares a marker."""
        with self._lock:
            entries = list(self.entries)
        best: tuple[Entry, int] | None = None
        for e in entries:
            shared = _shared(text, e.text)
            j = _last_before(e.ends, shared)
            if j >= 0 and (best is None or e.marks[j][1] > best[0].marks[best[1]][1]):
                best = (e, j)
        return best

    def remember(self, text: str, ids: list[int], base: tuple[Entry, int] | None) -> None:
        """Keep `text` and its `ids` (the markers before `base`'s cut are the base's; those
        after it are found in the text and checked against the ids: a text whose markers
        the ids do not show one for one is not kept)."""
        start, first, marks = 0, 0, []
        if base is not None:
            e, j = base
            start, first = e.marks[j]
            marks = e.marks[:j]
        found = self._find(text, ids, start, first)
        if found is None:
            return
        marks += found
        ends = [c + len(self._content[ids[k]]) for c, k in marks]
        entry = Entry(text, list(ids), marks, ends)   # the caller's list may change later
        with self._lock:
            kept = [entry] + [x for x in self.entries if x.text != text]
            total, keep = 0, []
            for x in kept[:MAX_ENTRIES]:
                total += len(x.ids)
                if total > MAX_TOKENS and keep:
                    break
                keep.append(x)
            self.entries = keep

    def _find(self, text: str, ids: list[int], start: int,
              first: int) -> list[tuple[int, int]] | None:
        """(offset, index) of every marker from character `start` / token `first` on, paired
        in order between the text's occurrences and the ids'; None when they disagree."""
        at: list[tuple[int, int]] = []
        for content, token in self.marks.items():
            pos = text.find(content, start)
            while pos >= 0:
                at.append((pos, token))
                pos = text.find(content, pos + len(content))
        at.sort()
        where: list[tuple[int, int]] = []
        for token in self.ids:
            try:
                k = ids.index(token, first)
                while True:
                    where.append((k, token))
                    k = ids.index(token, k + 1)
            except ValueError:
                pass
        where.sort()
        if [t for _, t in at] != [t for _, t in where]:
            return None
        return [(c, k) for (c, _), (k, _) in zip(at, where)]


def _shared(a: str, b: str) -> int:
    """The length of the longest common prefix of `a` and `b` (whole blocks, then halving)."""
    limit, low = min(len(a), len(b)), 0
    while True:
        high = min(low + BLOCK, limit)
        if a[low:high] != b[low:high]:
            break
        if high == limit:
            return limit
        low = high
    while low + 1 < high:   # a[:low] == b[:low], and they differ before high
        mid = (low + high) // 2
        if a[low:mid] == b[low:mid]:
            low = mid
        else:
            high = mid
    return low


def _last_before(ends: list[int], shared: int) -> int:
    """The index of the last marker that ends within the first `shared` characters, or -1."""
    return bisect.bisect_right(ends, shared) - 1
