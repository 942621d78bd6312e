"""SentencePiece vocabularies in GGUF (`tokenizer.ggml.model = llama`): a BPE model trained here
with the `sentencepiece` library is written as llama.cpp's converter writes it (pieces, scores,
token types, add_space_prefix), and the tokenizer the conversion rebuilds encodes every text as
SentencePiece itself does — Llama's space prefix (after each special token too) and Gemma's none,
byte fallback, digits, runs of spaces — and decodes back; the served tokenizer carries the file's
chat template, BOS and end-of-generation set; what cannot be rebuilt is refused by name."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pipeserve.model.gguf import convert as gguf
from pipeserve.model.gguf import tokenizer as gguf_tokenizer
from pipeserve.model.config import ComputeDType, ModelConfig
from pipeserve.errors import ConfigError
from pipeserve.model.loader import load
from pipeserve.model.tiny.text import CHAT_TEMPLATE, CORPUS
from tests.model.test_gguf_archs import gguf_metadata, hf_model, llama_cpp_tensors
from tests.model.test_gguf import save_mlx_gguf

TURNS = ("<start_of_turn>", "<end_of_turn>")
TEXTS = [*CORPUS.splitlines(), " leading space", "two  spaces   three\tand a tab", "1234567",
         "emoji 🙂🚀 and ü, ẞ, ǅ", "\n\nnewlines\n", f"{TURNS[0]}user\nhi{TURNS[1]}\n{TURNS[0]}model"]


def trained(tmp_path: Path, space_prefix: bool) -> Any:
    import sentencepiece as spm
    prefix = str(tmp_path / ("llama" if space_prefix else "gemma"))
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS.splitlines() * 3), model_prefix=prefix, vocab_size=800,
        model_type="bpe", byte_fallback=True, add_dummy_prefix=space_prefix,
        character_coverage=0.995, control_symbols=list(TURNS), bos_id=1, eos_id=2, unk_id=0,
        pad_id=-1, split_digits=True, remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True, normalization_rule_name="identity", minloglevel=2)
    return spm.SentencePieceProcessor(model_file=prefix + ".model")


def spm_metadata(sp: Any, space_prefix: bool) -> dict[str, Any]:
    """convert_hf_to_gguf.py's _create_vocab_sentencepiece: pieces, scores and token types."""
    types = []
    for i in range(sp.get_piece_size()):
        types.append(2 if sp.is_unknown(i) else 3 if sp.is_control(i) else
                     5 if sp.is_unused(i) else 6 if sp.is_byte(i) else 1)
    return {"tokenizer.ggml.model": "llama",
            "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(sp.get_piece_size())],
            "tokenizer.ggml.scores": np.array([sp.get_score(i) for i in range(sp.get_piece_size())],
                                              np.float32),
            "tokenizer.ggml.token_type": np.array(types, np.int32),
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.add_space_prefix": space_prefix,
            "tokenizer.ggml.add_bos_token": True}


def _special_split(sp: Any, text: str) -> list[int]:
    """SentencePiece's ids with control tokens matched whole, as llama.cpp does: each text
    fragment encoded on its own (a prefixed one gets its own space prefix)."""
    ids: list[int] = [1]
    parts = [text]
    for t in TURNS:
        parts = [q for p in parts for q in _keep_split(p, t)]
    for p in parts:
        ids.extend([sp.piece_to_id(p)] if p in TURNS else sp.encode(p))
    return ids


def _keep_split(text: str, sep: str) -> list[str]:
    out: list[str] = []
    for i, chunk in enumerate(text.split(sep)):
        if i:
            out.append(sep)
        if chunk:
            out.append(chunk)
    return out


@pytest.mark.parametrize("arch,space_prefix", [("llama", True), ("gemma3", False)])
def test_sentencepiece_encodes_as_sentencepiece_does(tmp_path: Path, arch: str,
                                                     space_prefix: bool) -> None:
    sp = trained(tmp_path, space_prefix)
    tok = gguf_tokenizer.build(spm_metadata(sp, space_prefix), arch)
    for text in TEXTS:
        want = _special_split(sp, text)
        got = tok.encode(text).ids
        assert got == want, (text, [tok.id_to_token(i) for i in got])
        assert tok.decode(got, skip_special_tokens=True) == sp.decode(want)


def test_served_tokenizer_carries_template_bos_and_end_of_generation(tmp_path: Path) -> None:
    """A gemma3 GGUF with a SentencePiece vocabulary and a chat template, loaded as the server
    loads it: the ids match SentencePiece with BOS first, the template renders from the file,
    and generation ends on <eos> and on the control token <end_of_turn> (llama.cpp's EOG set)."""
    sp = trained(tmp_path, False)
    meta = {**spm_metadata(sp, False), "tokenizer.chat_template": CHAT_TEMPLATE}
    vocab = sp.get_piece_size()
    cfg, hf = hf_model("gemma3", vocab)
    src = save_mlx_gguf(tmp_path / "g.gguf", llama_cpp_tensors("gemma3", hf),
                        {**gguf_metadata("gemma3", cfg), **meta})
    lm = load(ModelConfig(name="g", path=str(src), cache_dir=str(tmp_path / "cache"),
                          compute_dtype=ComputeDType.float32))
    text = TEXTS[-1]
    assert lm.tokenizer.encode(text) == _special_split(sp, text)
    end = sp.piece_to_id(TURNS[1])
    assert set(lm.tokenizer.eos_token_ids) == {2, end}
    assert json.loads((lm.path / "generation_config.json").read_text())["eos_token_id"] == [2, end]
    rendered = lm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                                add_generation_prompt=True, tokenize=False)
    assert "<|im_start|>user\nhi<|im_end|>" in rendered     # the tiny models' ChatML template


def test_byte_level_pre_tokenizers_from_transformers_table() -> None:
    """gpt2 vocabularies with llama.cpp's `qwen2` pre-tokenizer split digits one by one."""
    from tests.model.test_gguf import tokenizer_metadata
    tok = gguf_tokenizer.build({**tokenizer_metadata("qwen2")}, "qwen2")
    assert [tok.id_to_token(i) for i in tok.encode("x 65536").ids][-5:] == list("65536")
    assert "qwen2" in gguf_tokenizer.pre_tokenizers_supported()


def test_sentencepiece_without_scores_is_refused(tmp_path: Path) -> None:
    sp = trained(tmp_path, True)
    meta = spm_metadata(sp, True)
    del meta["tokenizer.ggml.scores"]
    cfg, hf = hf_model("llama", sp.get_piece_size())
    src = save_mlx_gguf(tmp_path / "noscores.gguf", llama_cpp_tensors("llama", hf),
                        {**gguf_metadata("llama", cfg), **meta})
    with pytest.raises(ConfigError, match="has no tokenizer.ggml.scores"):
        gguf.ensure_converted(src, tmp_path / "cache")


def test_glm4_and_deepseek_v3_pre_tokenizers_split_as_llama_cpp() -> None:
    """Pre-tokenizers transformers' table lacks, from llama.cpp's llama-vocab.cpp: GLM-4's is
    llama3's split (and llama.cpp drops its BOS); DeepSeek-V3 applies three splits in turn
    (digits in threes, then CJK runs, then the rest)."""
    from tests.model.test_gguf import tokenizer_metadata
    text = "Hi 12345 日本語!x (a)\n\nb  c"

    def pieces(pre: str) -> list[str]:
        tok = gguf_tokenizer.build({**tokenizer_metadata(pre)}, "x")
        return [p for p, _ in tok.pre_tokenizer.pre_tokenize_str(text)]
    space, cjk = "Ġ", "日本語".encode().decode("latin-1")   # as ByteLevel writes them
    byte = {chr(c): ch for c, ch in zip(range(256), _byte_chars())}
    cjk = "".join(byte[ch] for ch in cjk)
    assert pieces("deepseek-v3") == ["Hi", space, "123", "45", space, cjk, "!x", space + "(",
                                     "a", ")ĊĊ", "b", space, space + "c"]
    assert pieces("glm4") == ["Hi", space, "123", "45", space + cjk, "!x", space + "(", "a",
                              ")ĊĊ", "b", space, space + "c"]
    assert not gguf_tokenizer.add_bos({**tokenizer_metadata("glm4"),
                                       "tokenizer.ggml.add_bos_token": True})
    supported = gguf_tokenizer.pre_tokenizers_supported()
    assert {"glm4", "chatglm-bpe", "deepseek-v3"} <= set(supported) and "kimi-k2" not in supported


def _byte_chars() -> list[str]:
    """GPT-2's byte -> printable character table (ByteLevel's)."""
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    out, n = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return [out[b] for b in range(256)]
