"""The chat as prompt text: the request's messages, tools and template variables (thinking
on/off, reasoning effort) rendered by the model's chat template (through ChatRender) or by a
template sent in chat_template_kwargs (only where allowed, in the sandbox); and the message
rewrites some families' templates need (tool-call arguments as text, Mistral's and Kimi-K2's
call ids). Event loop or the preparation pool; never touches MLX."""
from __future__ import annotations

import hashlib
import json
from typing import Any

from jinja2 import TemplateError

from pipeserve.errors import InvalidRequest
from pipeserve.eventloop import template_sandbox
from pipeserve.markup.chat_render import ChatRender
from pipeserve.markup.output import OutputMarkup
from pipeserve.request import PromptInput

# apply_chat_template's own parameters (and `messages`, which the server fills): they change the
# call, not what the template sees, so they are not template variables. (`chat_template`, the
# template itself, is opt-in: see ChatPrompt.request_template.)
CALL_PARAMS = frozenset({"conversation", "messages", "add_generation_prompt",
                         "continue_final_message", "tokenize", "padding", "truncation",
                         "max_length", "return_tensors", "return_dict",
                         "return_assistant_tokens_mask", "tokenizer_kwargs"})
# gpt-oss's template knows low / medium / high: the other efforts go to the nearest
HARMONY_EFFORTS = {"none": "low", "minimal": "low", "xhigh": "high"}
TEMPLATE_ERRORS = (TemplateError, TypeError, ValueError, LookupError, AttributeError,
                   ArithmeticError, RecursionError)


class ChatPrompt:
    """Renders one model's chats. `markup` (pipeserve.markup.output) says whether the model
    thinks and which tool-call format it writes; `max_chars` is where the sandbox stops writing
    a request's template (past it the prompt cannot fit the context)."""

    def __init__(self, tokenizer: Any, markup: OutputMarkup, enable_thinking: bool | None,
                 allow_templates: bool, template_timeout_s: float, max_chars: int) -> None:
        self.tokenizer = tokenizer
        self.markup = markup
        self.chat = ChatRender(tokenizer)   # the model's template, as apply_chat_template
        self.enable_thinking = enable_thinking
        self.allow_templates = allow_templates
        self.template_timeout_s = template_timeout_s
        self.max_chars = max_chars
        template = getattr(tokenizer, "chat_template", None)
        self._thinking_var = isinstance(template, str) and "thinking is defined" in template

    def request_template(self, inputs: PromptInput) -> str | None:
        """A template sent in chat_template_kwargs (refused unless server.allow_request_templates);
        the other keys must be template variables, not apply_chat_template's own parameters."""
        kwargs = inputs.template_kwargs
        for key in kwargs:
            if key in CALL_PARAMS:
                raise InvalidRequest(
                    f"chat_template_kwargs.{key} is a parameter of the template call, not a "
                    "template variable; the server sets it", param=f"chat_template_kwargs.{key}")
        if "chat_template" not in kwargs or inputs.messages is None:
            return None
        template = kwargs["chat_template"]
        if not self.allow_templates:
            raise InvalidRequest(
                "chat_template_kwargs.chat_template would replace the server's chat template; "
                "this server does not accept templates from requests "
                "(server.allow_request_templates=false)",
                param="chat_template_kwargs.chat_template")
        if not isinstance(template, str) or not template:
            raise InvalidRequest("chat_template_kwargs.chat_template must be a non-empty string "
                                 f"(a Jinja chat template), got {template!r:.60}",
                                 param="chat_template_kwargs.chat_template")
        return template

    def template_text(self) -> str:
        """The model's chat template source (all of them, when it has several by name)."""
        hf = getattr(self.tokenizer, "_tokenizer", self.tokenizer)
        template = getattr(hf, "chat_template", None) or ""
        return " ".join(template.values()) if isinstance(template, dict) else str(template)

    def render_text(self, inputs: PromptInput, template: str | None = None, *,
                    add_generation_prompt: bool = True, continue_final_message: bool = False) -> str:
        """The chat as the model's template (or the request's, when allowed) writes it,
        generation prompt included (unless `add_generation_prompt` is False; POST /tokenize
        and /v1/chat/template may ask for either, as vLLM's do)."""
        tok, messages = self.tokenizer, inputs.messages or []
        if template is None and not tok.has_chat_template:
            return "".join(str(m.get("content") or "") + "\n" for m in messages)
        kwargs = self._variables(inputs)
        if template is not None:
            if inputs.continue_final:
                raise InvalidRequest("continue_final_message (an assistant prefill) works with the "
                                     "server's chat template, not one sent in the request",
                                     param="continue_final_message")
            return self._render_sandboxed(template, messages, kwargs, add_generation_prompt)
        if self._thinking_var and "thinking" not in kwargs:   # DeepSeek V3.1's switch
            kwargs["thinking"] = kwargs["enable_thinking"]
        fmt = self.markup.tool_format
        if fmt is not None and fmt.name.startswith("mistral"):
            messages = mistral_ids(messages)
        elif fmt is not None and fmt.name == "kimi_k2":
            messages = kimi_ids(messages)
        # a prefilled assistant turn is left open (continued), else a new turn is opened
        # (POST /tokenize and /v1/chat/template may ask for either, as vLLM's do)
        continued = inputs.continue_final or continue_final_message
        kwargs.update(add_generation_prompt=add_generation_prompt and not continued,
                      continue_final_message=continued)
        return self._render(messages, kwargs)

    def _variables(self, inputs: PromptInput) -> dict[str, Any]:
        """The template's variables: the request's chat_template_kwargs, enable_thinking (the
        request's, else model.enable_thinking, else whether the model thinks), gpt-oss's
        reasoning effort, and the tools unless tool_choice is none."""
        kwargs = {k: v for k, v in inputs.template_kwargs.items() if k != "chat_template"}
        if "enable_thinking" not in kwargs:
            default = self.enable_thinking
            thinks = self.markup.think is not None
            kwargs["enable_thinking"] = thinks if default is None else default
        if self.markup.channels:   # gpt-oss always reasons; its template knows low/medium/high
            effort = kwargs.get("reasoning_effort")
            if effort is None and kwargs["enable_thinking"] is False:
                effort = "low"
            if effort is not None:
                kwargs["reasoning_effort"] = HARMONY_EFFORTS.get(effort, effort)
        if inputs.tools and inputs.tool_choice != "none":
            kwargs["tools"] = inputs.tools
        return kwargs

    def _render(self, messages: list[dict[str, Any]], kwargs: dict[str, Any]) -> str:
        """The model's own template over `messages`; its errors are the request's 400."""
        try:
            try:
                return self.chat.render(messages, **dict(kwargs))
            except TypeError:   # a template that joins arguments as text: give it text
                if not any(m.get("tool_calls") for m in messages):
                    raise
                return self.chat.render(template_messages(messages, as_text=True), **kwargs)
        except TEMPLATE_ERRORS as e:
            raise InvalidRequest(f"the chat template rejected these messages: "
                                 f"{type(e).__name__}: {str(e)[:300]}", param="messages") from e

    def _render_sandboxed(self, template: str, messages: list[dict[str, Any]],
                          kwargs: dict[str, Any], add_generation_prompt: bool = True) -> str:
        special = {k: v for k, v in self.tokenizer.special_tokens_map.items()
                   if isinstance(v, (str, list))}
        context = {**special, **kwargs, "messages": messages,
                   "add_generation_prompt": add_generation_prompt}
        try:
            return template_sandbox.render(template, context, self.template_timeout_s,
                                           self.max_chars)
        except template_sandbox.TemplateRejected as e:
            raise InvalidRequest(f"chat_template_kwargs.chat_template {e}",
                                 param="chat_template_kwargs.chat_template") from e


def template_messages(messages: list[dict[str, Any]], as_text: bool) -> list[dict[str, Any]]:
    """The messages with each tool call's arguments as a mapping (the Hugging Face convention:
    `|tojson`, `.items()`) or, `as_text`, as its JSON text (templates that write
    `name + '<sep>' + arguments`, as DeepSeek's do). Copies; the request's messages stay."""
    if not as_text:
        return messages
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            m = {**m, "tool_calls": [_text_arguments(c) for c in calls]}
        out.append(m)
    return out


def _text_arguments(call: dict[str, Any]) -> dict[str, Any]:
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), dict):
        return call
    return {**call, "function": {**fn, "arguments": json.dumps(fn["arguments"], ensure_ascii=False)}}


def mistral_ids(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mistral templates refuse tool-call ids that are not 9 alphanumerics: other ids (this
    server's call_..., a client's own) become 9 hex digits of their hash, the same in the call
    and in its result. Copies."""
    def nine(call_id: Any) -> Any:
        if not isinstance(call_id, str) or (len(call_id) == 9 and call_id.isalnum()):
            return call_id
        return hashlib.sha1(call_id.encode()).hexdigest()[:9]
    out = []
    for m in messages:
        if m.get("tool_calls"):
            m = {**m, "tool_calls": [{**c, "id": nine(c.get("id"))} for c in m["tool_calls"]]}
        if m.get("role") == "tool" and "tool_call_id" in m:
            m = {**m, "tool_call_id": nine(m["tool_call_id"])}
        out.append(m)
    return out


def kimi_ids(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Kimi-K2 was trained on call ids `functions.NAME:INDEX` (its template writes the id into
    the call): other ids are renamed so, counting calls through the conversation. Copies."""
    out, n = [], 0
    for m in messages:
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                name = (c.get("function") or {}).get("name", "")
                call_id = c.get("id")
                if not (isinstance(call_id, str) and call_id.startswith("functions.")):
                    call_id = f"functions.{name}:{n}"
                calls.append({**c, "id": call_id})
                n += 1
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out
