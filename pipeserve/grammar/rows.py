"""A request's grammar on the engine thread: its matcher advanced over the output applied
since the last step, and the client error when it cannot go on. Apart from constraint.py, whose
Constraint and Matcher request.py names for its fields: the two never import each other."""
from __future__ import annotations

from collections.abc import Iterable

from pipeserve.errors import InvalidRequest
from pipeserve.request import Request


def catch_up(reqs: Iterable[Request]) -> dict[str, BaseException]:
    """The one place matchers advance: each constrained row's matcher accepts the output
    applied since the last step (engine thread, before a step's stages read the masks).
    Returns the rows whose grammar could not go on, with the client error to fail them with."""
    failed: dict[str, BaseException] = {}
    for req in reqs:
        m = req.grammar
        if m is None:
            continue
        try:
            ok = m.advance(req.output_ids)
        except Exception as e:   # this row's grammar: fail it, keep the others
            failed[req.request_id] = e
            continue
        if not ok:
            failed[req.request_id] = grammar_failed(req)
    return failed


def grammar_failed(req: Request) -> InvalidRequest:
    """The row's grammar could not go on (it hit a parser limit, or allows nothing): a
    client error naming the constraint's field, with the grammar library's reason."""
    c, m = req.constraint, req.grammar
    assert m is not None
    param = c.param if c is not None else "grammar"
    lines = [ln.strip() for ln in (m.error or "").splitlines() if ln.strip()]
    reason = lines[0][:300] if lines else "no token is allowed"   # the rest: parser state
    return InvalidRequest(f"{param} could not be followed after {len(req.output_ids)} output "
                          f"tokens: {reason}", param=param, code="constraint_failed")
