"""TextStream on streams of random bytes (what a random-weight model writes): text comes out
with (almost) every token, an invalid byte sequence is U+FFFD at once, a split character is
held exactly until its last byte, and the pieces join to the full decode. Byte-level BPE (the
generated models' tokenizer) and a SentencePiece-style byte-fallback tokenizer (text path)."""
from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from mlx_lm.utils import load_tokenizer

from pipeserve.markup.output import OutputMarkup
from pipeserve.model.tiny.text import ensure_model
from pipeserve.stages.detokenize import CONTEXT_TOKENS, MAX_HELD_TOKENS, Detokenize


class CountingDecode:
    """Wraps Detokenize.decode to record how many ids each call decodes."""

    def __init__(self, detok: Detokenize) -> None:
        self.detok, self.sizes = detok, []
        self.inner = detok.decode

    def __call__(self, ids: list[int]) -> str:
        self.sizes.append(len(ids))
        return self.inner(ids)


@pytest.fixture(scope="module")
def bpe(model_cache: Path) -> Detokenize:
    tok = load_tokenizer(ensure_model("qwen3", "tiny", "float32", model_cache))
    return Detokenize(None, SimpleNamespace(tokenizer=tok), OutputMarkup())


@pytest.fixture(scope="module")
def byte_ids(bpe: Detokenize) -> dict[int, int]:
    """byte value → the id of the token that is exactly that byte."""
    out: dict[int, int] = {}
    for i in range(len(bpe.tokenizer)):
        raw = bpe.token_bytes(i)
        if len(raw) == 1:
            out.setdefault(raw[0], i)
    assert len(out) == 256
    return out


def incomplete_tail(data: bytes) -> int:
    """Length of the tail of `data` that is a valid but unfinished UTF-8 sequence (0 if none),
    by Python's strict decoder: such a tail fails with 'unexpected end of data'."""
    for k in (3, 2, 1):
        if len(data) < k:
            continue
        try:
            data[-k:].decode("utf-8")
        except UnicodeDecodeError as e:
            if e.start == 0 and e.reason == "unexpected end of data":
                return k
    return 0


def run(detok: Detokenize, ids: list[int], stop: list[str] | None = None,
        decode: Any = None) -> tuple[list[str], Any]:
    ts = detok.open(stop or [])
    if decode is not None:
        ts._decode = decode
    pieces = [ts.feed([i]) for i in ids]
    pieces.append(ts.finish())
    return pieces, ts


def assert_only_incomplete_tails_wait(detok: Detokenize, ids: list[int],
                                      pieces: list[str]) -> None:
    """After every token all text is out but a valid incomplete UTF-8 tail (invalid bytes
    as U+FFFD), and the pieces join to the tokenizer's own decode of all ids."""
    assert "".join(pieces) == detok.tokenizer.decode(ids, skip_special_tokens=True)
    emitted, fed = "", b""
    special = set(detok.tokenizer.all_special_ids)
    for i, piece in zip(ids, pieces):
        fed += b"" if i in special else detok.token_bytes(i)
        emitted += piece
        k = incomplete_tail(fed)
        assert emitted == fed[:len(fed) - k].decode("utf-8", errors="replace")


# -- byte-level BPE --------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(4))
def test_random_byte_tokens_stream_text_in_almost_every_chunk(bpe, byte_ids, seed) -> None:
    rng = random.Random(seed)
    ids = [byte_ids[rng.randrange(256)] for _ in range(400)]
    pieces, _ = run(bpe, ids)
    assert_only_incomplete_tails_wait(bpe, ids, pieces)
    # random bytes: a chunk waits only behind a lead byte whose continuation may still come
    assert sum(1 for p in pieces[:-1] if p) >= 0.6 * len(ids)


@pytest.mark.parametrize("seed", range(3))
def test_random_vocabulary_tokens_match_the_full_decode(bpe, seed) -> None:
    rng = random.Random(100 + seed)
    ids = [rng.randrange(len(bpe.tokenizer)) for _ in range(300)]
    pieces, _ = run(bpe, ids)
    assert_only_incomplete_tails_wait(bpe, ids, pieces)
    assert sum(1 for p in pieces[:-1] if p) >= 0.75 * len(ids)   # half the vocabulary is bytes


def test_a_split_character_is_held_exactly_until_complete(bpe, byte_ids) -> None:
    for char in ("é", "日", "😀"):
        raw = char.encode()
        pieces, _ = run(bpe, [byte_ids[b] for b in raw])
        assert pieces == [""] * (len(raw) - 1) + [char, ""]


def test_invalid_bytes_come_out_as_replacement_characters_at_once(bpe, byte_ids) -> None:
    cases = [
        (b"\xffA", ["\ufffd", "A"]),                 # never valid
        (b"\xe6A", ["", "\ufffdA"]),                  # a lead byte, then no continuation
        (b"\x80\x80", ["\ufffd", "\ufffd"]),          # stray continuations
        (b"\xed\xa0", ["", "\ufffd\ufffd"]),          # a surrogate: invalid at its 2nd byte
        (b"\xf0\x9f\x98A", ["", "", "", "\ufffdA"]),  # 3 of 4 bytes, then something else
    ]
    for raw, want in cases:
        pieces, _ = run(bpe, [byte_ids[b] for b in raw])
        assert pieces[:-1] == want, raw
        assert pieces[-1] == ""


def test_an_unfinished_character_at_the_end_is_one_replacement_character(bpe, byte_ids) -> None:
    pieces, _ = run(bpe, [byte_ids[b] for b in b"ok\xf0\x9f"])
    assert pieces == ["o", "k", "", "", "\ufffd"]


def test_byte_level_streams_never_re_decode(bpe, byte_ids) -> None:
    counting = CountingDecode(bpe)
    rng = random.Random(7)
    run(bpe, [byte_ids[rng.randrange(256)] for _ in range(200)], decode=counting)
    assert counting.sizes == []


def test_stop_strings_work_after_invalid_bytes(bpe, byte_ids) -> None:
    raw = b"\xff\xe6ab\xf0\x9f\x98\x80STOP tail"
    pieces, ts = run(bpe, [byte_ids[b] for b in raw], stop=["STOP"])
    assert ts.stopped and ts.matched_stop == "STOP"
    assert "".join(pieces) == "\ufffd\ufffdab😀"


def test_special_tokens_are_dropped_and_markers_kept(bpe) -> None:
    tok = bpe.tokenizer
    ids = tok.encode("a<tool_call>b", add_special_tokens=False)
    ids.insert(1, tok.convert_tokens_to_ids("<|im_end|>"))
    pieces, _ = run(bpe, ids)
    assert "".join(pieces) == "a<tool_call>b" == tok.decode(ids, skip_special_tokens=True)


# -- SentencePiece-style byte fallback (the text path) ---------------------------------------
@pytest.fixture(scope="module")
def spm() -> Detokenize:
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for c in "▁abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.,é":
        vocab[c] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                 eos_token="</s>")
    detok = Detokenize(None, SimpleNamespace(tokenizer=hf), OutputMarkup())
    assert detok._piece is None   # not byte-level: the text path
    return detok


def test_text_path_reproduces_text_with_leading_space_rules(spm) -> None:
    text = "Hello there, café 日本語の文章を書きます and 😀🚀 at the end."
    ids = spm.tokenizer.encode(text, add_special_tokens=False)
    pieces, _ = run(spm, ids)
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_text_path_holds_a_split_character_and_releases_invalid_bytes(spm) -> None:
    def b(x: int) -> int:
        return 3 + x
    a = spm.tokenizer.convert_tokens_to_ids("a")
    pieces, _ = run(spm, [a, b(0xE6), b(0x97), b(0xA5), a])
    assert pieces == ["a", "", "", "日", "a", ""]
    # an invalid byte waits at most MAX_HELD_TOKENS tokens, then the text flows again
    pieces, _ = run(spm, [a, b(0xFF)] + [a] * 8)
    first = next(i for i, p in enumerate(pieces) if "\ufffd" in p)
    assert first <= 1 + MAX_HELD_TOKENS
    assert all(pieces[first + 1:-1])
    assert "".join(pieces).startswith("a\ufffd")


def test_text_path_decode_window_stays_bounded(spm) -> None:
    rng = random.Random(3)
    ids = [3 + rng.randrange(256) if rng.random() < 0.5 else
           rng.randrange(259, len(spm.tokenizer)) for _ in range(400)]
    counting = CountingDecode(spm)
    pieces, _ = run(spm, ids, decode=counting)
    assert max(counting.sizes) <= CONTEXT_TOKENS + 2 * MAX_HELD_TOKENS + 1
    assert sum(1 for p in pieces if p) >= 0.5 * len(ids)


@pytest.mark.parametrize("which", ["bpe", "spm"])
def test_several_tokens_per_step_split_anywhere(which: str, request: Any) -> None:
    """Speculative decoding hands over several tokens per step; a character split across
    steps (or inside one) still comes out whole, once."""
    detok = request.getfixturevalue(which)
    text = "Plain café, 日本語の文章を書きます and 😀🚀 mixed with words; the end."
    ids = detok.tokenizer.encode(text, add_special_tokens=False)
    rng = random.Random(5)
    for _ in range(20):
        ts, pieces, i = detok.open([]), [], 0
        while i < len(ids):
            k = rng.randint(1, 4)
            pieces.append(ts.feed(ids[i:i + k]))
            i += k
        pieces.append(ts.finish())
        assert "".join(pieces) == text
        assert all("\ufffd" not in p for p in pieces)
