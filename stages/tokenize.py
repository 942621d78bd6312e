"""Tokenize: chat template (tools, chat_template_kwargs) or raw prompt → token ids, plus the
tokenizer's stop ids. Event loop, once per request; never touches MLX."""
from __future__ import annotations

from typing import Any

from jinja2 import TemplateError

from pipeline.config import ServeConfig
from pipeline.errors import InvalidRequest
from pipeline.loader import LoadedModel
from pipeline.request import Request


class Tokenize:
    def __init__(self, cfg: ServeConfig, loaded: LoadedModel) -> None:
        self.tokenizer = loaded.tokenizer
        self.vocab_size = int(loaded.config.get("vocab_size")
                              or loaded.config.get("text_config", {}).get("vocab_size")
                              or len(self.tokenizer))
        self.stop_ids = frozenset(self.tokenizer.eos_token_ids)

    async def __call__(self, request: Request) -> Request:
        inputs = request.inputs
        if inputs.messages is not None:
            request.prompt_ids = self.render_chat(inputs.messages, inputs.tools,
                                                  inputs.template_kwargs)
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

    def encode(self, text: str) -> list[int]:
        tok = self.tokenizer
        bos = tok.bos_token
        add_special = bos is None or not text.startswith(bos)
        return list(tok.encode(text, add_special_tokens=add_special))

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                    template_kwargs: dict[str, Any]) -> list[int]:
        tok = self.tokenizer
        if not tok.has_chat_template:
            text = "".join(str(m.get("content") or "") + "\n" for m in messages)
            return self.encode(text)
        kwargs = dict(template_kwargs)
        if tools:
            kwargs["tools"] = tools
        try:
            text = tok.apply_chat_template(messages, add_generation_prompt=True,
                                           tokenize=False, **kwargs)
        except (TemplateError, TypeError, ValueError, KeyError) as e:
            raise InvalidRequest(f"the chat template rejected these messages: {e}",
                                 param="messages") from e
        return list(tok.encode(text, add_special_tokens=False))
