"""Build dashboards/pipeserve.json, the Grafana dashboard of pipeserve, from typed code
(grafana-foundation-sdk, pinned in pyproject's `test` extra so the output is stable).

    python dashboards/build.py            # write dashboards/pipeserve.json
    python dashboards/build.py --check    # exit 1 when the committed JSON is stale

Every query uses only names from pipeserve/metrics.py (tests/serve/test_monitoring.py checks
them against a live /metrics and runs each one through a real Prometheus)."""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from grafana_foundation_sdk.builders import prometheus, stat, table, timeseries
from grafana_foundation_sdk.builders.common import VizLegendOptions
from grafana_foundation_sdk.builders.dashboard import (Dashboard, DatasourceVariable,
                                                       QueryVariable, Row)
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import LegendDisplayMode, LegendPlacement
from grafana_foundation_sdk.models.dashboard import DataSourceRef, VariableRefresh
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

OUT = Path(__file__).resolve().parent / "pipeserve.json"
UID = "pipeserve"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
RATE = "$__rate_interval"   # Grafana's window for rate(): at least 4 scrape intervals
# a pool (pool=<name>) labels every family with its `model`; one model's series have none,
# which `.*` (All) matches
SEL = 'instance=~"$instance", model=~"$model"'
ERRORS, REJECTED, ACTIVE = 'outcome="error"', 'outcome="rejected"', 'kind="active"'


class Kind(Enum):
    timeseries = "timeseries"
    stat = "stat"
    table = "table"


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str = ""


@dataclass(frozen=True)
class PanelSpec:
    title: str
    queries: list[Query]
    unit: str = "short"
    kind: Kind = Kind.timeseries
    width: int = 8           # of 24 grid columns
    description: str = ""


@dataclass(frozen=True)
class RowSpec:
    title: str
    panels: list[PanelSpec] = field(default_factory=list)


def m(name: str, labels: str = "") -> str:
    """A selector of one series name, filtered by the `instance` and `model` variables."""
    return f"{name}{{{SEL}{', ' + labels if labels else ''}}}"


def rate(name: str, labels: str = "") -> str:
    return f"rate({m(name, labels)}[{RATE}])"


def quantiles(histogram: str, by: str = "le") -> list[Query]:
    return [Query(f"histogram_quantile({q}, sum by ({by}) ({rate(histogram + '_bucket')}))",
                  f"p{int(q * 100)}" + (" {{" + by.split(", ")[1] + "}}" if ", " in by else ""))
            for q in (0.5, 0.95, 0.99)]


def ratio(num: str, den: str) -> str:
    """num / den, 0 (not NaN) while the denominator is 0."""
    return f"({num}) / clamp_min({den}, 1e-9)"


ROWS: list[RowSpec] = [
    RowSpec("Traffic & errors", [
        PanelSpec("Requests /s by endpoint",
                  [Query(f"sum by (endpoint) ({rate('pipeserve_requests_total')})", "{{endpoint}}")],
                  "reqps"),
        PanelSpec("Requests /s by outcome",
                  [Query(f"sum by (outcome) ({rate('pipeserve_requests_total')})", "{{outcome}}")],
                  "reqps", description="ok, invalid (400/404), rejected (429), cancelled "
                                       "(client left), error (5xx)"),
        PanelSpec("Error and 429 ratio", [
            Query(ratio(f"sum({rate('pipeserve_requests_total', ERRORS)})",
                        f"sum({rate('pipeserve_requests_total')})"), "errors (5xx)"),
            Query(ratio(f"sum({rate('pipeserve_requests_total', REJECTED)})",
                        f"sum({rate('pipeserve_requests_total')})"), "rejected (429)")],
            "percentunit"),
        PanelSpec("Tokens /s", [
            Query(f"sum({rate('pipeserve_prompt_tokens_total')})", "prompt"),
            Query(f"sum({rate('pipeserve_cached_prompt_tokens_total')})", "prompt, from cache"),
            Query(f"sum({rate('pipeserve_generation_tokens_total')})", "generated")],
            "short", width=12),
        PanelSpec("Engine up", [Query(m("pipeserve_engine_up"), "{{instance}}")], "bool",
                  Kind.stat, width=4),
        PanelSpec("Build", [Query(m("pipeserve_build_info"))], kind=Kind.table, width=8,
                  description="version, MLX version, device, model, fingerprint, config hash"),
    ]),
    RowSpec("Latency", [
        PanelSpec("Time to first token", quantiles("pipeserve_time_to_first_token_seconds"), "s"),
        PanelSpec("Inter-token latency", quantiles("pipeserve_inter_token_latency_seconds"), "s"),
        PanelSpec("End-to-end latency", quantiles("pipeserve_e2e_request_latency_seconds"), "s"),
        PanelSpec("Step stage time p95 by stage", [Query(
            f"histogram_quantile(0.95, sum by (le, stage) ({rate('pipeserve_stage_seconds_bucket')}))",
            "{{stage}}")], "s", width=24),
        PanelSpec("Collector pauses, seconds a second by generation", [Query(
            f"sum by (generation) ({rate('pipeserve_gc_pause_seconds_sum')})",
            "gen {{generation}}")], "s"),
    ]),
    RowSpec("Batching & queue", [
        PanelSpec("Batch size (rows per step)", [
            Query(ratio(f"sum({rate('pipeserve_batch_size_sum')})",
                        f"sum({rate('pipeserve_batch_size_count')})"), "mean"),
            Query(f"histogram_quantile(0.95, sum by (le) ({rate('pipeserve_batch_size_bucket')}))",
                  "p95")]),
        PanelSpec("Active rows and queue", [
            Query(f"sum({m('pipeserve_active_rows')})", "active rows"),
            Query(f"sum({m('pipeserve_queue_depth')})", "queued"),
            Query(f"sum({m('pipeserve_queue_capacity')})", "queue capacity (429 beyond)")]),
        PanelSpec("Prefill vs decode tokens /s",
                  [Query(f"sum by (phase) ({rate('pipeserve_step_tokens_total')})", "{{phase}}"),
                   Query(f"sum({rate('pipeserve_prefill_grouped_prompts_total')})",
                         "prompts prefilled in a group")]),
    ]),
    RowSpec("Prompt cache", [
        PanelSpec("Hit ratio by tier", [
            Query(f"sum by (cache_tier) ({rate('pipeserve_prompt_cache_hits_total')}) "
                  f"/ ignoring(cache_tier) group_left() "
                  f"(sum({rate('pipeserve_prompt_cache_hits_total')}) "
                  f"+ sum({rate('pipeserve_prompt_cache_misses_total')}))", "{{cache_tier}}"),
            Query(ratio(f"sum({rate('pipeserve_cached_prompt_tokens_total')})",
                        f"sum({rate('pipeserve_prompt_tokens_total')})"), "prompt tokens cached")],
            "percentunit", description="lookups served by each tier over all lookups; and the "
                                       "share of prompt tokens that came from the cache"),
        PanelSpec("Misses /s by reason", [Query(
            f"sum by (reason) ({rate('pipeserve_prompt_cache_misses_total')})", "{{reason}}")]),
        PanelSpec("Reused tokens /s by tier", [Query(
            f"sum by (cache_tier) ({rate('pipeserve_prompt_cache_hit_tokens_total')})",
            "{{cache_tier}}")]),
        PanelSpec("Bytes by tier", [Query(
            f"sum by (cache_tier) ({m('pipeserve_prompt_cache_bytes')})", "{{cache_tier}}")],
            "bytes"),
        PanelSpec("Entries by tier", [Query(
            f"sum by (cache_tier) ({m('pipeserve_prompt_cache_entries')})", "{{cache_tier}}")]),
        PanelSpec("SSD tier /s", [
            Query(f"sum by (reason) ({rate('pipeserve_prompt_cache_spills_total')})",
                  "spills ({{reason}})"),
            Query(f"sum({rate('pipeserve_prompt_cache_restores_total')})", "restores"),
            Query(f"sum({rate('pipeserve_prompt_cache_ssd_writes_total')})", "SSD writes"),
            Query(f"sum by (cache_tier) ({rate('pipeserve_prompt_cache_evictions_total')})",
                  "evictions ({{cache_tier}})")]),
        PanelSpec("Dirty and corrupt entries", [
            Query(f"sum({m('pipeserve_prompt_cache_dirty_entries')})", "dirty (not yet on SSD)"),
            Query(f"sum(increase({m('pipeserve_prompt_cache_corrupt_entries_total')}[$__range]))",
                  "corrupt (in range)")], width=16),
    ]),
    RowSpec("Admission", [
        PanelSpec("Context: max safe vs cap", [
            Query(f"max({m('pipeserve_admission_max_safe_context_tokens')})", "max safe context"),
            Query(f"max({m('pipeserve_admission_context_cap_tokens')})",
                  "cap enforced (admission=budget)")],
            description="estimate: weights + KV per token + prefill temporaries"),
        PanelSpec("KV reserved vs budget", [
            Query(f"sum({m('pipeserve_kv_reserved_bytes')})", "reserved"),
            Query(f"sum({m('pipeserve_kv_budget_bytes')})", "budget (admission.kv_budget_gb)")],
            "bytes"),
        PanelSpec("Decisions /s by reason", [Query(
            f"sum by (decision, reason) ({rate('pipeserve_admission_decisions_total')})",
            "{{decision}} {{reason}}")]),
    ]),
    RowSpec("Speculation", [
        PanelSpec("Acceptance ratio by proposer", [Query(
            f"sum by (proposer) ({rate('pipeserve_speculation_accepted_tokens_total')}) "
            f"/ sum by (proposer) ({rate('pipeserve_speculation_proposed_tokens_total')})",
            "{{proposer}}")], "percentunit"),
        PanelSpec("Tokens per verify by proposer", [Query(
            f"(sum by (proposer) ({rate('pipeserve_speculation_accepted_tokens_total')}) "
            f"+ sum by (proposer) ({rate('pipeserve_speculation_verifies_total')})) "
            f"/ sum by (proposer) ({rate('pipeserve_speculation_verifies_total')})",
            "{{proposer}}")], description="accepted draft tokens + the target's own token, "
                                          "per row verification"),
        PanelSpec("Draft tokens /s", [
            Query(f"sum by (proposer) ({rate('pipeserve_speculation_proposed_tokens_total')})",
                  "proposed {{proposer}}"),
            Query(f"sum by (proposer) ({rate('pipeserve_speculation_accepted_tokens_total')})",
                  "accepted {{proposer}}")]),
    ]),
    RowSpec("KV layout", [
        PanelSpec("KV held by running rows", [
            Query(f"sum by (layout) ({m('pipeserve_kv_bytes')})", "{{layout}}")], "bytes",
            description="sampled every 16 engine steps and when idle"),
        PanelSpec("Paged pool blocks", [
            Query(f"sum by (state) ({m('pipeserve_kv_pool_blocks')})", "{{state}}")],
            description="kv=paged, summed over layers; shared = held by several rows or "
                        "cache entries"),
        PanelSpec("Conversions /s and bytes per token", [
            Query(f"sum({rate('pipeserve_kv_conversions_total')})", "rows converted /s"),
            Query(f"max({m('pipeserve_kv_bytes_per_token')})", "KV bytes per token")],
            description="kv.quantized_start conversions; bytes per token of the served layout"),
    ]),
    RowSpec("Distributed ranks", [
        PanelSpec("Step time by rank", quantiles('pipeserve_distributed_step_seconds',
                                                 "le, rank"), "s",
                  description="distributed≠none: one engine pass of each rank between two plan "
                              "syncs (its shard's forward and host work), exported by rank 0"),
        PanelSpec("Sync (collective) time by rank", quantiles(
            'pipeserve_distributed_sync_seconds', "le, rank"), "s",
            description="time each rank spent in the plan sync's all_sum, waiting for the "
                        "slowest rank included: a rank far above the others is the fast one"),
        PanelSpec("Ranks", [Query(f"max({m('pipeserve_distributed_ranks')})", "ranks")],
                  kind=Kind.stat, description="1 when distributed=none"),
    ]),
    RowSpec("MLX memory", [
        PanelSpec("MLX memory", [
            Query(f"sum by (kind) ({m('pipeserve_mlx_memory_bytes')})", "{{kind}}"),
            Query(f"sum({m('pipeserve_model_weight_bytes')})", "weights"),
            Query(f"sum({m('pipeserve_admission_memory_budget_bytes')})",
                  "budget (admission.memory_budget_gb)")], "bytes", width=16),
        PanelSpec("Active memory / budget", [Query(ratio(
            f"max({m('pipeserve_mlx_memory_bytes', ACTIVE)})",
            f"max({m('pipeserve_admission_memory_budget_bytes')})"))],
            "percentunit", Kind.stat, description="empty unless admission.memory_budget_gb is set"),
    ]),
]


def _panel(spec: PanelSpec, panel_id: int) -> timeseries.Panel | stat.Panel | table.Panel:
    if spec.kind is Kind.table:
        panel: timeseries.Panel | stat.Panel | table.Panel = table.Panel()
    elif spec.kind is Kind.stat:
        panel = stat.Panel()
    else:
        panel = timeseries.Panel().legend(
            VizLegendOptions().display_mode(LegendDisplayMode.LIST)
            .placement(LegendPlacement.BOTTOM).show_legend(True))
    panel = panel.id(panel_id).title(spec.title).datasource(DATASOURCE).unit(spec.unit) \
        .span(spec.width).height(8)
    if spec.description:
        panel = panel.description(spec.description)
    for i, q in enumerate(spec.queries):
        query = prometheus.Dataquery().expr(q.expr).ref_id(chr(ord("A") + i)).datasource(DATASOURCE)
        if q.legend:
            query = query.legend_format(q.legend)
        if spec.kind is Kind.table:
            query = query.instant().format(PromQueryFormat.TABLE)
        panel = panel.with_target(query)
    return panel


def dashboard() -> Dashboard:
    d = (Dashboard("pipeserve").uid(UID).tags(["pipeserve", "llm"]).refresh("10s")
         .time("now-1h", "now").timezone("browser")
         .description("pipeserve: traffic, latency, batching, prompt cache, admission, "
                      "speculation and MLX memory (metrics: pipeserve/metrics.py)")
         .with_variable(DatasourceVariable("datasource").label("Data source").type("prometheus"))
         .with_variable(QueryVariable("instance").label("Instance").datasource(DATASOURCE)
                        .query("label_values(pipeserve_build_info, instance)")
                        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
                        .multi(True).include_all(True).all_value(".*"))
         .with_variable(QueryVariable("model").label("Model").datasource(DATASOURCE)
                        .query("label_values(pipeserve_requests_total, model)")
                        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
                        .multi(True).include_all(True).all_value(".*")))
    panel_id = 0
    for row in ROWS:
        panel_id += 1
        d = d.with_row(Row(row.title).id(panel_id))
        for spec in row.panels:
            panel_id += 1
            d = d.with_panel(_panel(spec, panel_id))
    return d


def render() -> str:
    return JSONEncoder(sort_keys=True, indent=2).encode(dashboard().build()) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is stale; run: python dashboards/build.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
