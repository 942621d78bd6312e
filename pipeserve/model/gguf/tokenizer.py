"""A GGUF's tokenizer metadata -> tokenizer.json, tokenizer_config.json, special_tokens_map.json and
generation_config.json: byte-level BPE (`tokenizer.ggml.model = gpt2`) and Gemma 4's BPE
(`gemma4`: merges over raw UTF-8 with spaces as U+2581, byte fallback) built here, SentencePiece
(`llama`: Llama 2, Mistral, Gemma, Phi-3) through transformers' GGUF tokenizer builder; control
tokens special, user-defined ones whole, BOS as the file says, EOS plus llama.cpp's end-of-generation
tokens. Runs on the engine thread, at conversion."""
from __future__ import annotations

from typing import Any

import numpy as np

from pipeserve.errors import ConfigError

TOKENIZER_MODELS = ("gpt2", "llama", "gemma4")
# gpt-2's split is ByteLevel's own regex; the others are transformers' table of llama.cpp names.
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?"
                r"[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# llama.cpp's own splits for pre-tokenizers transformers' table lacks, applied in sequence as
# llama-vocab.cpp applies them (GLM-4's is llama3's; DeepSeek-V3's three in a row)
DEEPSEEK3_SPLITS = (r"\p{N}{1,3}", r"[一-龥぀-ゟ゠-ヿ]+",
                    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?"""
                    r"""[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
LLAMA_CPP_SPLITS = {"glm4": (LLAMA3_REGEX,), "chatglm-bpe": (LLAMA3_REGEX,),
                    "deepseek-v3": DEEPSEEK3_SPLITS}
NO_BOS_PRE = ("glm4", "chatglm-bpe")   # llama.cpp clears their BOS token
BUILT_IN_PRE = ("smollm", "gpt-2", "default", "llama-bpe", *LLAMA_CPP_SPLITS)
# llama-vocab.cpp: control tokens with these texts end generation even when no *_token_id names them
EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
             "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>")


def _splits() -> dict[str, str]:
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS
    return GGUF_PRE_TOKENIZER_SPLITS


def pre_tokenizers_supported() -> tuple[str, ...]:
    return tuple(dict.fromkeys((*BUILT_IN_PRE, *sorted(_splits()))))


def check(path: Any, meta: dict[str, Any]) -> None:
    """Refuse a tokenizer the conversion cannot rebuild, naming what the file says."""
    model = meta.get("tokenizer.ggml.model")
    if model not in TOKENIZER_MODELS:
        raise ConfigError(f"model.path '{path}': GGUF tokenizer model {model!r} is not supported; "
                          f"supported: gpt2 (byte-level BPE), llama (SentencePiece), gemma4 "
                          "(Gemma 4's BPE)")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if model == "gpt2" and pre not in pre_tokenizers_supported():
        raise ConfigError(f"model.path '{path}': GGUF pre-tokenizer {pre!r} is not supported; "
                          f"supported: {', '.join(pre_tokenizers_supported())}")


def build(meta: dict[str, Any], arch: str) -> Any:
    """The `tokenizers.Tokenizer` the metadata describes."""
    from tokenizers import processors

    if meta["tokenizer.ggml.model"] == "gpt2":
        tok = _byte_level(meta)
    elif meta["tokenizer.ggml.model"] == "gemma4":
        tok = _gemma4(meta)
    else:
        tok = _sentencepiece(meta, arch)
    tokens = meta["tokenizer.ggml.tokens"]
    bos = _token(meta, "bos")
    if bos is not None and add_bos(meta):
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A:0", pair=f"{bos} $A:0 {bos} $B:1",
            special_tokens=[(bos, _int(meta, "tokenizer.ggml.bos_token_id"))])
    elif meta["tokenizer.ggml.model"] == "gpt2":
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    else:
        tok.post_processor = None
    assert tok.get_vocab_size() >= len(tokens)
    return tok


def add_bos(meta: dict[str, Any]) -> bool:
    """llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise."""
    if meta.get("tokenizer.ggml.pre") in NO_BOS_PRE:
        return False
    default = meta["tokenizer.ggml.model"] == "llama"
    return bool(meta.get("tokenizer.ggml.add_bos_token", default))


def _byte_level(meta: dict[str, Any]) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tokens = list(meta["tokenizer.ggml.tokens"])
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    if any(len(m) != 2 for m in merges):
        raise ConfigError("GGUF tokenizer.ggml.merges has an entry that is not two tokens")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre == "smollm":   # digits one by one, then GPT-2's byte-level split
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in ("gpt-2", "default"):
        tok.pre_tokenizer = byte_level
    else:
        regexes = LLAMA_CPP_SPLITS.get(pre) or (LLAMA3_REGEX if pre == "llama-bpe"
                                                 else _splits()[pre],)
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [*(pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False)
               for r in regexes),
             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return _added(tok, meta, tokens)


def _added(tok: Any, meta: dict[str, Any], tokens: list[str]) -> Any:
    """The file's control tokens (type 3) added as special, its user-defined ones (type 4)
    whole; returns `tok`."""
    from tokenizers import AddedToken

    types = _types(meta)
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i in np.nonzero(types == 3)[0]])
    tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                    for i in np.nonzero(types == 4)[0]])
    return tok


def _merges(meta: dict[str, Any]) -> list[tuple[str, str]]:
    """The file's merges, each split at its first space after the first character (a token
    may itself start with one)."""
    out = []
    for m in meta.get("tokenizer.ggml.merges", []):
        at = m.find(" ", 1)
        if at < 0:
            raise ConfigError(f"GGUF tokenizer.ggml.merges entry {m!r} is not two tokens")
        out.append((m[:at], m[at + 1:]))
    return out


def _gemma4(meta: dict[str, Any]) -> Any:
    """Gemma 4's tokenizer as llama.cpp runs a `gemma4` vocabulary: spaces written as U+2581,
    the text split only into runs of newlines and runs of the rest (`[^\\n]+|[\\n]+`), BPE
    merges by rank over each run's characters (no byte-level mapping), a run that is itself a
    token kept whole, bytes with no token as their <0xXX> tokens; control tokens special,
    user-defined ones whole. (llama.cpp keeps only newline runs whole that way; a line that is
    one token but that the merges would not rebuild is the one place the two can differ.)"""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers
    from tokenizers import pre_tokenizers

    tokens = list(meta["tokenizer.ggml.tokens"])
    vocab = {t: i for i, t in enumerate(tokens)}   # a text listed twice: the later id, as llama.cpp
    unk = _token(meta, "unknown")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=_merges(meta), fuse_unk=False,
                               byte_fallback=True, unk_token=unk, ignore_merges=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|[\n]+"), behavior="isolated")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse()])
    return _added(tok, meta, tokens)


def _sentencepiece(meta: dict[str, Any], arch: str) -> Any:
    """transformers' builder: the Llama/Gemma/Phi-3 normalizer, merges recovered from the scores
    (or, for gemma, the file's order), byte fallback, control and user-defined tokens added."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    tokens = list(meta["tokenizer.ggml.tokens"])
    if "tokenizer.ggml.scores" not in meta:
        raise ConfigError("GGUF SentencePiece tokenizer (tokenizer.ggml.model = llama) has no "
                          "tokenizer.ggml.scores to order its merges by")
    spec: dict[str, Any] = {"tokenizer_type": "llama", "tokens": tokens,
                            "scores": [float(s) for s in meta["tokenizer.ggml.scores"]],
                            "token_type": [int(t) for t in _types(meta)]}
    if "tokenizer.ggml.merges" in meta:
        spec["merges"] = list(meta["tokenizer.ggml.merges"])
    for key, name in (("bos", "bos_token_id"), ("eos", "eos_token_id"),
                      ("unknown", "unk_token_id"), ("padding", "pad_token_id")):
        if f"tokenizer.ggml.{key}_token_id" in meta:
            spec[name] = _int(meta, f"tokenizer.ggml.{key}_token_id")
    if "tokenizer.ggml.add_space_prefix" in meta:
        spec["add_prefix_space"] = bool(meta["tokenizer.ggml.add_space_prefix"])
    tok, _ = convert_gguf_tokenizer(arch, spec)
    if not arch.startswith("gemma") and bool(meta.get("tokenizer.ggml.add_space_prefix", True)):
        _space_prefix(tok)
    return tok


def _space_prefix(tok: Any) -> None:
    """llama.cpp's SentencePiece prefix: one space before every text fragment (the text's start
    and after each special token), even one that starts with spaces, where `Metaspace` adds none;
    decoding drops it again."""
    from tokenizers import decoders, normalizers

    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                           normalizers.Replace(" ", "\u2581")])
    tok.pre_tokenizer = None
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])


def _types(meta: dict[str, Any]) -> np.ndarray:
    n = len(meta["tokenizer.ggml.tokens"])
    if "tokenizer.ggml.token_type" not in meta:
        return np.ones(n, np.int32)
    return np.asarray(meta["tokenizer.ggml.token_type"], dtype=np.int32)


def _int(meta: dict[str, Any], key: str) -> int:
    return int(meta[key])


def _token(meta: dict[str, Any], which: str) -> str | None:
    key = f"tokenizer.ggml.{which}_token_id"
    return meta["tokenizer.ggml.tokens"][_int(meta, key)] if key in meta else None


def eos_ids(meta: dict[str, Any]) -> list[int]:
    """EOS, EOT and EOM ids the metadata names, then the control tokens llama.cpp ends on."""
    ids = [_int(meta, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")
           if f"tokenizer.ggml.{k}_token_id" in meta]
    types = _types(meta)
    for i, t in enumerate(meta["tokenizer.ggml.tokens"]):
        if t in EOG_TEXTS and types[i] == 3:
            ids.append(i)
    return list(dict.fromkeys(ids))


def files(meta: dict[str, Any], tok: Any, max_len: int) -> dict[str, dict[str, Any]]:
    names = {w: _token(meta, w) for w in ("bos", "eos", "padding", "unknown")}
    added = {str(i): {"content": t.content, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": t.special}
             for i, t in sorted(tok.get_added_tokens_decoder().items())}
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos(meta), "add_eos_token": False,
        "add_prefix_space": False, "added_tokens_decoder": added,
        "bos_token": names["bos"], "eos_token": names["eos"], "pad_token": names["padding"],
        "unk_token": names["unknown"], "clean_up_tokenization_spaces": False,
        "model_max_length": max_len, "split_special_tokens": False,
    }
    if "tokenizer.chat_template" in meta:
        tok_cfg["chat_template"] = meta["tokenizer.chat_template"]
    special_map = {k: v for k, v in (("bos_token", names["bos"]), ("eos_token", names["eos"]),
                                     ("pad_token", names["padding"]), ("unk_token", names["unknown"]))
                   if v is not None}
    gen: dict[str, Any] = {"eos_token_id": eos_ids(meta)}
    for key, which in (("bos_token_id", "bos"), ("pad_token_id", "padding")):
        if f"tokenizer.ggml.{which}_token_id" in meta:
            gen[key] = _int(meta, f"tokenizer.ggml.{which}_token_id")
    return {"tokenizer_config.json": tok_cfg, "special_tokens_map.json": special_map,
            "generation_config.json": gen}
