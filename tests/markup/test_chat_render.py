"""The chat renderer (pipeserve/markup/chat_render.py) writes the same prompt as
`tokenizer.apply_chat_template(tokenize=False)`, character for character, for every family
template the repo vendors and the generated model's own: with and without tools, thinking on
and off, with and without the generation prompt, a history with reasoning, calls and results;
and where apply_chat_template refuses, it refuses too. No model: the tiny tokenizer carries
each template."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pipeserve.markup.chat_render import ChatRender
from pipeserve.model.tiny.text import ensure_model

TEMPLATES = Path(__file__).parent / "templates"
NAMES = ["own"] + sorted(p.name for p in TEMPLATES.glob("*.jinja"))
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "description": "City name"}, "days": {"type": "integer"}}}}}]
CALL_ID = "abcDEF123"   # nine alphanumerics: Mistral's templates refuse other ids
CHATS: dict[str, list[dict[str, Any]]] = {
    "one turn": [{"role": "user", "content": "What is 2 + 2?"}],
    "history": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello.", "reasoning_content": "Greet back."},
        {"role": "user", "content": "And now?"}],
    "tool loop": [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "reasoning": "Look it up.", "tool_calls": [{
            "id": CALL_ID, "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}}]},
        {"role": "tool", "tool_call_id": CALL_ID, "content": "Sunny, 21 C"}],
}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_model("qwen3", "tiny", "float32", tmp_path_factory.mktemp("models"))


def outcome(render: Any) -> tuple[str, str]:
    try:
        return "text", render()
    except Exception as e:   # noqa: BLE001 — the refusal's type is what must match
        return "error", type(e).__name__


@pytest.mark.parametrize("name", NAMES)
def test_the_prompt_equals_apply_chat_template(model_path: Path, name: str) -> None:
    from mlx_lm.tokenizer_utils import load as load_tokenizer
    tok = load_tokenizer(model_path)
    if name != "own":
        tok._tokenizer.chat_template = (TEMPLATES / name).read_text()
    chat = ChatRender(tok)
    assert chat.direct   # renders itself; apply_chat_template is only the reference here
    rendered = 0
    for label, messages in CHATS.items():
        for tools in (None, TOOLS):
            for thinking in (True, False, None):
                for generation_prompt in (True, False):
                    kwargs: dict[str, Any] = {"add_generation_prompt": generation_prompt}
                    if tools is not None:
                        kwargs["tools"] = tools
                    if thinking is not None:
                        kwargs["enable_thinking"] = thinking
                    want = outcome(lambda: tok.apply_chat_template(
                        messages, tokenize=False, **kwargs))
                    got = outcome(lambda: chat.render(messages, **dict(kwargs)))
                    assert got == want, (name, label, kwargs)
                    rendered += want[0] == "text"
    assert rendered >= 24, name   # most combinations render: the equality is of prompts
    # the request's messages are not changed by rendering
    assert CHATS["tool loop"][1]["content"] is None and "thinking" not in CHATS["history"][2]
    assert "reasoning_content" not in CHATS["tool loop"][1]
