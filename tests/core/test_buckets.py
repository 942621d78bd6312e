"""Which prompt chunks share one padded forward (pure logic, no model): a group with prefixes
is written after its longest prefix, so it is max(start) + max(chunk) wide, and a row joins
only where that stays within an eighth of the group's longest row."""
from __future__ import annotations

from pipeserve.core.forward import _buckets
from pipeserve.core.plan import PlannedRow
from pipeserve.request import PromptInput, Request, SamplingParams


def row(rid: str, prompt: int, start: int) -> PlannedRow:
    """The chunk that finishes a `prompt`-token prompt from `start` (its last token decodes)."""
    req = Request(request_id=rid, endpoint="test", inputs=PromptInput(token_ids=[1] * prompt),
                  prompt_ids=list(range(1, prompt + 1)), sampling=SamplingParams(max_tokens=4))
    return PlannedRow(req, start, prompt - 1 - start)


def ids(groups: list[list[PlannedRow]]) -> list[list[str]]:
    return sorted(sorted(r.request_id for r in g) for g in groups)


def test_new_prompts_within_twice_each_others_length_share_a_forward() -> None:
    rows = [row("a", 300, 0), row("b", 500, 0), row("c", 590, 0), row("d", 1300, 0)]
    assert ids(_buckets(rows)) == [["a", "b", "c"], ["d"]]


def test_the_rest_of_a_split_prompt_runs_apart_from_new_prompts() -> None:
    # 264 of its 620 tokens came in the step before: beside them, every new row would be
    # padded by 264 (a group 884 wide for rows of 620)
    rows = [row("rest", 620, 264)] + [row(f"new{i}", 620, 0) for i in range(5)]
    assert ids(_buckets(rows)) == [["new0", "new1", "new2", "new3", "new4"], ["rest"]]


def test_hits_on_one_prefix_share_a_forward_whatever_their_chunks() -> None:
    rows = [row("a", 1000 + 40, 1000), row("b", 1000 + 70, 1000), row("c", 1000 + 61, 1000)]
    assert ids(_buckets(rows)) == [["a", "b", "c"]]


def test_rows_with_prefixes_share_only_within_an_eighth_of_the_longest_row() -> None:
    # a: 300 cached + 100 to go; b: 250 + 120 -> 420 wide, longest 400: within 400 + 50
    assert ids(_buckets([row("a", 401, 300), row("b", 371, 250)])) == [["a", "b"]]
    # a beside c (20 cached + 190 to go): 490 wide for a longest row of 400, c padded by 280
    assert ids(_buckets([row("a", 401, 300), row("c", 211, 20)])) == [["a"], ["c"]]
    # a short row far behind a long one still shares: the group is 10 wider than a's own row
    assert ids(_buckets([row("a", 2050, 2000), row("d", 660, 600)])) == [["a", "d"]]
