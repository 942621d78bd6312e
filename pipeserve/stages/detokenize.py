"""Detokenize: token ids → text, incrementally and UTF-8 safe, with stop strings matched on
the decoded text and never emitted; tool-call and think markers (the output markup's `kept`,
pipeserve.markup.output) survive decoding for the output parsers (pipeserve/http/api/generation.py). Event
loop, one TextStream per request; no MLX."""
from __future__ import annotations

import codecs
from functools import lru_cache
from os.path import commonprefix   # of any two sequences, not only paths
from typing import Any, Callable

from pipeserve.config import ServeConfig
from pipeserve.model.loader import LoadedModel
from pipeserve.markup.output import OutputMarkup

# How many already-emitted tokens to re-decode in front of new ones, so tokenizers whose
# decode depends on the left context (leading-space rules) stay correct. Text path only.
CONTEXT_TOKENS = 5
# Text path: the most tokens held back while the decoded text ends in U+FFFD. An incomplete
# UTF-8 sequence is at most 3 bytes and every token carries at least one, so a U+FFFD that
# 3 more tokens have not completed is an invalid sequence, emitted as it is.
MAX_HELD_TOKENS = 3


class TextStream:
    """Feed token ids, get printable text. Holds back (a) an incomplete UTF-8 sequence and
    (b) a tail that could still become a stop string. After a stop match, `stopped` is set
    and nothing more is emitted.

    Byte-level tokenizers (`piece` given: token id → its bytes, b"" for a hidden special
    token) are decoded byte by byte through an incremental UTF-8 decoder: only a valid
    incomplete sequence (at most 3 bytes) waits for the next token, invalid bytes come out as
    U+FFFD at once, and each token costs O(its bytes). Other tokenizers re-decode a bounded
    window (CONTEXT_TOKENS of left context, up to MAX_HELD_TOKENS more to start it on a
    character boundary, + at most MAX_HELD_TOKENS held)."""

    def __init__(self, decode: Any, stop: list[str],
                 piece: Callable[[int], bytes] | None = None) -> None:
        self._decode = decode
        self._piece = piece
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._stop = [s for s in stop if s]
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._ids: list[int] = []   # text path: the decode window and what is held
        self._read = 0     # ids before this index are already turned into text
        self._prefix_text = ""   # text path: decode of self._ids[:self._read]
        self._pending = ""  # decoded but not yet emitted (a possible stop-string prefix)
        self.stopped = False
        self.matched_stop: str | None = None

    def feed(self, token_ids: list[int]) -> str:
        if self.stopped:
            return ""
        if self._piece is not None:
            self._pending += self._bytes(b"".join(map(self._piece, token_ids)))
        else:
            self._ids.extend(token_ids)
            text = self._window(final=False)
            if text is None:
                return ""  # maybe an incomplete character: wait for its next bytes
            self._pending += text
        return self._release(final=False)

    def finish(self) -> str:
        """At the end of generation: everything still held (a partial stop string is text;
        an incomplete character is U+FFFD)."""
        if self.stopped:
            return ""
        if self._piece is not None:
            self._pending += self._utf8.decode(b"", final=True)
        else:
            self._pending += self._window(final=True) or ""
        return self._release(final=True)

    def _bytes(self, data: bytes) -> str:
        text = self._utf8.decode(data)
        held = self._utf8.getstate()[0]
        if len(held) == 2 and held[0] == 0xED and held[1] >= 0xA0:
            # CPython's incremental decoder waits on a surrogate's first two bytes (for the
            # surrogatepass handler); they are invalid UTF-8 already, as the full decode says
            self._utf8.reset()
            text += "\ufffd\ufffd"
        return text

    def _window(self, final: bool) -> str | None:
        """Text path: the new text of the held ids, decoded after CONTEXT_TOKENS of context.
        While the text ends in U+FFFD, the last MAX_HELD_TOKENS ids may be an incomplete
        character: text is released up to the latest boundary among them where it does not
        (None: nothing to release yet); a U+FFFD older than that is invalid and released."""
        ids, read, prefix_text = self._ids, self._read, self._prefix_text
        end, full = len(ids), self._decode(ids)
        if not final and full.endswith("\ufffd"):
            for cut in range(end - 1, max(read, end - MAX_HELD_TOKENS) - 1, -1):
                text = self._decode(ids[:cut]) if cut > read else prefix_text
                if not text.endswith("\ufffd") or cut == read:
                    end, full = cut, text
                    break
            if end == read:
                return None
        # the next window: CONTEXT_TOKENS of context, started on a character boundary (a
        # window opening inside a character decodes to U+FFFD there; with byte-fallback
        # decoders a whole run of byte tokens then does), found within MAX_HELD_TOKENS more
        keep = max(0, end - CONTEXT_TOKENS)
        context = self._decode(ids[keep:end])
        for _ in range(MAX_HELD_TOKENS):
            if keep == 0 or not context.startswith("\ufffd"):
                break
            keep -= 1
            context = self._decode(ids[keep:end])
        self._ids, self._read, self._prefix_text = ids[keep:], end - keep, context
        start = len(prefix_text) if full.startswith(prefix_text) else len(commonprefix(
            [prefix_text, full]))
        return full[start:]

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
    def __init__(self, cfg: ServeConfig, loaded: LoadedModel, markup: OutputMarkup) -> None:
        self.tokenizer = loaded.tokenizer
        self._byte_level = _byte_level_map(self.tokenizer)
        special, markers = _special_ids(self.tokenizer, markup.kept)
        self._hidden = frozenset(special - markers) if markers else None
        self._skipped = frozenset(special - markers)   # what decode drops
        # byte by byte where that is the tokenizer's own decode: byte-level BPE with no
        # clean-up pass (HF's clean_up_tokenization_spaces rewrites " ." and the like)
        bytewise = (self._byte_level is not None
                    and not getattr(self.tokenizer, "clean_up_tokenization_spaces", False))
        self._piece = self._stream_piece if bytewise else None

    def open(self, stop: list[str]) -> TextStream:
        return TextStream(self.decode, stop, self._piece)

    def _stream_piece(self, token_id: int) -> bytes:
        """Byte-level streams: a token's bytes, b"" for a special token decode drops."""
        return b"" if token_id in self._skipped else _token_bytes(self, token_id)

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


def _special_ids(tokenizer: Any, kept: frozenset[str]) -> tuple[set[int], set[int]]:
    """(special token ids, those of them that are `kept` output markers: tool-call and think
    markers, which decoding keeps)."""
    try:
        added = tokenizer.added_tokens_decoder
    except AttributeError:
        added = {}
    special = {int(i) for i, t in added.items() if getattr(t, "special", False)}
    special |= set(getattr(tokenizer, "all_special_ids", []) or [])
    vocab = tokenizer.get_vocab()
    return special, {vocab[m] for m in kept if m in vocab} & special


def _byte_level_map(tokenizer: Any) -> dict[str, int] | None:
    """GPT-2 byte↔unicode table when the tokenizer is byte-level BPE, else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)   # an HF tokenizer, or
    if backend is None:                                        # mlx-lm's wrapper of one
        backend = getattr(getattr(tokenizer, "_tokenizer", None), "backend_tokenizer", None)
    if type(getattr(backend, "decoder", None)).__name__ != "ByteLevel":
        return None
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    shifted = (b for b in range(256) if b not in set(printable))
    for n, b in enumerate(shifted):
        table[chr(256 + n)] = b
    return table
