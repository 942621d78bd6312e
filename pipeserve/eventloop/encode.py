"""Text → token ids for the request stages, with the context limit checked as early as it can
be: a text too long for any tokenization to fit is refused by its length (the token bound,
pipeserve.eventloop.token_bound), a token count past the context before its ids become Python
ints; and a prompt sent as token ids checked against the context and the vocabulary. Through the
Rust tokenizer directly where it encodes as the Hugging Face one does. Event loop or the
preparation pool; never touches MLX."""
from __future__ import annotations

from typing import Any

from pipeserve.errors import InvalidRequest
from pipeserve.eventloop.encode_reuse import MIN_CHARS, PrefixReuse, markers
from pipeserve.eventloop.token_bound import char_bound

# up to this many characters a prompt is encoded holding the GIL (a few hundred tokens, well
# under the switch interval); past it the Rust tokenizer runs with the GIL released
HOLD_GIL_CHARS = 2048


class Encoder:
    """One model's tokenizer, bounded by `max_context` tokens and `vocab_size` ids."""

    def __init__(self, tokenizer: Any, max_context: int, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.max_context = max_context
        self.vocab_size = vocab_size
        self.backend = backend_of(tokenizer)
        self.bound = char_bound(self.backend) if self.backend is not None else None
        self.reuse = _reuse(tokenizer, self.backend)   # a chat's head encoded before

    @property
    def max_chars(self) -> int:
        """Past this many characters a text cannot fit the context (or, with no sound bound,
        is far past any real prompt)."""
        per_token = (self.bound.max_token_chars * self.bound.shrink
                     if self.bound is not None else 256)
        return self.max_context * per_token

    def checked_ids(self, token_ids: list[int]) -> list[int]:
        """A prompt sent as token ids: within the context, each id within the vocabulary."""
        if len(token_ids) > self.max_context:
            raise InvalidRequest(f"prompt has {len(token_ids)} tokens; the context limit is "
                                 f"{self.max_context} — shorten the prompt", param="prompt",
                                 code="context_length_exceeded")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequest(
                f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})",
                param="prompt")
        return list(token_ids)

    def check_length(self, text: str, field: str) -> None:
        """Refuse, before tokenizing, a text too long for any tokenization to fit the context."""
        if self.bound is None:
            return
        least = self.bound.min_tokens(text)
        if least > self.max_context:
            size = ("messages render to" if field == "messages" else f"{field} is")
            raise InvalidRequest(
                f"{size} {len(text)} characters; no token of this tokenizer spells more than "
                f"{self.bound.max_token_chars}, so that is at least {least} tokens and the "
                f"context limit is {self.max_context} — shorten the prompt",
                param=field, code="context_length_exceeded")

    def encode(self, text: str, field: str = "prompt") -> list[int]:
        """A raw prompt: the tokenizer's special tokens added unless the text starts with BOS."""
        bos = self.tokenizer.bos_token
        return self.encode_text(text, bos is None or not text.startswith(bos), field)

    def encode_rendered(self, text: str) -> list[int]:
        """A rendered chat: the template wrote the special tokens (without one, as a prompt).
        Kept for reuse: the next turn's chat, or this one again, encodes only what follows
        the last turn marker they share (pipeserve/eventloop/encode_reuse.py)."""
        if not self.tokenizer.has_chat_template:
            return self.encode(text, "messages")
        return self.encode_text(text, False, "messages", remember=True)

    def encode_text(self, text: str, add_special: bool, field: str,
                    remember: bool = False) -> list[int]:
        """Through the Rust tokenizer directly when there is one, and a count past the context
        is refused before its ids become Python ints. A text past HOLD_GIL_CHARS goes through
        its batch call, which releases the GIL while it works; a shorter one keeps the GIL:
        giving it up costs the event loop a wait for the engine thread to hand it back, longer
        than the encoding itself. A long text without added special tokens starts from the
        ids of an earlier text it shares a head with (`remember`: this one is kept for
        later texts)."""
        if self.backend is None:
            ids = list(self.tokenizer.encode(text, add_special_tokens=add_special))
            self._check_count(len(ids), field)
            return ids
        reuse = self.reuse if not add_special and len(text) >= MIN_CHARS else None
        base = reuse.head(text) if reuse is not None else None
        head: list[int] = []
        start = 0
        if base is not None:
            entry, j = base
            start, cut = entry.marks[j]
            head = entry.ids[:cut]
        rest = text[start:] if start else text
        if len(rest) <= HOLD_GIL_CHARS:
            encoding = self.backend.encode(rest, add_special_tokens=add_special)
        else:
            encode = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)
            encoding = encode([rest], add_special_tokens=add_special)[0]
        self._check_count(len(head) + len(encoding), field)
        ids = head + encoding.ids if head else encoding.ids
        if reuse is not None:
            reuse.reused_tokens += len(head)
            if remember:
                reuse.remember(text, ids, base)
        return ids

    def _check_count(self, num: int, field: str) -> None:
        if num > self.max_context:
            raise InvalidRequest(f"prompt has {num} tokens; the context limit is "
                                 f"{self.max_context} — shorten the prompt", param=field,
                                 code="context_length_exceeded")


def _reuse(tokenizer: Any, backend: Any) -> PrefixReuse | None:
    """Reuse of earlier encodings, for a fast tokenizer whose chat template writes turn
    markers; None otherwise."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = "\n".join(str(t) for t in template.values())
    if backend is None or not isinstance(template, str):
        return None
    marks = markers(backend, template)
    return PrefixReuse(marks) if marks else None


def backend_of(tokenizer: Any) -> Any:
    """The `tokenizers.Tokenizer` under a fast Hugging Face tokenizer, when it encodes exactly
    as `tokenizer.encode` does (no truncation or padding configured), else None."""
    backend = getattr(getattr(tokenizer, "_tokenizer", tokenizer), "backend_tokenizer", None)
    if backend is None or backend.truncation is not None or backend.padding is not None:
        return None
    return backend
