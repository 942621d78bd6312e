"""OpenAI completions requests: a /v1/completions body → Parsed: `prompt` as one or more
prompts (strings or token ids), best_of, echo, logprobs (the legacy 0-5), suffix and the
sampling fields. Bad input is an InvalidRequest naming the field. Event loop; pure Python."""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from pipeserve.errors import InvalidRequest
from pipeserve.http.api import fields as F
from pipeserve.http.api import structured
from pipeserve.http.api.openai import MAX_CHOICES, Parsed, sampling_fields, stream_flags
from pipeserve.request import PromptInput

MAX_PROMPTS = 2048  # prompts in one completions request (OpenAI's own bound on the array)


def _prompts(body: dict[str, Any]) -> list[PromptInput]:
    """`prompt`: a string, an array of token ids, or an array of either (one prompt each,
    as OpenAI's legacy completions take them)."""
    prompt = body.get("prompt")
    if prompt is None:
        raise InvalidRequest("prompt is required", param="prompt")
    if isinstance(prompt, str):
        items, single = [prompt], True
    elif F.token_ids(prompt):   # one prompt of ids: checked once, here
        return [PromptInput(token_ids=list(prompt))]
    elif isinstance(prompt, list) and prompt:
        items, single = prompt, False
    else:
        raise InvalidRequest("prompt must be a string, an array of token ids, or a non-empty "
                             "array of strings or of token-id arrays", param="prompt")
    if len(items) > MAX_PROMPTS:
        raise InvalidRequest(f"prompt has {len(items)} prompts; the limit is {MAX_PROMPTS}",
                             param="prompt")
    out = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            out.append(PromptInput(text=item))
        elif F.token_ids(item):
            out.append(PromptInput(token_ids=list(item)))
        else:
            where = "prompt" if single else f"prompt[{i}]"
            raise InvalidRequest(f"{where} must be a string or a non-empty array of token ids, "
                                 f"got {F.short(item)}", param="prompt")
    return out



def parse_completion(body: dict[str, Any]) -> Parsed:
    prompts = _prompts(body)
    best_of = F.get(body, "best_of", int, 1)
    if best_of not in (1, F.get(body, "n", int, 1)):
        raise InvalidRequest(f"best_of is {best_of}; only best_of equal to n (or 1) is "
                             "supported: every generated choice is returned", param="best_of")
    requested = sampling_fields(body, max_n=MAX_CHOICES)
    max_tokens = F.get(body, "max_tokens", int, 16)  # OpenAI's default here
    echo = F.get(body, "echo", bool, False)
    if max_tokens == 0 and not echo:
        raise InvalidRequest("max_tokens is 0; that generates nothing, which only makes sense "
                             "with echo: true (to score the prompt); allowed range is [1, "
                             "context]", param="max_tokens")
    logprobs = F.get(body, "logprobs", int)
    if logprobs is not None and not 0 <= logprobs <= 5:
        raise InvalidRequest(f"logprobs is {logprobs}; allowed range is [0, 5]", param="logprobs")
    requested = replace(requested, max_tokens=max_tokens, logprobs=logprobs is not None,
                        top_logprobs=logprobs or 0)
    stream, include, resume = stream_flags(body)
    if stream and len(prompts) > 1:
        raise InvalidRequest(f"prompt has {len(prompts)} prompts; a streamed completion takes "
                             "one (send one request per prompt, or stream: false)",
                             param="prompt")
    if stream and max_tokens == 0:
        raise InvalidRequest("max_tokens 0 (scoring the prompt) needs stream: false",
                             param="max_tokens")
    return Parsed(prompts[0], requested, stream, include, echo=echo,
                  constraint=structured.from_body(body), n=F.get(body, "n", int, 1),
                  prompts=prompts, suffix=F.get(body, "suffix", str), resumable=resume)
