"""The tokenizer endpoints, in vLLM's shapes: POST /tokenize (a prompt, or chat messages through
the chat template), POST /detokenize (token ids → text), and POST /v1/chat/template (the prompt
a chat request renders to). They route by `model` as generation does and never touch the
engine. Event loop (large inputs render and encode on the preparation pool)."""
from __future__ import annotations

from typing import Any

import sanic
from sanic import HTTPResponse, Sanic

from pipeserve.http.api import fields as F
from pipeserve.http.api import known_fields
from pipeserve.http.api.openai_chat import parse_chat
from pipeserve.http.api.http import json_response, read_body, ready_front, route
from pipeserve.errors import InvalidRequest
from pipeserve.eventloop.offload import off_loop


async def _front(app: Sanic, http: sanic.Request,
                 endpoint: str) -> tuple[dict[str, Any], Any, Any]:
    body = await off_loop(len(http.body or b""), read_body, http)
    known_fields.check(app.ctx, http, endpoint, body)
    ctx = await route(app, body)
    return body, ctx, ready_front(app, ctx)


def _model_name(ctx: Any) -> str:
    return getattr(ctx, "id", None) or ctx.cfg.model.name


def _render(front: Any, body: dict[str, Any]) -> str:
    return _render_chat(front, body)[0]


def _render_chat(front: Any, body: dict[str, Any]) -> tuple[str, Any]:
    """The chat messages of `body` as the chat template writes them (the same rendering, tools
    and chat_template_kwargs included, that /v1/chat/completions runs)."""
    parsed = parse_chat({k: v for k, v in body.items()
                            if k in ("messages", "tools", "tool_choice", "chat_template_kwargs",
                                     "reasoning_effort")})
    add_generation = F.get(body, "add_generation_prompt", bool, True)
    continue_final = F.get(body, "continue_final_message", bool, False)
    if continue_final and add_generation:
        raise InvalidRequest("continue_final_message=true continues the last message, so it "
                             "needs add_generation_prompt=false", param="continue_final_message")
    if continue_final and parsed.inputs.messages[-1]["role"] != "assistant":
        raise InvalidRequest("continue_final_message=true needs the last message to be an "
                             "assistant message", param="continue_final_message")
    tokenize = front.tokenize
    template = tokenize.prompt.request_template(parsed.inputs)
    return tokenize.prompt.render_text(parsed.inputs, template,
                                       add_generation_prompt=add_generation,
                                       continue_final_message=continue_final), parsed.inputs


def _tokenize(front: Any, body: dict[str, Any]) -> tuple[list[int], str]:
    tokenize = front.tokenize
    if "messages" in body:
        if "prompt" in body:
            raise InvalidRequest("send prompt or messages, not both", param="prompt")
        text, inputs = _render_chat(front, body)
        tokenize.encoder.check_length(text, "messages")   # refused by its length, before encoding
        if inputs.media:   # images, video, audio: their tokens, as the chat request counts them
            tokenize.media.check(inputs.media)
            text, media = tokenize.media.expand(inputs.media, text)
            ids = tokenize.encoder.encode_rendered(text)
            media.check_tokens(ids)
            return ids, text
        add_special = F.get(body, "add_special_tokens", bool, False)
        return (tokenize.encoder.encode(text, "messages") if add_special
                else tokenize.encoder.encode_rendered(text)), text
    prompt = F.get(body, "prompt", str)
    if prompt is None:
        raise InvalidRequest("prompt (a string) or messages (chat messages) is required",
                             param="prompt")
    tokenize.encoder.check_length(prompt, "prompt")
    if F.get(body, "add_special_tokens", bool, True):
        return tokenize.encoder.encode(prompt), prompt
    return tokenize.encoder.encode_text(prompt, False, "prompt"), prompt


async def _run(front: Any, http: sanic.Request, body: dict[str, Any]) -> tuple[list[int], str]:
    """`_tokenize` off the loop: on the media threads when the chat carries media."""
    messages = body.get("messages")
    if isinstance(messages, list) and any(
            isinstance(m, dict) and isinstance(m.get("content"), list)
            and any(isinstance(p, dict) and p.get("type") not in ("text", None)
                    for p in m["content"]) for m in messages):
        return await front.tokenize.media_pool.run(_tokenize, front, body)
    return await off_loop(len(http.body or b""), _tokenize, front, body)


async def handle_tokenize(app: Sanic, http: sanic.Request) -> HTTPResponse:
    """{"prompt": str} or {"messages": [...], "add_generation_prompt", "continue_final_message"}
    (+ "add_special_tokens", "return_token_strs") → {"count", "max_model_len", "tokens",
    "token_strs"}. The ids are those a completion (or chat completion) of the same input runs."""
    body, ctx, front = await _front(app, http, "tokenize")
    ids, _ = await _run(front, http, body)
    strs = (await off_loop(len(ids) * 4, _token_strs, front, ids)
            if F.get(body, "return_token_strs", bool, False) else None)
    return json_response({"count": len(ids), "max_model_len": front.tokenize.max_context,
                          "tokens": ids, "token_strs": strs})


def _token_strs(front: Any, ids: list[int]) -> list[str]:
    """Each id's text (off the loop for long prompts: an id not yet cached decodes alone)."""
    return [front.detokenize.token_text(i) for i in ids]


async def handle_detokenize(app: Sanic, http: sanic.Request) -> HTTPResponse:
    """{"tokens": [ids]} → {"prompt": text}; special tokens are kept (as vLLM does), so
    /tokenize then /detokenize round-trips a rendered chat. A list longer than the model's
    context is refused by its length before any id is read."""
    body, ctx, front = await _front(app, http, "detokenize")
    tokens = F.get(body, "tokens", list)
    if tokens is None:
        raise InvalidRequest("tokens (an array of token ids) is required", param="tokens")
    limit = front.tokenize.max_context
    if len(tokens) > limit:
        raise InvalidRequest(
            f"tokens has {len(tokens)} ids; the limit is the context length, {limit} tokens "
            "(admission.max_context, at most the model's): no longer text is read or written",
            param="tokens", code="context_length_exceeded")
    text = await off_loop(len(tokens) * 4, _detokenize, front, tokens)
    return json_response({"prompt": text})


def _detokenize(front: Any, tokens: list[Any]) -> str:
    """The ids checked, then decoded (off the loop for long lists, the check included)."""
    vocab = front.tokenize.vocab_size
    for i, t in enumerate(tokens):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
            raise InvalidRequest(f"tokens[{i}] is {F.short(t)}; token ids are integers in "
                                 f"[0, {vocab})", param="tokens")
    return decode(front.tokenize.tokenizer, front.tokenize.encoder.backend, tokens)


def decode(tokenizer: Any, backend: Any, ids: list[int]) -> str:
    """`tokenizer.decode(ids)`, through the Rust tokenizer's batch decode when that gives the
    same text (no clean-up pass): it releases the GIL, so the event loop runs meanwhile."""
    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    if backend is None or getattr(inner, "clean_up_tokenization_spaces", False):
        return tokenizer.decode(ids)
    return backend.decode_batch([ids], skip_special_tokens=False)[0]


async def handle_chat_template(app: Sanic, http: sanic.Request) -> HTTPResponse:
    """A chat request's body → {"prompt": the rendered text, "num_tokens": its length in
    tokens}, exactly what /v1/chat/completions would feed the model."""
    body, ctx, front = await _front(app, http, "chat_template")
    chat = {"messages": None, **{k: v for k, v in body.items() if k != "prompt"}}
    ids, text = await _run(front, http, chat)
    return json_response({"object": "chat.template", "model": _model_name(ctx),
                          "prompt": text, "num_tokens": len(ids)})


async def handle_tokenizer_info(app: Sanic, http: sanic.Request) -> HTTPResponse:
    """GET /tokenizer_info[?model=id] (vLLM's): the special tokens and the chat template,
    which clients with a remote-tokenizer mode (lm-evaluation-harness) read before /tokenize."""
    ctx = await route(app, {"model": http.args.get("model")})
    front = ready_front(app, ctx)
    tok = front.tokenize.tokenizer
    inner = getattr(tok, "_tokenizer", tok)
    return json_response({
        "tokenizer_class": type(inner).__name__, "model": _model_name(ctx),
        "eos_token": tok.eos_token, "bos_token": tok.bos_token,
        "pad_token": getattr(inner, "pad_token", None), "unk_token": getattr(inner, "unk_token", None),
        "chat_template": getattr(inner, "chat_template", None),
        "model_max_length": front.tokenize.max_context, "vocab_size": front.tokenize.vocab_size})
