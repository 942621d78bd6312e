"""A generated tool-calling model for the coding-agent tests: the tiny qwen3 (its tokenizer and
chat template) with weights set by hand so that, whatever the prompt, it calls one tool and then
answers once the tool's result is in the conversation:

- no `</tool_response>` in the prompt: `<tool_call>` CALL `</tool_call>` `<|im_end|>`, where CALL
  is one added token holding `\\n{"name": ..., "arguments": ...}\\n` (the hermes call's body);
- a `</tool_response>` anywhere in the prompt: ANSWER `<|im_end|>` (ANSWER: an added token).

Layer 0 has one attention head whose key is set only on `</tool_response>` and whose query is
the same at every position (in RoPE's slowest-turning pair, so distance barely matters): it
attends to that token when the prompt holds one and writes a "seen" feature into the residual
stream. Everything else is a bigram: the output head maps the last token to its successor.
Real MLX weights, loaded by the real loader through `model.path`."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from pipeserve.model.tiny.text import ensure_model

ANSWER = "The tool ran and said what it had to say."
BIAS, MARK, SEEN = 0, 1, 2            # residual dims: constant, `</tool_response>`, seen feature
STATE0 = 3                            # residual dims 3..: one per token of the script
NOISE = slice(10, 64)                 # what every other token's embedding fills


def write_agent_model(out: Path, call: dict, cache: Path) -> Path:
    """A model directory under `out` whose every first turn calls `call` ({"name", "arguments"})."""
    from tokenizers import AddedToken, Tokenizer
    base = ensure_model("qwen3", "tiny", "float32", cache)
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(base, out)
    body = "\n" + json.dumps({"name": call["name"], "arguments": call["arguments"]}) + "\n"
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in (body, ANSWER)])
    tok.save(str(out / "tokenizer.json"))
    vocab = tok.get_vocab()
    tc = json.loads((out / "tokenizer_config.json").read_text())
    for t in (body, ANSWER):
        tc["added_tokens_decoder"][str(vocab[t])] = {
            "content": t, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": False}
    (out / "tokenizer_config.json").write_text(json.dumps(tc))
    config = json.loads((out / "config.json").read_text())
    config.update(vocab_size=tok.get_vocab_size(), tie_word_embeddings=False,
                  max_position_embeddings=131072)
    (out / "config.json").write_text(json.dumps(config))
    last = tok.encode("<|im_start|>assistant\n").ids[-1]
    script = [last, vocab["<tool_call>"], vocab[body], vocab["</tool_call>"], vocab[ANSWER]]
    _write_weights(out, config, script, vocab["</tool_response>"], vocab["<|im_end|>"])
    return out


def _write_weights(out: Path, config: dict, script: list[int], marker: int, eos: int) -> None:
    """Weights named as the base's, valued as the module docstring says."""
    import mlx.core as mx
    names = mx.load(str(out / "model.safetensors"))
    v, h = config["vocab_size"], config["hidden_size"]
    hd = config["head_dim"]
    rng = np.random.default_rng(7)
    embed = np.zeros((v, h), np.float32)
    embed[:, BIAS] = 1.0
    embed[:, NOISE] = rng.standard_normal((v, NOISE.stop - NOISE.start)) * 0.3
    embed[marker, MARK] = 1.0
    for i, t in enumerate(script):
        embed[t, NOISE] = 0.0
        embed[t, STATE0 + i] = 1.0
    weights = {name: np.zeros(a.shape, np.float32) for name, a in names.items()}
    for name in weights:
        if name.endswith("norm.weight"):
            weights[name][:] = 1.0
    weights["model.embed_tokens.weight"] = embed
    slow = hd // 2 - 1                       # RoPE's slowest-turning pair: (slow, slow + hd/2)
    attn = "model.layers.0.self_attn."
    weights[attn + "q_proj.weight"][slow, BIAS] = 1.0      # head 0's query: every position
    weights[attn + "k_proj.weight"][slow, MARK] = 1.0      # kv head 0's key: the marker only
    weights[attn + "q_norm.weight"][slow] = 4.0
    weights[attn + "k_norm.weight"][slow] = 4.0
    weights[attn + "v_proj.weight"][0, MARK] = 1.0
    weights[attn + "o_proj.weight"][SEEN, 0] = 1.0
    weights["lm_head.weight"] = _head(v, h, script, eos, rng)
    mx.save_safetensors(str(out / "model.safetensors"),
                        {k: mx.array(a) for k, a in weights.items()}, metadata={"format": "mlx"})


def _head(v: int, h: int, script: list[int], eos: int, rng: np.random.Generator) -> np.ndarray:
    """The bigram: after the generation prompt, `<tool_call>` unless SEEN (then ANSWER); after
    `<tool_call>` the call's body, then `</tool_call>`, then `<|im_end|>`; after ANSWER, the end."""
    last, call_open, body, call_close, answer = script
    head = np.zeros((v, h), np.float32)
    head[:, NOISE] = rng.standard_normal((v, NOISE.stop - NOISE.start)) * 0.3
    strong, lean, seen = 20.0, 4.0, 2.0
    state = {t: STATE0 + i for i, t in enumerate(script)}
    head[call_open, state[last]] = strong
    head[call_open, SEEN] = -seen
    head[answer, state[last]] = strong - lean
    head[answer, SEEN] = seen
    head[body, state[call_open]] = strong
    head[call_close, state[body]] = strong
    head[eos, state[call_close]] = strong
    head[eos, state[answer]] = strong
    return head
