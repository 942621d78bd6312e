"""Each family's real chat template (vendored in tests/markup/templates, source in each file's
first line) through the real tokenize stage: the format and reasoning markup are inferred from
it, it renders a tools conversation (call → tool result), and the call as the template writes
it in the history parses back, through our parser, to the call that was sent. No model: the
generated tiny tokenizer carries the templates. (Kimi-K2 has none here: the copies of its
template found use list.append, which the Hugging Face sandbox refuses.)"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pipeserve.http.api.generation import Delta, OutputChain
from pipeserve.http.api.harmony import HarmonySplitter
from pipeserve.http.api.openai_chat import parse_chat
from pipeserve.http.api.tools import ToolCallParser
from pipeserve.config import ServeConfig
from pipeserve.model.loader import LoadedModel
from pipeserve.markup.output import OutputMarkup
from pipeserve.model.tiny.text import ensure_model
from pipeserve.stages.tokenize import Tokenize
from tests.conftest import make_config

TEMPLATES = Path(__file__).parent / "templates"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "description": "City name"}, "days": {"type": "integer"}}}}}]
CALL = ("get_weather", {"city": "Paris", "days": 3})

# template file, format, reasoning (think | harmony | none), call id, where the history call
# starts and stops in the rendered prompt (stop: None = the tokenizer's eos), whether the stop
# marker belongs to the call, characters of the start to skip
FAMILIES = [
    ("gpt-oss.jinja", "harmony", "harmony", "call_1", "<|start|>assistant to=", "<|call|>",
     False, len("<|start|>assistant")),
    # Mistral's templates take 9-character ids only: this server's call_... ids are mapped
    ("mistral-small-3.2-v11.jinja", "mistral", "none", "call_1", "[TOOL_CALLS]", None, False, 0),
    ("mistral-nemo-v3.jinja", "mistral_v3", "none", "call_1", "[TOOL_CALLS]", None, False, 0),
    ("glm-4.6.jinja", "glm", "think", "call_1", "<tool_call>get", "</tool_call>", True, 0),
    ("deepseek-v3.1.jinja", "deepseek_v31", "think", "call_1", "<｜tool▁calls▁begin｜>",
     "<｜tool▁calls▁end｜>", True, 0),
    ("minimax-m2.jinja", "minimax_m2", "think", "call_1", "<minimax:tool_call>\n<invoke",
     "</minimax:tool_call>", True, 0),
    ("llama4-pythonic.jinja", "pythonic", "none", "call_1", "[get_weather(", "<|eot|>", False, 0),
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ServeConfig]:
    return ensure_model("qwen3", "tiny", "float32", tmp_path_factory.mktemp("models")), make_config()


def tokenize_stage(tiny: tuple[Path, ServeConfig], template: str) -> tuple[Tokenize, OutputMarkup, Any]:
    from mlx_lm.tokenizer_utils import load as load_tokenizer
    path, cfg = tiny
    tok = load_tokenizer(path)
    tok._tokenizer.chat_template = template
    loaded = LoadedModel(model=None, tokenizer=tok, path=path, fingerprint="",
                         config=json.loads((path / "config.json").read_text()), max_context=4096)
    markup = OutputMarkup.infer(tok)
    return Tokenize(cfg, loaded, markup), markup, tok


def conversation(call_id: str) -> dict[str, Any]:
    return {"model": "tiny", "tools": TOOLS, "messages": [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": call_id, "type": "function",
            "function": {"name": CALL[0], "arguments": json.dumps(CALL[1])}}]},
        {"role": "tool", "tool_call_id": call_id, "content": "Sunny, 21 C"}]}


@pytest.mark.parametrize("name, fmt, reasoning, call_id, start, stop, inclusive, skip", FAMILIES,
                         ids=[f[1] for f in FAMILIES])
def test_real_template_renders_a_call_our_parser_reads_back(
        tiny: tuple[Path, ServeConfig], name: str, fmt: str, reasoning: str, call_id: str, start: str,
        stop: str | None, inclusive: bool, skip: int) -> None:
    text = (TEMPLATES / name).read_text()
    assert text.startswith("{#- Source: ")
    stage, markup, tok = tokenize_stage(tiny, text)
    assert markup.tool_format is not None and markup.tool_format.name == fmt
    assert markup.channels == (reasoning == "harmony")
    assert (markup.think is not None) == (reasoning == "think")

    prompt = stage.prompt.render_text(parse_chat(conversation(call_id)).inputs)
    assert "get_weather" in prompt and "Sunny, 21 C" in prompt
    if fmt != "deepseek_v31":   # this template leaves the declaration to the system prompt
        assert prompt.count("get_weather") >= 2   # the tool's declaration and the history call
    i = prompt.rindex(start)   # the history call, not an example in the instructions
    end = stop if stop is not None else tok.eos_token
    j = prompt.index(end, i)
    output = prompt[i + skip: j + (len(end) if inclusive else 0)]
    chain = OutputChain(HarmonySplitter() if markup.channels else None,
                        ToolCallParser(markup.tool_format, TOOLS, "test"))
    got = Delta()
    for ch in output:   # as a stream: one character at a time
        got.extend(chain.feed(ch))
    got.extend(chain.finish())
    assert [(c.name, c.arguments) for c in got.tool_calls] == [CALL], output
    assert got.content.strip() == ""


@pytest.mark.parametrize("name, on, off", [
    # DeepSeek V3.1 reads `thinking`, GLM enable_thinking; both end the prompt with the switch
    ("deepseek-v3.1.jinja", "<｜Assistant｜><think>", "<｜Assistant｜></think>"),
    ("glm-4.6.jinja", "<|user|>\nHi<|assistant|>", "<|user|>\nHi/nothink<|assistant|>\n<think></think>"),
    # gpt-oss always reasons: reasoning_effort sets how much ("none" is its lowest, low)
    ("gpt-oss.jinja", "Reasoning: high", "Reasoning: low"),
])
def test_each_template_honours_the_thinking_switches(tiny: tuple[Path, ServeConfig], name: str,
                                                     on: str, off: str) -> None:
    stage, markup, _ = tokenize_stage(tiny, (TEMPLATES / name).read_text())
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}
    thinking = stage.prompt.render_text(parse_chat({**body, "reasoning_effort": "high"}).inputs)
    quiet = stage.prompt.render_text(parse_chat({**body, "reasoning_effort": "none"}).inputs)
    if name == "gpt-oss.jinja":
        assert on in thinking and off in quiet and on not in quiet
    else:
        assert thinking.endswith(on) and quiet.endswith(off)
    # only a prompt that opens the span has the model start inside it
    assert bool(markup.open_span(thinking)) == (name == "deepseek-v3.1.jinja")
    assert not markup.open_span(quiet)


def test_gpt_oss_history_keeps_the_reasoning_before_a_call(tiny: tuple[Path, ServeConfig]) -> None:
    """The reasoning a client sends back (reasoning_content) renders as the analysis message
    the call followed, as the gpt-oss template asks while the tool loop is open."""
    stage, _, _ = tokenize_stage(tiny, (TEMPLATES / "gpt-oss.jinja").read_text())
    body = conversation("call_1")
    body["messages"][1]["reasoning_content"] = "Need the weather tool."
    prompt = stage.prompt.render_text(parse_chat(body).inputs)
    assert ("<|start|>assistant<|channel|>analysis<|message|>Need the weather tool.<|end|>"
            "<|start|>assistant to=functions.get_weather") in prompt


def test_history_ids_follow_what_each_family_was_trained_on() -> None:
    from pipeserve.markup.chat_prompt import kimi_ids, mistral_ids
    calls = [{"id": "call_abc", "type": "function", "function": {"name": "f", "arguments": {}}},
             {"id": "functions.g:7", "type": "function", "function": {"name": "g", "arguments": {}}}]
    history = [{"role": "assistant", "content": "", "tool_calls": calls},
               {"role": "tool", "tool_call_id": "call_abc", "content": "x"}]
    assert [c["id"] for c in kimi_ids(history)[0]["tool_calls"]] == ["functions.f:0",
                                                                     "functions.g:7"]
    mapped = mistral_ids(history)
    nine = mapped[0]["tool_calls"][0]["id"]
    assert len(nine) == 9 and nine.isalnum() and mapped[1]["tool_call_id"] == nine
    assert history[0]["tool_calls"][0]["id"] == "call_abc"   # the request's own messages stay
