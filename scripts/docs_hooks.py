"""MkDocs hook (mkdocs.yml: hooks): a benchmark table whose result file is older than the code
it measures gets a warning on the built page. The check runs at build time, against the
checkout's git history, so the committed page does not change with every commit."""
from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import docs_gen  # noqa: E402

MARK = re.compile(r"<!-- measured-at: ([0-9a-f]{7,40}) -->")


def on_page_markdown(markdown: str, **_: Any) -> str:
    return MARK.sub(lambda m: docs_gen.stale_note(m.group(1)), markdown)
