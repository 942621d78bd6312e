"""Agent sessions stay warm: a 10-turn agent script through a real server on thinking
templates whose generation prompt differs from how the next turn renders the history (Qwen3
with thinking off writes an empty think span; Qwen3.5 opens <think>), on an attention model
(tiny qwen3) and on the hybrid Qwen3.5 stand-in (recurrent layers: only exact boundaries are
reusable). From turn 2 on, >= 95% of the prefix a turn shares with the previous prompt is
served from the prompt cache (the state kept at the end of each turn's history)."""
from __future__ import annotations

from os.path import commonprefix   # of any two sequences, not only paths
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from pipeserve.model.tiny.text import ensure_model
from tests.serve.test_openai import NO_EOS, TIMEOUT

_HISTORY = (
    "{%- if messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- set ns = namespace(last=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last = loop.index0 %}"
    "{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}{{- '<|im_start|>user\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' %}"
    "{%- set content = m.content or '' %}{%- set reasoning = m.reasoning_content or '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    # reasoning is kept only after the last user turn; earlier turns drop it (as Qwen3 does)
    "{%- if loop.index0 > ns.last and reasoning %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content"
    " + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}")
TEMPLATES = {
    # Qwen3: thinking off writes an empty think span into the generation prompt
    "qwen3": _HISTORY + (
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
        "{%- if enable_thinking is defined and enable_thinking is false %}"
        "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"),
    # Qwen3.5: the generation prompt opens <think> (or writes an empty span when off)
    "qwen3.5": _HISTORY + (
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
        "{%- if enable_thinking is defined and enable_thinking is false %}"
        "{{- '<think>\\n\\n</think>\\n\\n' }}{%- else %}{{- '<think>\\n' }}{%- endif %}"
        "{%- endif %}"),
}
CASES = [("qwen3", "tiny", "qwen3", False), ("qwen3.5", "qwen", "qwen3_5", True)]
SYSTEM = ("You are a coding agent. You read files, run tools and edit code carefully. "
          "Answer with the next action only. ") * 6
TURNS = 10


def agent_script(base: str, tokenizer: Any, template: str, thinking: bool) -> list[float]:
    """10 turns of one session; per turn from 2 on: cached tokens / tokens shared with the
    previous turn's prompt."""
    messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
    previous: list[int] | None = None
    reuse: list[float] = []
    for turn in range(1, TURNS + 1):
        messages.append({"role": "user", "content": f"Step {turn}: run the tests in module "
                                                    f"{turn} and report what failed."})
        r = httpx.post(base + "/v1/chat/completions", timeout=TIMEOUT, json={
            "model": "tiny", "messages": messages, "max_tokens": 12, "temperature": 0,
            "logit_bias": NO_EOS, "chat_template_kwargs": {"enable_thinking": thinking}})
        assert r.status_code == 200, r.text
        body = r.json()
        text = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                             add_generation_prompt=True,
                                             enable_thinking=thinking)
        prompt = tokenizer(text, add_special_tokens=False).input_ids
        assert len(prompt) == body["usage"]["prompt_tokens"]   # the server rendered the same
        if previous is not None:
            reuse.append(body["usage"]["prompt_tokens_details"]["cached_tokens"]
                         / len(commonprefix([prompt, previous])))
        previous = prompt
        messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
    return reuse


@pytest.mark.parametrize("name,model,arch,thinking", CASES)
def test_ten_turn_agent_reuses_95_percent_from_turn_2(server_factory: Any, model_cache: Path,
                                                     tmp_path: Path, name: str, model: str,
                                                     arch: str, thinking: bool) -> None:
    path = tmp_path / f"{name}.jinja"
    path.write_text(TEMPLATES[name])
    srv = server_factory(f"model={model}", f"model.chat_template={path}")
    tokenizer = AutoTokenizer.from_pretrained(str(ensure_model(arch, cache_dir=model_cache)))
    reuse = agent_script(srv.base_url, tokenizer, TEMPLATES[name], thinking)
    assert len(reuse) == TURNS - 1
    assert min(reuse) >= 0.95, [round(r, 3) for r in reuse]
