"""Rebuild schemas.json from OpenAI's published OpenAPI document: the component schemas the
conformance test validates against (tests/serve/test_openapi_conformance.py) and everything
they reference, with documentation-only keywords removed. See README.md for the source.

    git show <commit>:openapi.json > /tmp/openapi.json
    python tests/schemas/openai/extract.py /tmp/openapi.json <commit> <commit date>
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOTS = ["CreateChatCompletionResponse", "CreateChatCompletionStreamResponse",
         "CreateCompletionResponse", "Response", "ResponseStreamEvent", "ErrorResponse",
         "Error", "ListModelsResponse", "OpenAIFile", "ListFilesResponse", "DeleteFileResponse",
         "Batch", "ListBatchesResponse"]
DOC_ONLY = {"description", "title", "example", "examples", "deprecated", "discriminator"}


def _refs(node: Any, out: set[str]) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref":
                out.add(value.rsplit("/", 1)[-1])
            else:
                _refs(value, out)
    elif isinstance(node, list):
        for value in node:
            _refs(value, out)


def _strip(node: Any, in_properties: bool = False) -> Any:
    """Drop annotation keywords (never a property that happens to share their name), and
    turn OpenAPI 3.0's `nullable: true`, which the document still uses in places, into the
    JSON Schema it means (null allowed), so a stock JSON Schema validator reads it right."""
    if isinstance(node, list):
        return [_strip(v) for v in node]
    if not isinstance(node, dict):
        return node
    if in_properties:
        return {k: _strip(v) for k, v in node.items()}
    out = {k: _strip(v, k == "properties") for k, v in node.items()
           if not (k in DOC_ONLY or k.startswith("x-") or k == "nullable")}
    if node.get("nullable") is True:
        out = {"anyOf": [out, {"type": "null"}]}
    return out


def main(source: str, commit: str, date: str) -> None:
    doc = json.loads(Path(source).read_text())
    schemas = doc["components"]["schemas"]
    keep: set[str] = set()
    todo = list(ROOTS)
    while todo:
        name = todo.pop()
        if name not in keep:
            keep.add(name)
            found: set[str] = set()
            _refs(schemas[name], found)
            todo.extend(found - keep)
    out = {"source": f"https://github.com/openai/openai-openapi/blob/{commit}/openapi.json",
           "commit": commit, "date": date, "openapi_version": doc["info"]["version"],
           "roots": ROOTS,
           "components": {"schemas": {k: _strip(schemas[k]) for k in sorted(keep)}}}
    target = Path(__file__).with_name("schemas.json")
    target.write_text(json.dumps(out, indent=None, separators=(",", ":"), sort_keys=True) + "\n")
    print(f"{len(keep)} schemas, {target.stat().st_size} bytes → {target}")


if __name__ == "__main__":
    main(*sys.argv[1:4])
