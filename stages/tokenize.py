"""Tokenize: chat template (tools, chat_template_kwargs, thinking on/off) or raw prompt →
token ids, plus the tokenizer's stop ids and the assistant-turn prefix that output parsing
starts from. Event loop, once per request; never touches MLX."""
from __future__ import annotations

import logging
from typing import Any

from jinja2 import TemplateError

from pipeline.api.reasoning import infer_markers, open_span
from pipeline.api.tools import resolve_format
from pipeline.config import ServeConfig
from pipeline.errors import InvalidRequest
from pipeline.loader import LoadedModel
from pipeline.request import PromptInput, Request

log = logging.getLogger("pipeserve")


class Tokenize:
    """Owns how prompts are rendered and what the model's output markup is: `tool_format`
    (model.tool_call_format, or inferred from the chat template) and `think` markers."""

    def __init__(self, cfg: ServeConfig, loaded: LoadedModel) -> None:
        self.tokenizer = loaded.tokenizer
        self.vocab_size = int(loaded.config.get("vocab_size")
                              or loaded.config.get("text_config", {}).get("vocab_size")
                              or len(self.tokenizer))
        self.stop_ids = frozenset(self.tokenizer.eos_token_ids)
        self.tool_format = resolve_format(cfg.model.tool_call_format.value, self.tokenizer)
        self.think = infer_markers(self.tokenizer)
        self.enable_thinking = cfg.model.enable_thinking
        log.info("output markup: tool calls %s, think markers %s",
                 self.tool_format.name if self.tool_format else "not parsed",
                 f"{self.think.start}…{self.think.end}" if self.think else "none")

    async def __call__(self, request: Request) -> Request:
        inputs = request.inputs
        if inputs.messages is not None:
            if request.constraint is not None:   # structured output: the answer starts at once
                inputs.template_kwargs.setdefault("enable_thinking", False)
            text = self.render_text(inputs)
            request.output_prefix = open_span(text, self.think)
            forced = self._forced_call(inputs, request.output_prefix)
            request.output_prefix = forced or request.output_prefix
            request.prompt_ids = self.encode_rendered(text + forced)
        elif inputs.text is not None:
            request.prompt_ids = self.encode(inputs.text)
        else:
            assert inputs.token_ids is not None
            bad = [t for t in inputs.token_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequest(
                    f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})",
                    param="prompt")
            request.prompt_ids = list(inputs.token_ids)
        if not request.prompt_ids:
            raise InvalidRequest("prompt is empty after tokenization; send at least one token",
                                 param="prompt" if inputs.messages is None else "messages")
        request.stop_token_ids = self.stop_ids
        return request

    def _forced_call(self, inputs: PromptInput, open_think: str) -> str:
        """tool_choice required / named: start the assistant turn with the call's opening
        markup (and the tool's name), so the model writes a call. Not when the prompt left a
        think span open: the model reasons first, and the call is then up to it."""
        if inputs.tool_choice not in ("required", "named") or not inputs.tools:
            return ""
        if self.tool_format is None:
            raise InvalidRequest(
                f"tool_choice {inputs.tool_choice!r} needs a tool-call format, but "
                "model.tool_call_format is none or could not be inferred from the chat "
                "template; set model.tool_call_format", param="tool_choice")
        if open_think:
            return ""
        return self.tool_format.forced(inputs.tool_name if inputs.tool_choice == "named" else None)

    def encode(self, text: str) -> list[int]:
        tok = self.tokenizer
        bos = tok.bos_token
        add_special = bos is None or not text.startswith(bos)
        return list(tok.encode(text, add_special_tokens=add_special))

    def encode_rendered(self, text: str) -> list[int]:
        if not self.tokenizer.has_chat_template:
            return self.encode(text)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def render_text(self, inputs: PromptInput) -> str:
        """The chat as the model's template writes it, generation prompt included."""
        tok, messages = self.tokenizer, inputs.messages or []
        if not tok.has_chat_template:
            return "".join(str(m.get("content") or "") + "\n" for m in messages)
        kwargs: dict[str, Any] = dict(inputs.template_kwargs)
        if "enable_thinking" not in kwargs:
            default = self.enable_thinking
            kwargs["enable_thinking"] = (self.think is not None) if default is None else default
        if inputs.tools and inputs.tool_choice != "none":
            kwargs["tools"] = inputs.tools
        try:
            return tok.apply_chat_template(messages, add_generation_prompt=True,
                                           tokenize=False, **kwargs)
        except (TemplateError, TypeError, ValueError, KeyError) as e:
            raise InvalidRequest(f"the chat template rejected these messages: {e}",
                                 param="messages") from e
