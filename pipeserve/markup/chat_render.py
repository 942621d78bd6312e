"""Render a chat with the model's template as `tokenizer.apply_chat_template(tokenize=False)`
does, the same text, without what that call recomputes every time: the special tokens are
read once, the messages, tools and kwargs are made plain data in one pass (exact JSON types
copied directly; anything else through transformers' own conversion), and the template is
transformers' own compiled one (its cache, its sandboxed environment, globals and filters).
Calls this does not cover (a continued final message, a template of mlx-lm's own, messages
that are not dicts) go to apply_chat_template itself. Event loop or the preparation pool."""
from __future__ import annotations

from typing import Any

from transformers.tokenization_utils_base import PreTrainedTokenizerBase

try:   # transformers' private helpers (5.25): an older release renders through its own call
    from transformers.utils.chat_template_utils import (_alias_reasoning_fields,
                                                        _compile_jinja_template,
                                                        _plain_template_data)
    HELPERS = True
except ImportError:
    HELPERS = False

SCALARS = (str, int, float, bool)


def plain(value: Any) -> Any:
    """transformers' `_plain_template_data`, with JSON's own types (what a request body
    parses to) handled without its isinstance chain; the same value either way."""
    kind = type(value)
    if value is None or kind in SCALARS:
        return value
    if kind is dict:
        return {plain(k): plain(v) for k, v in value.items()}
    if kind is list:
        return [plain(v) for v in value]
    return _plain_template_data(value)


class ChatRender:
    """`render(messages, **kwargs)` equals `tokenizer.apply_chat_template(messages,
    tokenize=False, **kwargs)` for an mlx-lm TokenizerWrapper (or a transformers tokenizer)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.inner = getattr(tokenizer, "_tokenizer", tokenizer)
        # a tokenizer class with a renderer of its own (mistral-common's) keeps it
        kind = type(self.inner)
        self.direct = (HELPERS and getattr(kind, "apply_chat_template", None)
                       is PreTrainedTokenizerBase.apply_chat_template
                       and getattr(kind, "get_chat_template", None)
                       is PreTrainedTokenizerBase.get_chat_template)
        self.special = plain(dict(self.inner.special_tokens_map)) if self.direct else {}

    def render(self, messages: list[dict[str, Any]], **kwargs: Any) -> str:
        if not self._covered(messages, kwargs):
            return self.tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
        think = getattr(self.tokenizer, "_thinking_kwarg", None)
        if think is not None:   # mlx-lm's wrapper renames the thinking switch and defaults it
            if think != "enable_thinking" and "enable_thinking" in kwargs:
                kwargs[think] = kwargs.pop("enable_thinking")
            if think not in kwargs:
                kwargs[think] = self.tokenizer.has_thinking
        tools = kwargs.pop("tools", None)
        add_generation_prompt = kwargs.pop("add_generation_prompt", False)
        kwargs.pop("continue_final_message", None)
        compiled = _compile_jinja_template(self.inner.get_chat_template(None, tools))
        # apply_chat_template drops a message's keys whose value is None, then copies
        chat = _alias_reasoning_fields([{k: plain(v) for k, v in m.items() if v is not None}
                                        for m in messages])
        variables = {**self.special, **plain(kwargs)}   # kwargs over special tokens, as there
        return compiled.render(messages=chat, tools=plain(tools), documents=None,
                               add_generation_prompt=add_generation_prompt, **variables)

    def _covered(self, messages: Any, kwargs: dict[str, Any]) -> bool:
        tools = kwargs.get("tools")
        return (self.direct and getattr(self.tokenizer, "_chat_template", None) is None
                and not kwargs.get("continue_final_message")
                and type(messages) is list and bool(messages)
                and all(type(m) is dict for m in messages)
                and (tools is None or (type(tools) is list and all(type(t) is dict for t in tools)))
                and kwargs.keys().isdisjoint(("chat_template", "documents", "tokenize",
                                              "return_dict", "sanitize_control_tokens",
                                              "return_assistant_tokens_mask")))
