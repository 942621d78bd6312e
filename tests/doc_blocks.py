"""The command blocks of the README and docs/*.md, with the marker each carries.

A command block is a fenced block tagged sh/bash/shell/console or untagged, or an indented
block, in which a line starts with a command a reader would type; or a fenced block of any tag
with `$ command` prompts. Each one carries, on the
line before it (a blank line between), one marker:

    <!-- docs-test: run -->                  tests/serve/test_doc_commands.py runs it against a
    <!-- docs-test: run on pool=example -->  real server of model=tiny (or of these overrides)
    <!-- docs-test: run expect n_over_limit -->   ... and its output must contain that text
    <!-- docs-test: launch -->               each line is started as a server and stopped
    <!-- docs-test: composed -->             each line is a launch that
                                             tests/serve/test_first_contact.py composes
    <!-- docs-test: transcript -->           `$ command` lines, each followed by its output:
                                             each runs, and prints those lines
    <!-- docs-test: not run: <why> -->       a GPU, real weights, the whole suite, ...
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from markdown_it import MarkdownIt

ROOT = Path(__file__).resolve().parent.parent
SHELL_INFO = {"", "sh", "bash", "shell", "console"}
COMMANDS = {"pipeserve", "python", "python3", "pip", "pip3", "curl", "mlx.launch", "lm_eval",
            "prometheus", "promtool", "mkdocs", "bash", "sh", "export", "cat", "jq", "hf",
            "huggingface-cli", "git", "sudo", "apt-get", "uv", "cd", "wget", "docker"}
MARKER = re.compile(r"<!--\s*docs-test:\s*(.*?)\s*-->", re.S)
KIND = re.compile(r"(run)(?: on (?P<on>\S+(?: \S+)*?))?(?: expect (?P<expect>.+))?$"
                  r"|(launch|composed|transcript)$|not run: (?P<why>\S.*)$", re.S)


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    text: str
    marker: str | None   # the marker's text after "docs-test:", None when unmarked

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    def kind(self) -> tuple[str, str, str]:
        """(run|launch|composed|not run, the run's server overrides, the expected text)."""
        m = KIND.match(self.marker or "")
        if not m:
            raise ValueError(f"{self.where}: unknown marker {self.marker!r}")
        if m.group("why"):
            return "not run", "", ""
        return m.group(1) or m.group(4), m.group("on") or "", (m.group("expect") or "").strip()

    def transcript(self) -> list[tuple[str, list[str]]]:
        """(`$ command`, the lines the page shows it printing) for each prompt."""
        out: list[tuple[str, list[str]]] = []
        for line in self.text.splitlines():
            if line.startswith("$ "):
                out.append((line[2:], []))
            elif out and line.strip():
                out[-1][1].append(line.rstrip())
        return out

    def commands(self) -> str:
        """The block as bash reads it: `$ ` prompts dropped, output lines after a prompt left
        out."""
        lines = self.text.splitlines()
        if not any(x.startswith("$ ") for x in lines):
            return self.text
        keep, going = [], False
        for x in lines:
            if x.startswith("$ "):
                keep.append(x[2:])
                going = x.rstrip().endswith("\\")
            elif going:
                keep.append(x)
                going = x.rstrip().endswith("\\")
        return "\n".join(keep) + "\n"


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _unwrap_admonitions(text: str) -> str:
    """MkDocs admonitions (`!!! note` + an indented body) as plain Markdown, same line count."""
    out, inside = [], False
    for line in text.splitlines():
        if re.match(r"(!!!|\?\?\?\+?) ", line):
            out.append("")
            inside = True
        elif inside and (not line.strip() or line.startswith("    ")):
            out.append(line[4:])
        else:
            inside = False
            out.append(line)
    return "\n".join(out) + "\n"


def is_command(text: str) -> bool:
    for line in text.splitlines():
        line = re.sub(r"^\$ ", "", line.strip())
        line = re.sub(r"""^([A-Z_][A-Z0-9_]*=("[^"]*"|'[^']*'|\S*)\s+)+""", "", line)
        if line.split(" ", 1)[0] in COMMANDS or re.match(r"[A-Z_][A-Z0-9_]*=\S", line):
            return True
    return False


def _tokens(page: Path) -> list:
    return MarkdownIt("commonmark").parse(_unwrap_admonitions(page.read_text()))


def code_chunks(page: Path) -> list[str]:
    """Every code block of a page (fenced or indented, any language) and every inline span."""
    text = page.read_text()
    blocks = [t.content for t in _tokens(page) if t.type in ("fence", "code_block")]
    return blocks + re.findall(r"`([^`\n]+)`", text)


def command_blocks() -> list[Block]:
    found = []
    for page in pages():
        tokens = _tokens(page)
        for i, t in enumerate(tokens):
            if t.type not in ("fence", "code_block"):
                continue
            prompted = any(x.startswith("$ ") for x in t.content.splitlines())
            if t.type == "fence" and t.info.strip() not in SHELL_INFO and not prompted:
                continue   # a `text` block of `$ command` and its output counts too
            if not is_command(t.content):
                continue
            before = tokens[i - 1] if i else None
            m = MARKER.search(before.content) if before and before.type == "html_block" else None
            found.append(Block(page.relative_to(ROOT).as_posix(), t.map[0] + 1, t.content,
                               m.group(1) if m else None))
    return found
