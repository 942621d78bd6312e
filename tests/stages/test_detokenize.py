"""TextStream: incremental, UTF-8 safe decoding with stop strings held back and cut."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from mlx_lm.utils import load_tokenizer

from pipeserve.markup.output import OutputMarkup
from pipeserve.model.tiny.text import ensure_model
from pipeserve.stages.detokenize import Detokenize

TEXT = "Plain words, café and naïve, 日本語 and emoji 😀🚀 at the end. {\"k\": [1, 2]}"


@pytest.fixture(scope="module")
def detok(model_cache: Path) -> Detokenize:
    tok = load_tokenizer(ensure_model("qwen3", "tiny", "float32", model_cache))
    return Detokenize(None, SimpleNamespace(tokenizer=tok), OutputMarkup())


def stream_all(detok: Detokenize, ids: list[int], stop: list[str]) -> tuple[list[str], str, bool]:
    ts = detok.open(stop)
    pieces = [ts.feed([i]) for i in ids]
    pieces.append(ts.finish())
    return pieces, "".join(pieces), ts.stopped


def test_one_token_at_a_time_reproduces_the_text_without_broken_characters(detok) -> None:
    ids = detok.tokenizer.encode(TEXT, add_special_tokens=False)
    assert len(ids) > len(TEXT) // 4
    pieces, text, stopped = stream_all(detok, ids, [])
    assert text == TEXT and not stopped
    assert all("\ufffd" not in p for p in pieces)   # multi-byte characters are never split


@pytest.mark.parametrize("stop", ["naïve", "😀", "end. {", "P", "2]}"])
def test_stop_string_cuts_the_text_and_is_never_emitted(detok, stop: str) -> None:
    ids = detok.tokenizer.encode(TEXT, add_special_tokens=False)
    pieces, text, stopped = stream_all(detok, ids, [stop, "never-there"])
    assert stopped
    assert text == TEXT[: TEXT.index(stop)]
    assert all(stop not in p for p in pieces)


def test_a_partial_stop_string_at_the_end_is_released(detok) -> None:
    ids = detok.tokenizer.encode(TEXT, add_special_tokens=False)
    _, text, stopped = stream_all(detok, ids, ["[1, 2]}!!"])
    assert text == TEXT and not stopped


def test_earliest_of_several_stop_strings_wins(detok) -> None:
    ids = detok.tokenizer.encode(TEXT, add_special_tokens=False)
    _, text, _ = stream_all(detok, ids, ["emoji", "café"])
    assert text == TEXT[: TEXT.index("café")]


def test_token_bytes_are_exact_for_byte_level_pieces(detok) -> None:
    ids = detok.tokenizer.encode("😀", add_special_tokens=False)
    assert b"".join(detok.token_bytes(i) for i in ids) == "😀".encode()


def test_output_markers_survive_where_the_tokenizer_marks_them_special(model_cache: Path) -> None:
    """Some families make their tool-call / think markers special tokens; decoding keeps
    those (the output parsers need them) and still drops the other special tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ensure_model("qwen3", "tiny", "float32", model_cache))
    tok.add_special_tokens({"additional_special_tokens": [
        "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]})
    ids = tok.encode("Hi<tool_call>{}</tool_call><|im_end|>", add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) == "Hi{}"
    detok = Detokenize(None, SimpleNamespace(tokenizer=tok), OutputMarkup())
    assert detok.decode(ids) == "Hi<tool_call>{}</tool_call>"
    assert stream_all(detok, ids, [])[1] == "Hi<tool_call>{}</tool_call>"


def test_plain_tokenizers_decode_as_before(detok) -> None:
    ids = detok.tokenizer.encode("a<tool_call>b<|im_end|>", add_special_tokens=False)
    assert detok.decode(ids) == "a<tool_call>b"
