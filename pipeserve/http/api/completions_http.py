"""/v1/completions without streaming, as scoring clients (lm-evaluation-harness's
local-completions) drive it: an array of prompts (strings or token arrays; `n` choices each,
choice index = prompt * n + choice), `echo` with the prompt's own logprobs and exact
text_offsets, `max_tokens: 0` with echo (score only, generate nothing), and `suffix` for
fill-in-the-middle models. Event loop; the prompt logprobs come from the engine
(pipeserve/core/scoring.py)."""
from __future__ import annotations

import asyncio
import copy
from dataclasses import dataclass, replace
from typing import Any

from pipeserve.http.api import openai as oa
from pipeserve.http.api.openai_shape import CompletionShape
from pipeserve.http.api.generation import Choices, Generation, Usage
from pipeserve.http.api.http import Scope
from pipeserve.errors import InvalidRequest
from pipeserve.request import PromptInput, Request, TokenLogprob
from pipeserve.core.scoring import score

# fill-in-the-middle markers (prefix, suffix, middle) of the model families that have them;
# a model whose vocabulary holds one set takes `suffix` (prefix-suffix-middle order)
FIM_MARKERS = (("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),      # Qwen coder
               ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),            # StarCoder, SmolLM
               ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"))    # DeepSeek coder


def fim_markers(tokenizer: Any) -> tuple[int, int, int] | None:
    """The ids of the model's fill-in-the-middle markers, or None when it has none."""
    vocab = tokenizer.get_vocab()
    for names in FIM_MARKERS:
        if all(name in vocab for name in names):
            return vocab[names[0]], vocab[names[1]], vocab[names[2]]
    return None


def with_suffix(parsed: oa.Parsed, front: Any) -> None:
    """`suffix`: every prompt becomes <prefix>prompt<suffix>suffix<middle> in token ids, so
    the model writes what goes between; a 400 naming the field for a model without markers."""
    if parsed.suffix is None:
        return
    tokenize = front.tokenize
    markers = fim_markers(tokenize.tokenizer)
    if markers is None:
        names = ", ".join(" ".join(m) for m in FIM_MARKERS)
        raise InvalidRequest("suffix needs a fill-in-the-middle model, and this model's "
                             f"vocabulary has no FIM markers (looked for: {names}); send the "
                             "prompt without suffix", param="suffix")
    if parsed.echo:
        raise InvalidRequest("echo with suffix is not supported: the prompt the model sees is "
                             "rewritten around the suffix", param="echo")
    pre, suf, mid = markers
    tail = tokenize.encoder.encode_text(parsed.suffix, False, "suffix") if parsed.suffix else []
    for inputs in parsed.prompts:
        head = (inputs.token_ids if inputs.token_ids is not None
                else tokenize.encoder.encode_text(inputs.text or "", False, "prompt"))
        inputs.token_ids, inputs.text = [pre, *head, suf, *tail, mid], None
    parsed.inputs = parsed.prompts[0]


@dataclass
class Echo:
    """One prompt as echoed: its text, each token's text and offset in it, and (with
    logprobs) each token's logprob given those before it (None for the first)."""

    text: str
    tokens: list[str]
    offsets: list[int]
    scored: list[TokenLogprob | None] | None = None

    @classmethod
    def of(cls, front: Any, ids: list[int]) -> Echo:
        """Offsets by incremental decoding: token i's text is what decoding it adds after the
        tokens before it, so text[offsets[i]:offsets[i + 1]] is exactly token i's share."""
        stream = front.detokenize.open([])
        pieces = [stream.feed([t]) for t in ids]
        pieces[-1] += stream.finish()
        offsets, at = [], 0
        for piece in pieces:
            offsets.append(at)
            at += len(piece)
        return cls("".join(pieces), [front.token_info(t)[0] for t in ids], offsets)


def _top(shape: CompletionShape, lp: TokenLogprob) -> dict[str, float]:
    top: dict[str, float] = {}
    for i, v in lp.top:   # tokens sharing a text (byte pieces): keep the likeliest
        top.setdefault(shape.token_info(i)[0], v)
    return top


def _logprobs(shape: CompletionShape, index: int, echo: Echo | None,
              generated: list[TokenLogprob] | None) -> dict[str, Any] | None:
    """The legacy logprobs object of one choice: the echoed prompt's entries, then the
    generated tokens' (offsets continue after the prompt's text)."""
    if generated is None and (echo is None or echo.scored is None):
        return None
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                           "text_offset": []}
    if echo is not None and echo.scored is not None:
        out["tokens"] = list(echo.tokens)
        out["token_logprobs"] = [None if s is None else s.logprob for s in echo.scored]
        out["top_logprobs"] = [None if s is None else _top(shape, s) for s in echo.scored]
        out["text_offset"] = list(echo.offsets)
    if generated:
        shape.offsets[index] = len(echo.text) if echo is not None else 0
        more = shape.logprobs(generated, index)
        for key in out:
            out[key] += more[key]
    return out


def _row(parsed: oa.Parsed, rid: str, k: int, choice: int, inputs: PromptInput,
         adapter: str | None) -> Request:
    requested = parsed.requested
    if choice:
        requested = replace(requested, seed=oa.choice_seed(requested.seed, choice))
    if requested.max_tokens == 0:   # score only: admission checks the other fields
        requested = replace(requested, max_tokens=None)
    return Request(request_id=rid if k == 0 else f"{rid}-{k}", endpoint="completions",
                   inputs=copy.deepcopy(inputs) if choice else inputs, requested=requested,
                   constraint=parsed.constraint, adapter=adapter)


async def _run(scope: Scope, reqs: list[Request], wait_first: bool) -> list[Generation]:
    first = scope.submit(reqs[0], parse_output=False)
    if len(reqs) == 1:
        await first.run()
        return [first]
    choices = Choices(first, lambda: [scope.submit(r, parse_output=False) for r in reqs[1:]],
                      wait_first=wait_first)
    try:
        async for _ in choices.deltas():
            pass
    finally:
        choices.close()
    return choices.gens


async def respond(scope: Scope, parsed: oa.Parsed, front: Any, rid: str,
                  adapter: str | None, shape: CompletionShape) -> dict[str, Any]:
    """The text_completion body of every prompt's choices."""
    ctx, n = scope.ctx, parsed.n
    generate = parsed.requested.max_tokens != 0
    want_lps = parsed.requested.logprobs
    if want_lps and parsed.echo and adapter is not None:
        raise InvalidRequest("echo with logprobs scores the base model; drop the adapter",
                             param="echo")
    # every row tokenized and admitted first: a bad prompt fails before any output
    rows: list[list[Request]] = []
    for p, inputs in enumerate(parsed.prompts):
        if generate:
            rows.append([await scope.prepare(_row(parsed, rid, p * n + j, j, inputs, adapter))
                         for j in range(n)])
        else:
            req = await front.tokenize(_row(parsed, rid, p * n, 0, inputs, adapter))
            front.admission.resolve(req)   # the sampling fields' 400s, as for a generation
            scope.request = scope.request or req
            rows.append([req])
    echoes = [Echo.of(front, reqs[0].prompt_ids) if parsed.echo else None for reqs in rows]
    top = parsed.requested.top_logprobs

    async def scored(e: Echo, ids: list[int]) -> None:
        e.scored = await score(ctx.engine, ids, top)

    wait_first = ctx.cfg.cache.name != "off"
    jobs: list[Any] = [scored(e, reqs[0].prompt_ids) for e, reqs in zip(echoes, rows)
                       if e is not None and want_lps]
    runs = [_run(scope, reqs, wait_first) for reqs in rows] if generate else []
    results = await asyncio.gather(*runs, *jobs)
    gens: list[list[Generation]] = list(results[:len(runs)])
    choices, usages = [], []
    for p, reqs in enumerate(rows):
        echo = echoes[p]
        prefix = echo.text if echo is not None else ""
        for j in range(n):
            g = gens[p][j] if generate else None
            lps = (g.all_logprobs if g is not None and want_lps else [] if want_lps else None)
            choices.append({"index": p * n + j,
                            "text": prefix + (g.content if g is not None else ""),
                            "logprobs": _logprobs(shape, p * n + j, echo, lps),
                            "finish_reason": g.finish_reason if g is not None else "length"})
        usages.append(Usage.total([g.usage for g in gens[p]]) if generate
                      else Usage(prompt_tokens=reqs[0].num_prompt_tokens))
    usage = Usage(prompt_tokens=sum(u.prompt_tokens for u in usages),
                  completion_tokens=sum(u.completion_tokens for u in usages),
                  cached_tokens=sum(u.cached_tokens for u in usages), record=usages[0].record,
                  cache_miss=usages[0].cache_miss if len(usages) == 1 else None)
    return shape.body(choices, usage)
