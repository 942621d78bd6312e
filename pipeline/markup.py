"""The model's output markup: its think markers and its tool-call format, inferred once at load
from the tokenizer, the chat template and `model.tool_call_format`. One OutputMarkup is built
with the request stages (pipeline/server.py) and handed to tokenize (open think spans, forced
call prefixes), detokenize (markers that decoding keeps) and the output path (pipeline/api:
the reasoning splitter and the tool-call parser). Pure Python."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipeline.tool_formats import FORMATS, ToolFormat

THINK_PAIRS = (("<think>", "</think>"), ("<longcat_think>", "</longcat_think>"),
               ("<|think:start|>", "<|think:end|>"))
# Every marker an output parser may need to see, whichever family the model is: decoding keeps
# these even where a tokenizer marks them special.
KNOWN_MARKERS = frozenset({m for f in FORMATS.values() for m in f.markers}
                          | {m for pair in THINK_PAIRS for m in pair})


@dataclass(frozen=True)
class ThinkMarkers:
    start: str
    end: str


@dataclass(frozen=True)
class OutputMarkup:
    """`think`: the reasoning span's markers (None: no reasoning split). `tool_format`: how the
    model writes tool calls (None: calls are not parsed). `kept`: markers decoding keeps."""

    think: ThinkMarkers | None = None
    tool_format: ToolFormat | None = None
    kept: frozenset[str] = KNOWN_MARKERS

    @classmethod
    def infer(cls, tokenizer: Any, tool_call_format: str = "auto") -> OutputMarkup:
        """The markup of the model behind `tokenizer`; `tool_call_format` is
        model.tool_call_format (auto | none | a format name)."""
        return cls(think=infer_think(tokenizer),
                   tool_format=resolve_tool_format(tool_call_format, tokenizer))

    def open_span(self, prompt_text: str) -> str:
        """The opened think span when the rendered prompt ends inside one (templates that write
        `<think>` into the generation prompt), else ''. The model then emits only the end marker."""
        if self.think is None:
            return ""
        if not prompt_text.rstrip().endswith(self.think.start):
            return ""
        return prompt_text[prompt_text.rindex(self.think.start):]

    def describe(self) -> str:
        return (f"tool calls {self.tool_format.name if self.tool_format else 'not parsed'}, "
                f"think markers {f'{self.think.start}…{self.think.end}' if self.think else 'none'}")


def infer_think(tokenizer: Any) -> ThinkMarkers | None:
    """The tokenizer's think markers (mlx-lm knows single-token ones), else a pair the chat
    template writes, else None."""
    start, end = getattr(tokenizer, "think_start", None), getattr(tokenizer, "think_end", None)
    if isinstance(start, str) and isinstance(end, str):
        return ThinkMarkers(start, end)
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str):
        for start, end in THINK_PAIRS:
            if start in template and end in template:
                return ThinkMarkers(start, end)
    return None


def infer_tool_format(chat_template: Any, vocab: dict[str, int]) -> str | None:
    """The format a chat template renders tool calls in (mirrors mlx-lm's inference)."""
    text = chat_template if isinstance(chat_template, str) else (
        "\n".join(map(str, chat_template.values())) if isinstance(chat_template, dict) else "")
    if "<tool_call>\n<function=" in text or "<tool_call>\\n<function=" in text:
        return "qwen3_coder"
    if "<|tool_call>" in text and "<tool_call|>" in text:
        return "gemma4"
    if "<start_function_call>" in text:
        return "function_gemma"
    if "<tool_call>" in text:
        return "hermes"
    if "<|python_tag|>" in text:
        return "llama3"
    if "tool_code" in text:
        return "gemma"
    return None


def resolve_tool_format(setting: str, tokenizer: Any) -> ToolFormat | None:
    """`model.tool_call_format` (auto | none | a format name) → the format, or None."""
    if setting == "none":
        return None
    if setting != "auto":
        return FORMATS[setting]
    name = infer_tool_format(getattr(tokenizer, "chat_template", None), tokenizer.get_vocab())
    return FORMATS[name] if name else None
