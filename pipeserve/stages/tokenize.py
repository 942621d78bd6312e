"""Tokenize: a request's prompt → token ids, plus the tokenizer's stop ids and the
assistant-turn prefix that output parsing starts from: a chat rendered (pipeserve.markup.chat_prompt)
with its media expanded (pipeserve.vision.placeholders) and encoded within the context
(pipeserve.eventloop.encode), a forced tool call's opening, the turn's grammar, and where the
prompt cache may keep state (the history's end, cache_control breakpoints). Called on the event
loop, once per request; large inputs render and encode on the preparation pool
(pipeserve.eventloop.offload), a client's own template in the sandbox; never touches MLX."""
from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from pipeserve.config import ServeConfig
from pipeserve.errors import InvalidRequest
from pipeserve.eventloop.encode import Encoder
from pipeserve.eventloop.offload import INLINE_LIMIT, MediaPool, off_loop
from pipeserve.grammar.turn import TurnGrammars
from pipeserve.markup.chat_prompt import ChatPrompt
from pipeserve.markup.output import OutputMarkup
from pipeserve.model.loader import LoadedModel
from pipeserve.prompt_cache.protocol import rewinds
from pipeserve.request import PromptInput, Request
from pipeserve.vision.placeholders import MediaPrep

log = logging.getLogger("pipeserve")


class Tokenize:
    """Owns how prompts become token ids. `markup` (built once at load, pipeserve.markup.output)
    says whether the model thinks, where a prompt leaves a think span open, and how a forced
    tool call opens; `prompt` renders chats, `encoder` encodes within the context, `media`
    expands images, videos and audio into the prompt."""

    def __init__(self, cfg: ServeConfig, loaded: LoadedModel, markup: OutputMarkup) -> None:
        self.tokenizer = loaded.tokenizer
        self.vocab_size = int(loaded.config.get("vocab_size")
                              or loaded.config.get("text_config", {}).get("vocab_size")
                              or len(self.tokenizer))
        self.stop_ids = frozenset(self.tokenizer.eos_token_ids)
        self.markup = markup
        self.max_context = min(cfg.admission.max_context or loaded.max_context, loaded.max_context)
        self.encoder = Encoder(self.tokenizer, self.max_context, self.vocab_size)
        self.prompt = ChatPrompt(self.tokenizer, markup, cfg.model.enable_thinking,
                                 cfg.server.allow_request_templates,
                                 cfg.server.request_template_timeout_s, self.encoder.max_chars)
        self.cache_on = cfg.cache.name != "off"
        # only a model whose cache cannot be cut back to a prefix (recurrent or sliding
        # layers) needs its state kept at a history's end; a pool's parent holds no weights
        # (pipeserve/pool/proxy.py): it marks every chat and the engine's cache_lookup decides
        self.session_checkpoints = (cfg.cache.session_checkpoints and self.cache_on
                                    and (loaded.model is None or not rewinds(loaded.model)))
        self.model_name = cfg.model.name
        self._told_no_tools = False
        self.media = MediaPrep.of(cfg.media, loaded.vision, cfg.model.name)
        self.media_pool = MediaPool(cfg.media.media_workers, cfg.media.max_media_queue)
        self.turns = TurnGrammars(markup, self.tokenizer,
                                  lambda text: self.encoder.encode_text(text, False, "messages"),
                                  cfg.model.reasoning_budgets, cfg.model.enable_thinking)

    async def __call__(self, request: Request) -> Request:
        inputs = request.inputs
        if inputs.token_ids is not None:
            request.prompt_ids = self.encoder.checked_ids(inputs.token_ids)
        else:
            template = self.prompt.request_template(inputs)
            if inputs.media:   # on media's own threads: text preparation never waits for it
                self.media.check(inputs.media)
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
        if inputs.messages is None:
            assert inputs.text is not None
            self.encoder.check_length(inputs.text, "prompt")
            request.prompt_ids = self.encoder.encode(inputs.text)
            return
        self._warn_unrendered_tools(request, template)
        if request.constraint is not None:   # structured output: the answer starts at once
            inputs.template_kwargs.setdefault("enable_thinking", False)
        text = self.prompt.render_text(inputs, template)
        self.encoder.check_length(text, "messages")
        opened = self.markup.open_span(text)
        prefill = _prefill(inputs, text)
        request.output_prefix = prefill if len(prefill) > len(opened) else opened
        turn = self.turns.constraint(request, opened, prefill)
        request.constraint = turn or request.constraint
        forced = "" if turn is not None else self._forced_call(inputs, request.output_prefix)
        request.output_prefix = forced or request.output_prefix
        media = None
        if inputs.media:
            text, media = self.media.expand(inputs.media, text)
        request.prompt_ids = self.encoder.encode_rendered(text + forced)
        if media is not None:
            media.check_tokens(request.prompt_ids)
            request.media = media
        self._cache_marks(request, template, text)

    def _warn_unrendered_tools(self, request: Request, template: str | None) -> None:
        """Tools sent to a chat template that does not render them: the response's warning
        says they are ignored (the log says it once, where an operator looks)."""
        inputs = request.inputs
        if (not inputs.tools or inputs.tool_choice == "none"
                or "tools" in (template or self.prompt.template_text())):
            return
        request.warnings.append(
            "tools ignored: this model's chat template does not render tools, so the "
            "model never sees them; set model.chat_template to a template that does")
        if not self._told_no_tools:
            self._told_no_tools = True
            log.warning("model %s: request %s sent tools, but the chat template does not "
                        "render tools, so they are ignored (every such response's "
                        "x-pipeserve-warning header says so); set model.chat_template "
                        "to a template that does", self.model_name, request.request_id)

    def _cache_marks(self, request: Request, template: str | None, text: str) -> None:
        """Where the prompt cache keeps state: the history's end (session checkpoints) and
        each cache_control breakpoint (pinned, with its TTL)."""
        inputs = request.inputs
        if self.session_checkpoints:
            request.checkpoints_at = self._history_end(inputs, template, text, request.prompt_ids)
        if inputs.cache_breakpoints and self.cache_on:
            request.pins = self._breakpoints(inputs, template, text, request.prompt_ids)
            request.checkpoints_at = tuple(sorted(
                set(request.checkpoints_at) | {p for p, _ in request.pins}))

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
        history = self.prompt.render_text(inputs, template, add_generation_prompt=False)
        if not text.startswith(history) or len(history) == len(text):
            return ()
        tail_ids = list(self.encoder.encode_text(text[len(history):], False, "messages"))
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
            prefix = self.prompt.render_text(head, template, add_generation_prompt=False)
            if not text.startswith(prefix):
                continue
            ids = list(self.encoder.encode_text(prefix, False, "messages"))
            if 0 < len(ids) < len(prompt_ids) and prompt_ids[:len(ids)] == ids:
                out[len(ids)] = max(out.get(len(ids), 0.0), ttl_s)
        return tuple(sorted(out.items()))


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
