"""Structured output on llguidance: a Constraint (JSON object, JSON schema, regex, choice, Lark
or GBNF grammar) is compiled against the served tokenizer (an LRU keeps compiled grammars), and
each request gets a Matcher whose token bitmask the sample stage applies. No MLX: constraints
compile on the event loop side (in an executor thread); matchers advance on the engine thread."""
from __future__ import annotations

import asyncio
import copy
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from enum import Enum
from typing import Any

import llguidance as llg
import llguidance.numpy as lln
import numpy as np

from pipeserve.errors import InvalidRequest

log = logging.getLogger("pipeserve.grammar")
CACHE_SIZE = 64   # compiled grammars kept (LRU by constraint); failed compiles are kept too
# Compiles have threads of their own, never the loop's default executor: a long compile must not
# hold up a cache flush, a /metrics scrape or a model load, and at most two run at once.
COMPILE_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar")
# What a library failure looks like when it is a crash of the compiler (a Rust panic, an
# assertion), not a message about the client's text: never quoted to the client.
_PANIC_MARKS = ("panic", "assertion", "backtrace", "u16::MAX", ".rs:")
# JSON defaults (a schema's own "x-guidance" overrides them): whitespace between JSON tokens
# is bounded, so a model cannot spend max_tokens on blanks inside an object that never ends.
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": True,
                                "whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,20}"}


class ConstraintKind(str, Enum):
    JSON_OBJECT = "json_object"   # any JSON object
    JSON_SCHEMA = "json_schema"   # JSON valid under a schema
    REGEX = "regex"               # text the regex matches in full (Rust regex syntax)
    CHOICE = "choice"             # exactly one of a list of strings
    GRAMMAR = "grammar"           # llguidance Lark, or llama.cpp GBNF (converted to Lark)


@dataclass(frozen=True, slots=True)
class Constraint:
    """What a request's output must match, protocol-neutral. `source` is the constraint as text
    (the schema as JSON in the client's key order, the regex, the choices as a JSON list, the
    grammar); `param` is the request field it came from, named in errors."""

    kind: ConstraintKind
    source: str
    param: str
    whole_turn: bool = False  # built by the server for the turn (a thinking budget, a required
                              # tool call): the output is still parsed as reasoning and calls,
                              # and the grammar covers a think span the prompt opened

    @property
    def key(self) -> tuple[str, str]:
        return self.kind.value, self.source


    @classmethod
    def json_object(cls, param: str) -> Constraint:
        return cls(ConstraintKind.JSON_OBJECT, '{"type": "object"}', param)

    @classmethod
    def json_schema(cls, schema: dict[str, Any], param: str) -> Constraint:
        return cls(ConstraintKind.JSON_SCHEMA, json.dumps(schema, ensure_ascii=False), param)

    @classmethod
    def regex(cls, pattern: str, param: str) -> Constraint:
        return cls(ConstraintKind.REGEX, pattern, param)

    @classmethod
    def choice(cls, choices: Sequence[str], param: str) -> Constraint:
        return cls(ConstraintKind.CHOICE, json.dumps(list(choices), ensure_ascii=False), param)

    @classmethod
    def grammar(cls, text: str, param: str) -> Constraint:
        return cls(ConstraintKind.GRAMMAR, text, param)


@dataclass(frozen=True, slots=True)
class GrammarBounds:
    """What one request may ask the compiler to build (admission.max_grammar_bytes, …): checked
    before any compile, so a constraint past them costs a 400 and no compile time."""

    max_bytes: int = 256 * 1024
    max_choices: int = 4096
    max_depth: int = 32
    timeout_s: float = 10.0

    def check(self, c: Constraint) -> None:
        """A 400 naming the field, its size and the limit (and the key that sets it)."""
        size = len(c.source.encode("utf-8", "surrogatepass"))
        if size > self.max_bytes:
            raise InvalidRequest(
                f"{c.param}: {_what(c)} is {size} bytes; the limit is {self.max_bytes} "
                "(admission.max_grammar_bytes) — send a smaller constraint",
                param=c.param, code="grammar_too_large")
        if c.kind is ConstraintKind.CHOICE:
            num = len(json.loads(c.source))
            if num > self.max_choices:
                raise InvalidRequest(
                    f"{c.param} has {num} choices; the limit is {self.max_choices} "
                    "(admission.max_guided_choices) — send fewer choices",
                    param=c.param, code="grammar_too_large")
        if c.kind is ConstraintKind.JSON_SCHEMA:
            depth = _depth(json.loads(c.source))
            if depth > self.max_depth:
                raise InvalidRequest(
                    f"{c.param}: the JSON schema nests {depth} levels deep; the limit is "
                    f"{self.max_depth} (admission.max_schema_depth) — flatten the schema",
                    param=c.param, code="grammar_too_large")


def _depth(value: Any) -> int:
    """How deep arrays/objects nest in `value` (iterative: never recurses)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = (item.values() if isinstance(item, dict)
                    else item if isinstance(item, list) else None)
        if children is None:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest


def _grammar_text(c: Constraint) -> str:
    """The constraint as an llguidance grammar; raises ValueError on text it cannot convert."""
    if c.kind in (ConstraintKind.JSON_OBJECT, ConstraintKind.JSON_SCHEMA):
        return llg.LLMatcher.grammar_from_json_schema(
            c.source, defaults=JSON_OPTIONS)  # type: ignore[arg-type]
    if c.kind is ConstraintKind.REGEX:
        return llg.LLMatcher.grammar_from_regex(c.source)
    if c.kind is ConstraintKind.CHOICE:
        return llg.grammar_from("choice", c.source)
    return llg.grammar_from("grammar", c.source)   # Lark as is; GBNF converted to Lark


class Matcher:
    """One request's position in its grammar. Engine thread after Submit. `allowed_mask()`
    is a little-endian int32 bitmask over the model vocabulary (bit t of word t // 32 set =
    token t allowed); the tokenizer's stop tokens are allowed once the grammar is satisfied,
    and only they once it is complete."""

    __slots__ = ("ll", "num_words", "num_accepted")

    def __init__(self, ll: llg.LLMatcher, num_words: int) -> None:
        self.ll = ll
        self.num_words = num_words
        self.num_accepted = 0   # tokens of the output consumed so far

    def allowed_mask(self) -> np.ndarray:
        out = lln.allocate_token_bitmask(1, self.num_words * 32)
        lln.fill_next_token_bitmask(self.ll, out)
        return out[0]

    def accept(self, token_id: int) -> bool:
        """Advance by one emitted token; False if the grammar rejects it (the matcher then
        stays in its error state, which allows only the stop tokens)."""
        self.num_accepted += 1
        return self.ll.consume_token(token_id)

    def advance(self, output_ids: Sequence[int]) -> bool:
        """Accept the tokens of `output_ids` not yet accepted; False if one was rejected."""
        ok = True
        while self.num_accepted < len(output_ids):
            ok = self.accept(output_ids[self.num_accepted]) and ok
        return ok

    def look_ahead(self, token_id: int) -> bool:
        """Stand after one more draft (verify: position j's mask is the grammar's after the
        row's first j drafts, which `valid_prefix` accepted); `back` returns. False, the
        matcher unchanged, when the grammar cannot take it after all (a parser limit that
        validation does not reach): an error state is sticky, so the draft is tried on a copy
        of the state kept for that. The output's own tokens (`num_accepted`) are untouched."""
        before = self.ll.deep_copy()   # cheap next to a failed draft's sticky error
        if self.ll.consume_token(token_id):
            return True
        self.ll = before
        return False

    def back(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` look-aheads."""
        if num_tokens:
            self.ll.rollback(num_tokens)

    def forced(self, limit: int) -> list[int]:
        """Up to `limit` tokens the grammar admits next whatever the model says (a forced tool
        call's scaffolding, a JSON key, a closing tag): llguidance's fast-forward tokens, the
        canonical tokenization of the bytes it forces. The matcher is unchanged."""
        if limit <= 0 or self.ll.is_stopped():
            return []
        return list(self.ll.compute_ff_tokens()[:limit])

    def valid_prefix(self, drafts: Sequence[int]) -> int:
        """How many of `drafts` the grammar would accept from here, in order."""
        return self.ll.validate_tokens(list(drafts)) if drafts else 0

    def is_terminated(self) -> bool:
        """The grammar is complete (or failed): only a stop token may follow."""
        return self.ll.is_stopped()

    def is_accepting(self) -> bool:
        return self.ll.is_accepting()

    @property
    def error(self) -> str:
        return self.ll.get_error()


def fill_bitmask(matchers: Iterable[tuple[int, Matcher]], out: np.ndarray) -> None:
    """Write each (row, matcher)'s mask into row `row` of `out` (rows, words) int32. Rows not
    named are left as they are; a matcher narrower than `out` leaves the extra tokens
    disallowed, a wider one is cut to `out`'s width."""
    words = out.shape[1]
    for row, m in matchers:
        if m.num_words == words and out.flags["C_CONTIGUOUS"]:
            lln.fill_next_token_bitmask(m.ll, out, row)   # straight into the row, no copy
            continue
        mask = m.allowed_mask()
        n = min(words, len(mask))
        out[row, :n] = mask[:n]
        out[row, n:] = 0


class GrammarCompiler:
    """Compiles constraints for one tokenizer and keeps the last CACHE_SIZE compiled grammars.
    Thread-safe: `matcher()` runs in executor threads. The llguidance tokenizer (a copy of the
    vocabulary's byte strings, about a second for a 150k vocabulary) is built on first use."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: Iterable[int],
                 cache_size: int = CACHE_SIZE) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = sorted(eos_ids)
        self.cache_size = cache_size
        self._ll_tokenizer: llg.LLTokenizer | None = None
        # compiled prototypes, or the 400 a constraint got (a failed compile is not redone)
        self._cache: OrderedDict[tuple[str, str], llg.LLMatcher | InvalidRequest] = OrderedDict()
        self._inflight: dict[tuple[str, str], Future[llg.LLMatcher]] = {}
        self._lock = threading.Lock()

    @property
    def num_words(self) -> int:
        return (self.ll_tokenizer().vocab_size + 31) // 32

    def ll_tokenizer(self) -> llg.LLTokenizer:
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = _ll_tokenizer(self.tokenizer, self.vocab_size, self.eos_ids)
            return self._ll_tokenizer

    def matcher(self, constraint: Constraint) -> Matcher:
        """A fresh Matcher for `constraint`, compiled or from the cache (any thread; blocks
        while it compiles). Raises InvalidRequest naming `constraint.param` when the library
        cannot compile it. Compiles run outside the lock, so a large schema does not hold up
        requests whose grammar is cached."""
        proto = self._cached(constraint.key)
        return self._fresh(proto if proto is not None else self._compile_once(constraint))

    async def matcher_async(self, constraint: Constraint, timeout_s: float) -> Matcher:
        """Event loop: `matcher`, compiled on COMPILE_POOL. Requests for a constraint already
        compiling wait for that compile (one compile each, however many ask). A 400 naming the
        field when the compile (waiting included) takes more than `timeout_s`; the compile then
        finishes in the background and its result is cached."""
        key = constraint.key
        proto = self._cached(key)
        if proto is None:
            with self._lock:   # (a compile that ended since is in the cache: no second one)
                future = self._inflight.get(key)
                if future is None and key not in self._cache:
                    future = COMPILE_POOL.submit(self._compile_once, constraint)
                    self._inflight[key] = future
            if future is None:
                return self.matcher(constraint)
            try:
                proto = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)),
                                               timeout_s)
            except asyncio.TimeoutError:
                raise InvalidRequest(
                    f"{constraint.param}: {_what(constraint)} did not compile within "
                    f"{timeout_s:g} s (admission.grammar_timeout_s) — simplify it",
                    param=constraint.param, code="grammar_timeout") from None
        return self._fresh(proto)

    def _cached(self, key: tuple[str, str]) -> llg.LLMatcher | None:
        with self._lock:
            proto = self._cache.get(key)
            if proto is not None:
                self._cache.move_to_end(key)
        if isinstance(proto, InvalidRequest):
            raise InvalidRequest(proto.message, param=proto.param, code=proto.code)
        return proto

    def _compile_once(self, constraint: Constraint) -> llg.LLMatcher:
        key = constraint.key
        try:
            proto: llg.LLMatcher | InvalidRequest = self._compile(constraint)
        except InvalidRequest as e:
            proto = e
        with self._lock:
            self._inflight.pop(key, None)
            self._cache[key] = proto
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        if isinstance(proto, InvalidRequest):
            raise proto
        return proto

    def _fresh(self, proto: llg.LLMatcher) -> Matcher:
        words = self.num_words
        with self._lock:   # the prototype is shared by executor threads
            return Matcher(proto.deep_copy(), words)

    def __len__(self) -> int:
        return len(self._cache)

    def _compile(self, c: Constraint) -> llg.LLMatcher:
        try:
            tok = self.ll_tokenizer()
        except TypeError as e:
            raise InvalidRequest(f"{c.param} cannot be honoured: {e}", param=c.param) from e
        try:
            text = _grammar_text(c)
            ll = llg.LLMatcher(tok, text, log_level=0)
            error = ll.get_error() if ll.is_error() else None
        except ValueError as e:
            if _is_panic(str(e)):
                raise _too_complex(c, str(e)) from None
            raise InvalidRequest(f"{c.param}: {_what(c)} cannot be compiled: {_brief(str(e))}",
                                 param=c.param) from e
        except BaseException as e:   # pyo3's PanicException is a BaseException
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            raise _too_complex(c, f"{type(e).__name__}: {e}") from None
        if error is not None:
            if _is_panic(error):
                raise _too_complex(c, error)
            raise InvalidRequest(f"{c.param}: {_what(c)} cannot be enforced: "
                                 f"{_brief(error)}", param=c.param)
        return ll


def _is_panic(message: str) -> bool:
    return any(mark in message for mark in _PANIC_MARKS)


def _too_complex(c: Constraint, detail: str) -> InvalidRequest:
    """The compiler crashed on the constraint: the cause goes to the log, the client gets what
    it can change (the library's own text names its source files, not the request)."""
    log.warning("grammar compiler failed on %s (%d bytes): %s", c.param, len(c.source),
                _brief(detail))
    return InvalidRequest(f"{c.param}: {_what(c)} is too large or complex for the grammar "
                          "compiler — send a smaller or simpler constraint", param=c.param,
                          code="grammar_too_complex")


def _what(c: Constraint) -> str:
    return {ConstraintKind.JSON_OBJECT: "the JSON object constraint",
            ConstraintKind.JSON_SCHEMA: "the JSON schema", ConstraintKind.REGEX: "the regex",
            ConstraintKind.CHOICE: "the choice list", ConstraintKind.GRAMMAR: "the grammar"}[c.kind]


def _brief(message: str, limit: int = 400) -> str:
    lines = [ln for ln in message.strip().splitlines() if ln.strip()]
    text = " | ".join(ln.strip() for ln in lines[:4])
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _ll_tokenizer(tokenizer: Any, vocab_size: int, eos_ids: list[int]) -> llg.LLTokenizer:
    """llguidance's view of an mlx-lm TokenizerWrapper (or a bare Hugging Face tokenizer): its
    fast tokenizer's JSON, the model's vocabulary width (rows past the tokenizer are never
    allowed) and the stop tokens."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        raise TypeError(f"structured output needs a fast (tokenizers) tokenizer; this model's "
                        f"is {type(hf).__name__}")
    backend = copy.copy(backend)
    backend.no_padding()
    backend.no_truncation()
    n_vocab = max(vocab_size, backend.get_vocab_size(with_added_tokens=True))
    return llg.LLTokenizer(backend.to_str(), n_vocab=n_vocab, eos_token=eos_ids)
