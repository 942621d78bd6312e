"""Tokenize: chat template (tools, chat_template_kwargs, thinking on/off) or raw prompt →
token ids, plus the tokenizer's stop ids and the assistant-turn prefix that output parsing
starts from. Called on the event loop, once per request; large inputs render and encode on the
preparation pool (pipeserve.eventloop.offload), a client's own template in the sandbox; never touches MLX."""
from __future__ import annotations

import hashlib
import logging
import json
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from jinja2 import TemplateError

from pipeserve.eventloop import template_sandbox
from pipeserve.config import ServeConfig
from pipeserve.errors import InvalidRequest
from pipeserve.model.loader import LoadedModel
from pipeserve.markup.chat_render import ChatRender
from pipeserve.markup.output import OutputMarkup
from pipeserve.eventloop.offload import INLINE_LIMIT, MediaPool, off_loop
from pipeserve.prompt_cache.protocol import rewinds
from pipeserve.request import PromptInput, Request
from pipeserve.eventloop.token_bound import char_bound
from pipeserve.vision import video
from pipeserve.vision.media import MediaLimits, decode_each
from pipeserve.vision.rows import PromptMedia
from pipeserve.vision.audio import AudioLimits, check_modalities, prepare_audio
from pipeserve.grammar.turn import TurnGrammars

log = logging.getLogger("pipeserve")

# apply_chat_template's own parameters (and `messages`, which the server fills): they change the
# call, not what the template sees, so they are not template variables. (`chat_template`, the
# template itself, is opt-in: see Tokenize._request_template.)
CALL_PARAMS = frozenset({"conversation", "messages", "add_generation_prompt",
                         "continue_final_message", "tokenize", "padding", "truncation",
                         "max_length", "return_tensors", "return_dict",
                         "return_assistant_tokens_mask", "tokenizer_kwargs"})
# gpt-oss's template knows low / medium / high: the other efforts go to the nearest
HARMONY_EFFORTS = {"none": "low", "minimal": "low", "xhigh": "high"}
# up to this many characters a prompt is encoded holding the GIL (a few hundred tokens, well
# under the switch interval); past it the Rust tokenizer runs with the GIL released
HOLD_GIL_CHARS = 2048
TEMPLATE_ERRORS = (TemplateError, TypeError, ValueError, LookupError, AttributeError,
                   ArithmeticError, RecursionError)


class Tokenize:
    """Owns how prompts are rendered. `markup` (built once at load, pipeserve.markup.output) says
    whether the model thinks, where a prompt leaves a think span open, and how a forced tool
    call opens."""

    def __init__(self, cfg: ServeConfig, loaded: LoadedModel, markup: OutputMarkup) -> None:
        self.tokenizer = loaded.tokenizer
        self.vocab_size = int(loaded.config.get("vocab_size")
                              or loaded.config.get("text_config", {}).get("vocab_size")
                              or len(self.tokenizer))
        self.stop_ids = frozenset(self.tokenizer.eos_token_ids)
        self.markup = markup
        self.chat = ChatRender(self.tokenizer)   # the model's template, as apply_chat_template
        self.enable_thinking = cfg.model.enable_thinking
        self.max_context = min(cfg.admission.max_context or loaded.max_context, loaded.max_context)
        self.allow_templates = cfg.server.allow_request_templates
        self.template_timeout_s = cfg.server.request_template_timeout_s
        self.backend = _backend(self.tokenizer)
        self.cache_on = cfg.cache.name != "off"
        # only a model whose cache cannot be cut back to a prefix (recurrent or sliding
        # layers) needs its state kept at a history's end; a pool's parent holds no weights
        # (pipeserve/pool/proxy.py): it marks every chat and the engine's cache_lookup decides
        self.session_checkpoints = (cfg.cache.session_checkpoints and self.cache_on
                                    and (loaded.model is None or not rewinds(loaded.model)))
        self.bound = char_bound(self.backend) if self.backend is not None else None
        self.vision = loaded.vision
        self.model_name = cfg.model.name
        self._told_no_tools = False
        self.media_limits = MediaLimits.of(cfg.media)
        self.video_limits = video.VideoLimits.of(cfg.media)
        self.audio_limits = AudioLimits.of(cfg.media)
        self.media_pool = MediaPool(cfg.media.media_workers, cfg.media.max_media_queue)
        template = getattr(self.tokenizer, "chat_template", None)
        self._thinking_var = isinstance(template, str) and "thinking is defined" in template
        self.turns = TurnGrammars(markup, self.tokenizer,
                                  lambda text: self._encode(text, False, "messages"),
                                  cfg.model.reasoning_budgets, cfg.model.enable_thinking)

    async def __call__(self, request: Request) -> Request:
        inputs = request.inputs
        if inputs.token_ids is not None:
            request.prompt_ids = self._checked_ids(inputs.token_ids)
        else:
            template = self._request_template(inputs)
            if inputs.media:
                check_modalities(inputs.media, self.vision, self.model_name)
                video.refuse_unserved(inputs.media, self.vision, self.model_name)
            if inputs.media:   # on media's own threads: text preparation never waits for it
                await self.media_pool.run(self._prepare, request, template)
            else:
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
            if (inputs.tools and inputs.tool_choice != "none"
                    and "tools" not in (template or self._template_text())):
                request.warnings.append(
                    "tools ignored: this model's chat template does not render tools, so the "
                    "model never sees them; set model.chat_template to a template that does")
                if not self._told_no_tools:   # the log says it once, where an operator looks
                    self._told_no_tools = True
                    log.warning("model %s: request %s sent tools, but the chat template does not "
                                "render tools, so they are ignored (every such response's "
                                "x-pipeserve-warning header says so); set model.chat_template "
                                "to a template that does", self.model_name, request.request_id)
            if request.constraint is not None:   # structured output: the answer starts at once
                inputs.template_kwargs.setdefault("enable_thinking", False)
            text = self.render_text(inputs, template)
            self._check_length(text, "messages")
            opened = self.markup.open_span(text)
            prefill = _prefill(inputs, text)
            request.output_prefix = prefill if len(prefill) > len(opened) else opened
            turn = self.turns.constraint(request, opened, prefill)
            request.constraint = turn or request.constraint
            forced = "" if turn is not None else self._forced_call(inputs, request.output_prefix)
            request.output_prefix = forced or request.output_prefix
            media = None
            if inputs.media:
                text, media = self._images(inputs, text)
            request.prompt_ids = self.encode_rendered(text + forced)
            if media is not None:
                media.check_tokens(request.prompt_ids)
                request.media = media
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

    def _images(self, inputs: PromptInput, text: str) -> tuple[str, PromptMedia]:
        """Decode the request's images (caps, EXIF), videos (sampled frames) and audio clips
        (caps, resampling), expand the template's placeholders."""
        images = [p for p in inputs.media if p.kind == "image"]
        videos = [p for p in inputs.media if p.kind == "video"]
        clips = [p for p in inputs.media if p.kind == "audio"]
        media = PromptMedia(self.vision, {}, [], self.vision.processor.image_token_id)
        used = 0

        def each_image() -> Iterator[Any]:   # one full-size image alive at a time
            nonlocal used
            for decoded in decode_each(images, self.media_limits, started):
                media.digests.append(decoded.digest)
                used += decoded.nbytes
                yield decoded.image
                del decoded
        started = time.monotonic()
        if images:
            prepared = self.vision.processor.prepare(text, each_image(),
                                                     [p.where for p in images])
            text, media.pixels = prepared.text, prepared.pixels
            media.tokens_per_image = prepared.tokens_per_image
        if videos:
            text = video.attach(media, self.vision.processor, text, videos, self.video_limits,
                                used)
            used += sum(len(p.data or b"") for p in videos)
        if clips:
            text = prepare_audio(self.vision.audio, clips, text, media, self.audio_limits,
                                 self.media_limits.max_request_bytes, used)
        return text, media

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

    def _template_text(self) -> str:
        """The model's chat template source (all of them, when it has several by name)."""
        hf = getattr(self.tokenizer, "_tokenizer", self.tokenizer)
        template = getattr(hf, "chat_template", None) or ""
        return " ".join(template.values()) if isinstance(template, dict) else str(template)

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
        history = self.render_text(inputs, template, add_generation_prompt=False)
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
            prefix = self.render_text(head, template, add_generation_prompt=False)
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
        """Through the Rust tokenizer directly when there is one, and a count past the context
        is refused before its ids become Python ints. A text past HOLD_GIL_CHARS goes through
        its batch call, which releases the GIL while it works; a shorter one keeps the GIL:
        giving it up costs the event loop a wait for the engine thread to hand it back, longer
        than the encoding itself."""
        if self.backend is None:
            ids = list(self.tokenizer.encode(text, add_special_tokens=add_special))
            num = len(ids)
        else:
            if len(text) <= HOLD_GIL_CHARS:
                encoding = self.backend.encode(text, add_special_tokens=add_special)
            else:
                encode = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)
                encoding = encode([text], add_special_tokens=add_special)[0]
            num = len(encoding)
        if num > self.max_context:
            raise InvalidRequest(f"prompt has {num} tokens; the context limit is "
                                 f"{self.max_context} — shorten the prompt", param=field,
                                 code="context_length_exceeded")
        return ids if self.backend is None else encoding.ids

    def render_text(self, inputs: PromptInput, template: str | None = None, *,
                    add_generation_prompt: bool = True, continue_final_message: bool = False) -> str:
        """The chat as the model's template (or the request's, when allowed) writes it,
        generation prompt included (unless `add_generation_prompt` is False; POST /tokenize
        and /v1/chat/template may ask for either, as vLLM's do)."""
        tok, messages = self.tokenizer, inputs.messages or []
        if template is None and not tok.has_chat_template:
            return "".join(str(m.get("content") or "") + "\n" for m in messages)
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
        # past this many characters the prompt cannot fit the context (or, with no sound bound,
        # is far past any real prompt): the sandbox stops writing it
        max_chars = self.max_context * (self.bound.max_token_chars * self.bound.shrink
                                        if self.bound is not None else 256)
        try:
            return template_sandbox.render(template, context, self.template_timeout_s, max_chars)
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


def _prefill(inputs: PromptInput, text: str) -> str:
    """A continued assistant turn: the rendered prompt from its text on (the output parsers
    start from it, so a prefilled '<think>' or call markup is continued as such), else ''."""
    if not inputs.continue_final or not inputs.messages:
        return ""
    content = inputs.messages[-1].get("content") or ""
    at = text.rfind(content) if content else -1
    return text[at:] if at >= 0 else ""


def _backend(tokenizer: Any) -> Any:
    """The `tokenizers.Tokenizer` under a fast Hugging Face tokenizer, when it encodes exactly
    as `tokenizer.encode` does (no truncation or padding configured), else None."""
    backend = getattr(getattr(tokenizer, "_tokenizer", tokenizer), "backend_tokenizer", None)
    if backend is None or backend.truncation is not None or backend.padding is not None:
        return None
    return backend
