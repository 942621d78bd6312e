"""Command-line overrides as users type them, before Hydra parses them: a leading `~` in a
path-valued key (`model.path=~/models/X`) is the home directory, as in a shell, and an override
Hydra's grammar cannot read is one line naming the character and the quoting fix. Main thread,
before Hydra's main; never imports MLX."""
from __future__ import annotations

import os
import re

# keys whose value is a file or directory: model.path, cache.ssd.dir, model.adapter_dir,
# pool.model_dir, kv.config_path, server.api_key_file, pool.models.<id>.path, ...
PATH_LEAF = re.compile(r"^(path|dir|chat_template|\w+_(path|dir|file))$")


def is_path_key(key: str) -> bool:
    return bool(PATH_LEAF.match(key.lstrip("+").rpartition(".")[2]))


def quote(value: str) -> str:
    """A value in Hydra's quoted form: read back as exactly `value` (no sweep on `,`, no
    grammar on `()[]{}=~`); `${...}` interpolations still resolve."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def expand_home(args: list[str]) -> list[str]:
    """Each `key=~...` whose key names a path becomes `key='<home>...'` (a sweep's
    `key=~/a,~/b`, bench.py's -m, each element alike); every other argument is left as it is
    (a `~key` deletion, a flag, a non-path value)."""
    out = []
    for arg in args:
        key, sep, value = arg.partition("=")
        if sep and not key.startswith(("-", "~")) and value.startswith("~") and is_path_key(key):
            arg = f"{key}=" + ",".join(quote(os.path.expanduser(v)) for v in value.split(","))
        out.append(arg)
    return out


def grammar_message(override: str, error: str) -> str:
    """Hydra's parse error (its whole text) for one override as one line: the override, the
    character it stopped at and the fix (quote the value)."""
    key, _, value = override.partition("=")
    char = _offending(error, value)
    detail = error.splitlines()[0]
    what = f"cannot read {char!r} in" if char else "cannot read"
    if value.startswith(("'", '"')):
        return f"{override}: Hydra's override grammar {what} this quoted value ({detail})"
    fix = f'"{key}={quote(value)}"'
    return (f"{override}: Hydra's override grammar {what} an unquoted value; quote the value "
            f"(with the shell's quotes around it): {fix}")


def _offending(detail: str, value: str) -> str | None:
    lines = detail.splitlines()
    if len(lines) > 1 and lines[1].strip() == "^":   # the lexer's caret under the character
        at = lines[1].index("^")
        if at < len(lines[0]):
            return lines[0][at]
    m = re.search(r"(?:token recognition error at|mismatched input|extraneous input)"
                  r":? '(.)", detail)
    if m:
        return m.group(1)
    return next((c for c in value if c in "~()[]{}=,'\"\\<>*?!@#%^&|;`"), None)
