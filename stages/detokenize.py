"""Detokenize: token ids → text, incrementally and UTF-8 safe, with stop strings matched on
the decoded text and never emitted; tool-call and think markers survive decoding for the output
parsers (pipeline/api/generation.py). Event loop, one TextStream per request; no MLX."""
from __future__ import annotations

from functools import lru_cache
from typing import Any

from pipeline.api.reasoning import THINK_PAIRS
from pipeline.api.tools import all_markers
from pipeline.config import ServeConfig
from pipeline.loader import LoadedModel

# How many already-emitted tokens to re-decode in front of new ones, so tokenizers whose
# decode depends on the left context (leading-space rules) stay correct.
CONTEXT_TOKENS = 5


class TextStream:
    """Feed token ids, get printable text. Holds back (a) an incomplete UTF-8 sequence and
    (b) a tail that could still become a stop string. After a stop match, `stopped` is set
    and nothing more is emitted."""

    def __init__(self, decode: Any, stop: list[str]) -> None:
        self._decode = decode
        self._stop = [s for s in stop if s]
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._ids: list[int] = []
        self._prefix = 0   # start of the decode window
        self._read = 0     # ids before this index are already turned into text
        self._pending = ""  # decoded but not yet emitted (a possible stop-string prefix)
        self.stopped = False
        self.matched_stop: str | None = None

    def feed(self, token_ids: list[int]) -> str:
        if self.stopped:
            return ""
        self._ids.extend(token_ids)
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        full = self._decode(self._ids[self._prefix:])
        if len(full) <= len(prefix_text) or full.endswith("\ufffd"):
            return ""  # an incomplete character: wait for its next bytes
        self._pending += full[len(prefix_text):]
        self._read = len(self._ids)
        self._prefix = max(0, self._read - CONTEXT_TOKENS)
        return self._release(final=False)

    def finish(self) -> str:
        """At the end of generation: everything still held (a partial stop string is text)."""
        if self.stopped:
            return ""
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        full = self._decode(self._ids[self._prefix:])
        self._pending += full[len(prefix_text):]
        self._read = len(self._ids)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        text = self._pending
        if self._stop:
            hits = [(i, s) for s in self._stop if (i := text.find(s)) >= 0]
            if hits:
                i, s = min(hits)
                self.stopped, self.matched_stop, self._pending = True, s, ""
                return text[:i]
            if not final:
                keep = self._partial_stop_len(text)
                self._pending = text[len(text) - keep:] if keep else ""
                return text[:len(text) - keep]
        self._pending = ""
        return text

    def _partial_stop_len(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of a stop string."""
        for n in range(min(self._hold, len(text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self._stop):
                return n
        return 0


class Detokenize:
    def __init__(self, cfg: ServeConfig, loaded: LoadedModel) -> None:
        self.tokenizer = loaded.tokenizer
        self._byte_level = _byte_level_map(self.tokenizer)
        self._hidden = _hidden_specials(self.tokenizer)

    def open(self, stop: list[str]) -> TextStream:
        return TextStream(self.decode, stop)

    def decode(self, ids: list[int]) -> str:
        """Text of `ids` without special tokens — except tool-call and think markers, which
        the output parsers must see even where a tokenizer marks them special."""
        if not ids:
            return ""
        if self._hidden is None:
            return self.tokenizer.decode(ids, skip_special_tokens=True)
        kept = [i for i in ids if i not in self._hidden]
        return self.tokenizer.decode(kept, skip_special_tokens=False) if kept else ""

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes one token stands for (byte-level BPE), else its UTF-8 text."""
        return _token_bytes(self, token_id)

    def token_text(self, token_id: int) -> str:
        return self.token_bytes(token_id).decode("utf-8", errors="replace")


@lru_cache(maxsize=65536)
def _token_bytes(detok: Detokenize, token_id: int) -> bytes:
    table = detok._byte_level
    if table is not None:
        piece = detok.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str) and all(c in table for c in piece):
            return bytes(table[c] for c in piece)
    return detok.tokenizer.decode([token_id]).encode("utf-8")


def _hidden_specials(tokenizer: Any) -> frozenset[int] | None:
    """Special token ids to drop when some special tokens are output markers (None: no
    marker is special, so the tokenizer's own skip_special_tokens is right)."""
    try:
        added = tokenizer.added_tokens_decoder
    except AttributeError:
        return None
    special = {int(i) for i, t in added.items() if getattr(t, "special", False)}
    special |= set(getattr(tokenizer, "all_special_ids", []) or [])
    markers = all_markers() | {m for pair in THINK_PAIRS for m in pair}
    vocab = tokenizer.get_vocab()
    keep = {vocab[m] for m in markers if m in vocab} & special
    return frozenset(special - keep) if keep else None


def _byte_level_map(tokenizer: Any) -> dict[str, int] | None:
    """GPT-2 byte↔unicode table when the tokenizer is byte-level BPE, else None."""
    try:
        backend = tokenizer._tokenizer.backend_tokenizer
        if type(backend.decoder).__name__ != "ByteLevel":
            return None
    except AttributeError:
        return None
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    shifted = (b for b in range(256) if b not in set(printable))
    for n, b in enumerate(shifted):
        table[chr(256 + n)] = b
    return table
