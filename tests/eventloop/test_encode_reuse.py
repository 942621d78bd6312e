"""pipeserve/eventloop/encode_reuse.py: a chat encoded from an earlier chat it extends gives the
ids plain encoding of the whole text gives, whatever the conversation does (next turns, the
same text again, an edited or cut history, marker text and marker fragments inside messages,
whitespace and non-ASCII at the cuts), through the generated tiny model's real tokenizer and
chat template. No model weights."""
from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from mlx_lm.utils import load_tokenizer

from pipeserve.eventloop.encode import Encoder
from pipeserve.eventloop.encode_reuse import MAX_ENTRIES, MIN_CHARS
from pipeserve.model.tiny.text import ensure_model

DOC = (Path(__file__).resolve().parents[2] / "docs" / "how-it-works.md").read_text()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return load_tokenizer(ensure_model("qwen3", "tiny", "float32",
                                       tmp_path_factory.mktemp("models")))


def plain(encoder: Encoder, text: str) -> list[int]:
    """The whole text encoded from scratch, as the tokenizer itself does it."""
    return list(encoder.tokenizer.encode(text, add_special_tokens=False))


def render(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def piece(rng: random.Random, marks: list[str]) -> str:
    """A message: a stretch of real prose, sometimes with a marker (whole or cut short),
    whitespace runs or non-ASCII text at its ends."""
    at = rng.randrange(len(DOC) - 4000)
    text = DOC[at:at + rng.randrange(1, 4000)]
    kind = rng.randrange(6)
    if kind == 0:
        text += rng.choice(marks)[:rng.randrange(1, 12)]
    elif kind == 1:
        text = " \n\t " * rng.randrange(3) + text + "  " * rng.randrange(3)
    elif kind == 2:
        text += "ünïcödé 漢字 🙂" * rng.randrange(1, 3)
    elif kind == 3:
        text = rng.choice(marks) + text
    return text


@pytest.mark.parametrize("seed", range(4))
def test_a_conversation_encodes_as_plain_encoding_does(tokenizer: Any, seed: int) -> None:
    encoder = Encoder(tokenizer, 1 << 20, 1 << 20)
    reuse = encoder.reuse
    assert reuse is not None and set(reuse.marks) == {"<|im_start|>", "<|im_end|>"}
    rng = random.Random(seed)
    marks = list(reuse.marks)
    for _ in range(6):
        messages = [{"role": "system", "content": piece(rng, marks)}]
        for _ in range(rng.randrange(2, 7)):
            messages.append({"role": "user", "content": piece(rng, marks) * rng.randrange(1, 4)})
            text = render(tokenizer, messages)
            assert encoder.encode_rendered(text) == plain(encoder, text)
            if rng.random() < 0.25:   # the client edits or cuts the history
                i = rng.randrange(1, len(messages))
                content = messages[i]["content"]
                messages[i] = {**messages[i], "content":
                               content[:rng.randrange(len(content) + 1)] + piece(rng, marks)}
            messages.append({"role": "assistant", "content": piece(rng, marks)})
    assert reuse.reused_tokens > 0   # the property held where it was used


def test_a_next_turn_encodes_only_after_the_last_shared_marker(tokenizer: Any) -> None:
    encoder = Encoder(tokenizer, 1 << 20, 1 << 20)
    reuse = encoder.reuse
    assert reuse is not None
    messages = [{"role": "system", "content": DOC[:MIN_CHARS]},
                {"role": "user", "content": DOC[MIN_CHARS:2 * MIN_CHARS]}]
    first = render(tokenizer, messages)
    ids = encoder.encode_rendered(first)
    assert reuse.reused_tokens == 0
    again = encoder.encode_rendered(first)   # a retry: all but the generation prompt reused
    assert again == ids and reuse.reused_tokens == len(ids) - len(plain(encoder, first[
        first.rindex("<|im_start|>"):]))
    messages += [{"role": "assistant", "content": "Read."}, {"role": "user", "content": "Next?"}]
    second = render(tokenizer, messages)
    before = reuse.reused_tokens
    assert encoder.encode_rendered(second) == plain(encoder, second)
    assert reuse.reused_tokens - before == len(ids) - len(plain(encoder, first[
        first.rindex("<|im_start|>"):]))   # the first turn's ids up to its generation prompt


def test_the_kept_ids_are_the_encoders_own(tokenizer: Any) -> None:
    """A caller that changes the list it got (the engine grows a preempted row's prompt)
    does not change what a later text reuses."""
    encoder = Encoder(tokenizer, 1 << 20, 1 << 20)
    text = render(tokenizer, [{"role": "user", "content": DOC[:2 * MIN_CHARS]}])
    got = encoder.encode_rendered(text)
    got[:10] = [7] * 10
    got.append(7)
    assert encoder.encode_rendered(text) == plain(encoder, text)


def test_short_texts_and_special_token_prompts_are_left_alone(tokenizer: Any) -> None:
    encoder = Encoder(tokenizer, 1 << 20, 1 << 20)
    reuse = encoder.reuse
    assert reuse is not None
    short = render(tokenizer, [{"role": "user", "content": "hi"}])
    assert encoder.encode_rendered(short) == plain(encoder, short)
    assert reuse.entries == []
    long = render(tokenizer, [{"role": "user", "content": DOC[:2 * MIN_CHARS]}])
    encoder.encode_rendered(long)
    with_special = encoder.encode_text(long, True, "prompt")   # the tokenizer adds its own
    assert with_special == list(tokenizer.encode(long, add_special_tokens=True))
    assert reuse.reused_tokens == 0


def test_entries_are_bounded(tokenizer: Any) -> None:
    encoder = Encoder(tokenizer, 1 << 20, 1 << 20)
    reuse = encoder.reuse
    assert reuse is not None
    for i in range(MAX_ENTRIES + 5):
        encoder.encode_rendered(render(tokenizer, [
            {"role": "system", "content": f"agent {i}"},
            {"role": "user", "content": DOC[:MIN_CHARS]}]))
    assert len(reuse.entries) == MAX_ENTRIES
    assert reuse.entries[0].text.startswith("<|im_start|>system\nagent " + str(MAX_ENTRIES + 4))


def test_a_context_overflow_is_refused_with_a_reused_head(tokenizer: Any) -> None:
    from pipeserve.errors import InvalidRequest

    text = render(tokenizer, [{"role": "user", "content": DOC[:2 * MIN_CHARS]}])
    n = len(plain(Encoder(tokenizer, 1 << 20, 1 << 20), text))
    encoder = Encoder(tokenizer, n + 10, 1 << 20)
    encoder.encode_rendered(text)
    more = render(tokenizer, [{"role": "user", "content": DOC[:2 * MIN_CHARS]},
                              {"role": "assistant", "content": "ok"},
                              {"role": "user", "content": DOC[:200]}])
    with pytest.raises(InvalidRequest, match="context limit"):
        encoder.encode_rendered(more)
