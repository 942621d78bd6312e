"""Tokenize: chat template (tools, chat_template_kwargs, thinking on/off) or raw prompt →
token ids, plus the tokenizer's stop ids and the assistant-turn prefix that output parsing
starts from. Called on the event loop, once per request; large inputs render and encode on the
preparation pool (pipeline.offload), a client's own template in the sandbox; never touches MLX."""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from jinja2 import TemplateError

from pipeline import template_sandbox
from pipeline.config import ServeConfig
from pipeline.errors import InvalidRequest
from pipeline.loader import LoadedModel
from pipeline.markup import OutputMarkup
from pipeline.offload import INLINE_LIMIT, off_loop
from pipeline.prompt_cache.protocol import rewinds
from pipeline.request import PromptInput, Request
from pipeline.token_bound import char_bound

# apply_chat_template's own parameters (and `messages`, which the server fills): they change the
# call, not what the template sees, so they are not template variables. (`chat_template`, the
# template itself, is opt-in: see Tokenize._request_template.)
CALL_PARAMS = frozenset({"conversation", "messages", "add_generation_prompt",
                         "continue_final_message", "tokenize", "padding", "truncation",
                         "max_length", "return_tensors", "return_dict",
                         "return_assistant_tokens_mask", "tokenizer_kwargs"})
TEMPLATE_ERRORS = (TemplateError, TypeError, ValueError, LookupError, AttributeError,
                   ArithmeticError, RecursionError)


class Tokenize:
    """Owns how prompts are rendered. `markup` (built once at load, pipeline.markup) says
    whether the model thinks, where a prompt leaves a think span open, and how a forced tool
    call opens."""

    def __init__(self, cfg: ServeConfig, loaded: LoadedModel, markup: OutputMarkup) -> None:
        self.tokenizer = loaded.tokenizer
        self.vocab_size = int(loaded.config.get("vocab_size")
                              or loaded.config.get("text_config", {}).get("vocab_size")
                              or len(self.tokenizer))
        self.stop_ids = frozenset(self.tokenizer.eos_token_ids)
        self.markup = markup
        self.enable_thinking = cfg.model.enable_thinking
        self.max_context = min(cfg.admission.max_context or loaded.max_context, loaded.max_context)
        self.allow_templates = cfg.server.allow_request_templates
        self.template_timeout_s = cfg.server.request_template_timeout_s
        self.backend = _backend(self.tokenizer)
        self.cache_on = cfg.cache.name != "off"
        # only a model whose cache cannot be cut back to a prefix (recurrent or sliding
        # layers) needs its state kept at a history's end; a pool's parent holds no weights
        # (pipeline/pool/proxy.py): it marks every chat and the engine's cache_lookup decides
        self.session_checkpoints = (cfg.cache.session_checkpoints and self.cache_on
                                    and (loaded.model is None or not rewinds(loaded.model)))
        self.bound = char_bound(self.backend) if self.backend is not None else None

    async def __call__(self, request: Request) -> Request:
        inputs = request.inputs
        if inputs.token_ids is not None:
            request.prompt_ids = self._checked_ids(inputs.token_ids)
        else:
            template = self._request_template(inputs)
            small = template is None and _small(inputs)
            await off_loop(0 if small else INLINE_LIMIT + 1, self._prepare, request, template)
        if not request.prompt_ids:
            raise InvalidRequest("prompt is empty after tokenization; send at least one token",
                                 param="prompt" if inputs.messages is None else "messages")
        request.stop_token_ids = self.stop_ids
        return request

    def _prepare(self, request: Request, template: str | None) -> None:
        """Render and encode (inline for small inputs, else on the preparation pool)."""
        inputs = request.inputs
        if inputs.messages is not None:
            if request.constraint is not None:   # structured output: the answer starts at once
                inputs.template_kwargs.setdefault("enable_thinking", False)
            text = self.render_text(inputs, template)
            self._check_length(text, "messages")
            request.output_prefix = self.markup.open_span(text)
            forced = self._forced_call(inputs, request.output_prefix)
            request.output_prefix = forced or request.output_prefix
            request.prompt_ids = self.encode_rendered(text + forced)
            if self.session_checkpoints:
                request.checkpoints_at = self._history_end(inputs, template, text,
                                                           request.prompt_ids)
            if inputs.cache_breakpoints and self.cache_on:
                request.pins = self._breakpoints(inputs, template, text, request.prompt_ids)
                request.checkpoints_at = tuple(sorted(
                    set(request.checkpoints_at) | {p for p, _ in request.pins}))
        else:
            assert inputs.text is not None
            self._check_length(inputs.text, "prompt")
            request.prompt_ids = self.encode(inputs.text)

    def _checked_ids(self, token_ids: list[int]) -> list[int]:
        if len(token_ids) > self.max_context:
            raise InvalidRequest(f"prompt has {len(token_ids)} tokens; the context limit is "
                                 f"{self.max_context} — shorten the prompt", param="prompt",
                                 code="context_length_exceeded")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequest(
                f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})",
                param="prompt")
        return list(token_ids)

    def _request_template(self, inputs: PromptInput) -> str | None:
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

    def _check_length(self, text: str, field: str) -> None:
        """Refuse, before tokenizing, a text too long for any tokenization to fit the context."""
        if self.bound is None:
            return
        least = self.bound.min_tokens(text)
        if least > self.max_context:
            size = ("messages render to" if field == "messages" else f"{field} is")
            raise InvalidRequest(
                f"{size} {len(text)} characters; no token of this tokenizer spells more than "
                f"{self.bound.max_token_chars}, so that is at least {least} tokens and the "
                f"context limit is {self.max_context} — shorten the prompt",
                param=field, code="context_length_exceeded")

    def _forced_call(self, inputs: PromptInput, open_think: str) -> str:
        """tool_choice required / named: start the assistant turn with the call's opening
        markup (and the tool's name), so the model writes a call. Not when the prompt left a
        think span open: the model reasons first, and the call is then up to it."""
        if inputs.tool_choice not in ("required", "named") or not inputs.tools:
            return ""
        fmt = self.markup.tool_format
        if fmt is None:
            raise InvalidRequest(
                f"tool_choice {inputs.tool_choice!r} needs a tool-call format, but "
                "model.tool_call_format is none or could not be inferred from the chat "
                "template; set model.tool_call_format", param="tool_choice")
        if open_think:
            return ""
        return fmt.forced(inputs.tool_name if inputs.tool_choice == "named" else None)

    def _history_end(self, inputs: PromptInput, template: str | None, text: str,
                     prompt_ids: list[int]) -> tuple[int, ...]:
        """Where the chat's history ends in `prompt_ids` (the generation prompt follows): the
        next turn renders the same history, then this turn's answer, so its state there is
        what an agent session reuses. () when the template writes no separable suffix."""
        if not self.tokenizer.has_chat_template or len(inputs.messages or []) < 1:
            return ()
        history = self.render_text(inputs, template, generation_prompt=False)
        if not text.startswith(history) or len(history) == len(text):
            return ()
        tail_ids = list(self._encode(text[len(history):], False, "messages"))
        end = len(prompt_ids) - len(tail_ids)
        if end < 1 or prompt_ids[end:] != tail_ids:
            return ()   # the suffix tokenizes differently inside the prompt: no clean boundary
        return (end,)

    def _breakpoints(self, inputs: PromptInput, template: str | None, text: str,
                     prompt_ids: list[int]) -> tuple[tuple[int, float], ...]:
        """Where each cache_control breakpoint (the end of a message) falls in `prompt_ids`:
        the chat up to that message rendered on its own, when it is a prefix of the prompt."""
        out: dict[int, float] = {}
        messages = inputs.messages or []
        for index, ttl_s in inputs.cache_breakpoints:
            head = replace(inputs, messages=messages[:index + 1])
            prefix = self.render_text(head, template, generation_prompt=False)
            if not text.startswith(prefix):
                continue
            ids = list(self._encode(prefix, False, "messages"))
            if 0 < len(ids) < len(prompt_ids) and prompt_ids[:len(ids)] == ids:
                out[len(ids)] = max(out.get(len(ids), 0.0), ttl_s)
        return tuple(sorted(out.items()))

    def encode(self, text: str, field: str = "prompt") -> list[int]:
        bos = self.tokenizer.bos_token
        return self._encode(text, bos is None or not text.startswith(bos), field)

    def encode_rendered(self, text: str) -> list[int]:
        if not self.tokenizer.has_chat_template:
            return self.encode(text, "messages")
        return self._encode(text, False, "messages")

    def _encode(self, text: str, add_special: bool, field: str) -> list[int]:
        """Through the Rust tokenizer directly when there is one: it releases the GIL while it
        works, and a count past the context is refused before its ids become Python ints."""
        if self.backend is None:
            ids = list(self.tokenizer.encode(text, add_special_tokens=add_special))
            num = len(ids)
        else:
            encode = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)
            encoding = encode([text], add_special_tokens=add_special)[0]
            num = len(encoding)
        if num > self.max_context:
            raise InvalidRequest(f"prompt has {num} tokens; the context limit is "
                                 f"{self.max_context} — shorten the prompt", param=field,
                                 code="context_length_exceeded")
        return ids if self.backend is None else encoding.ids

    def render_text(self, inputs: PromptInput, template: str | None = None,
                    generation_prompt: bool = True) -> str:
        """The chat as the model's template (or the request's, when allowed) writes it,
        generation prompt included (unless `generation_prompt` is False)."""
        tok, messages = self.tokenizer, inputs.messages or []
        if template is None and not tok.has_chat_template:
            return "".join(str(m.get("content") or "") + "\n" for m in messages)
        kwargs = {k: v for k, v in inputs.template_kwargs.items() if k != "chat_template"}
        if "enable_thinking" not in kwargs:
            default = self.enable_thinking
            thinks = self.markup.think is not None
            kwargs["enable_thinking"] = thinks if default is None else default
        if inputs.tools and inputs.tool_choice != "none":
            kwargs["tools"] = inputs.tools
        if template is not None:
            return self._render_sandboxed(template, messages, kwargs, generation_prompt)
        try:
            return tok.apply_chat_template(messages, add_generation_prompt=generation_prompt,
                                           tokenize=False, **kwargs)
        except TEMPLATE_ERRORS as e:
            raise InvalidRequest(f"the chat template rejected these messages: "
                                 f"{type(e).__name__}: {str(e)[:300]}", param="messages") from e

    def _render_sandboxed(self, template: str, messages: list[dict[str, Any]],
                          kwargs: dict[str, Any], generation_prompt: bool = True) -> str:
        special = {k: v for k, v in self.tokenizer.special_tokens_map.items()
                   if isinstance(v, (str, list))}
        context = {**special, **kwargs, "messages": messages,
                   "add_generation_prompt": generation_prompt}
        # past this many characters the prompt cannot fit the context (or, with no sound bound,
        # is far past any real prompt): the sandbox stops writing it
        max_chars = self.max_context * (self.bound.max_token_chars * self.bound.shrink
                                        if self.bound is not None else 256)
        try:
            return template_sandbox.render(template, context, self.template_timeout_s, max_chars)
        except template_sandbox.TemplateRejected as e:
            raise InvalidRequest(f"chat_template_kwargs.chat_template {e}",
                                 param="chat_template_kwargs.chat_template") from e


def _small(inputs: PromptInput) -> bool:
    """Whether the prompt text, or the strings a chat template sees, add up to at most
    INLINE_LIMIT characters; looks at a few thousand values at most, so it is cheap on the loop."""
    budget, seen = INLINE_LIMIT, 0
    stack: list[Any] = [inputs.text, inputs.messages, inputs.tools, inputs.template_kwargs]
    while stack:
        value = stack.pop()
        seen += 1
        if seen > 4096:
            return False
        if isinstance(value, str):
            budget -= len(value)
            if budget < 0:
                return False
        elif isinstance(value, dict):
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
    return True


def _backend(tokenizer: Any) -> Any:
    """The `tokenizers.Tokenizer` under a fast Hugging Face tokenizer, when it encodes exactly
    as `tokenizer.encode` does (no truncation or padding configured), else None."""
    backend = getattr(getattr(tokenizer, "_tokenizer", tokenizer), "backend_tokenizer", None)
    if backend is None or backend.truncation is not None or backend.padding is not None:
        return None
    return backend
