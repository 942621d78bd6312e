"""A sound lower bound on how many tokens a text needs, from its length alone, so a prompt
that cannot fit the context is refused before it is tokenized. Built once per tokenizer at load
from its `tokenizer.json` spec; `min_tokens` is a scan or two of the text, on any thread."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# The most characters one normalized character can come from: NFC/NFKC compose, e.g. U+1F82 is
# four code points under NFD, U+FDFA eighteen under NFKD (tests check these against unicodedata).
NFC_SHRINK, NFKC_SHRINK = 4, 18
# Bytes that never occur in UTF-8 text: a byte-level vocabulary may well lack them.
NOT_UTF8 = frozenset({0xC0, 0xC1, *range(0xF5, 0x100)})


def byte_chars() -> dict[int, str]:
    """GPT-2's byte-level alphabet: the character each byte is written as in the vocabulary."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    chars = dict(zip(keep, map(chr, keep)))
    for i, b in enumerate(b for b in range(256) if b not in chars):
        chars[b] = chr(256 + i)
    return chars


@dataclass(frozen=True)
class CharBound:
    """A sound lower bound on a text's token count, from its length alone: no token of this
    vocabulary spells more than `max_token_chars` characters, and the normalizer turns at most
    `shrink` input characters (`ascii_shrink` for ASCII text) into one. Characters with one of
    the `dropped_bytes` in their UTF-8 form (a byte-level vocabulary that lacks the byte: the
    tokenizer skips them) are not counted; each is one ASCII byte or one lead byte."""
    max_token_chars: int
    shrink: int
    ascii_shrink: int
    dropped_bytes: frozenset[int] = frozenset()

    def min_tokens(self, text: str) -> int:
        ascii_text = text.isascii()
        kept = len(text)
        if self.dropped_bytes:   # short C scans, each releasing the GIL between them
            if ascii_text:
                kept -= sum(text.count(chr(b)) for b in self.dropped_bytes if b < 0x80)
            else:
                data = text.encode("utf-8", "surrogatepass")
                kept -= sum(data.count(bytes((b,))) for b in self.dropped_bytes)
        shrink = self.ascii_shrink if ascii_text else self.shrink
        return kept // (self.max_token_chars * shrink)


def char_bound(backend: Any) -> CharBound | None:
    """The CharBound of a `tokenizers.Tokenizer`, or None when its length alone bounds nothing:
    a normalizer or pre-tokenizer that can delete text, or unknown text fused into one token."""
    spec = json.loads(backend.to_str())
    shrink = _normalizer_shrink(spec.get("normalizer"))
    if shrink is None or not _keeps_text(spec.get("pre_tokenizer")):
        return None
    model = spec.get("model") or {}
    vocab = backend.get_vocab(with_added_tokens=True)
    dropped: frozenset[int] = frozenset()
    if model.get("type") == "BPE" and '"ByteLevel"' in json.dumps(spec.get("pre_tokenizer")):
        missing = {b for b, c in byte_chars().items() if c not in vocab} - NOT_UTF8
        sound = not any(0x80 <= b < 0xC0 for b in missing)   # else most characters could go
        dropped = frozenset(missing)
    elif model.get("type") in ("BPE", "Unigram") and model.get("byte_fallback"):
        sound = True
    else:   # an unknown character is one token only with an unk token that is never fused
        sound = (model.get("type") == "BPE" and model.get("unk_token") is not None
                 and not model.get("fuse_unk"))
    if not sound:
        return None
    longest = max(len(t) for t in vocab)
    return CharBound(max_token_chars=max(longest, 1), shrink=shrink[0], ascii_shrink=shrink[1],
                     dropped_bytes=dropped)


def _normalizer_shrink(spec: dict[str, Any] | None) -> tuple[int, int] | None:
    """(shrink, ascii_shrink) of a normalizer spec, None when it can delete text."""
    if spec is None:
        return 1, 1
    kind = spec.get("type")
    if kind == "Sequence":
        total = (1, 1)
        for part in spec.get("normalizers", []):
            one = _normalizer_shrink(part)
            if one is None:
                return None
            total = (total[0] * one[0], total[1] * one[1])
        return total
    if kind in ("NFD", "NFKD", "Lowercase", "Prepend"):
        return 1, 1
    if kind in ("NFC", "NFKC"):
        return (NFC_SHRINK if kind == "NFC" else NFKC_SHRINK), 1   # identity on ASCII
    if kind == "Replace":
        pattern, content = (spec.get("pattern") or {}).get("String"), spec.get("content") or ""
        if pattern is None or not content:
            return None
        factor = -(-len(pattern) // len(content))
        return factor, factor
    return None


def _keeps_text(spec: dict[str, Any] | None) -> bool:
    """Whether a pre-tokenizer spec keeps every character (splits, never removes)."""
    if spec is None:
        return True
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_keeps_text(p) for p in spec.get("pretokenizers", []))
    if kind in ("Split", "Punctuation"):
        return spec.get("behavior") != "Removed"
    return kind in ("ByteLevel", "Metaspace", "Digits", "UnicodeScripts")
