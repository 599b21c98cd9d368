"""kuberl's Grafana dashboards as code (grafana-foundation-sdk, Grafana 11 schema).

Three dashboards: the training run (``job`` variable), the sandbox pools (``pool``) and the
rollout fleet (``engine``). Every query uses only metrics of :mod:`kuberl.dashboards.metrics_catalog`
(checked by tests), so the JSON in ``dashboards/generated/`` cannot drift from what the
components export. All panels query the datasource picked by the ``datasource`` variable.

Note on ``job``: the trainer's metrics carry a ``job`` label (the AgenticRLJob name), which
collides with Prometheus' own target label; scrape them with ``honor_labels: true`` (the
chart's ServiceMonitor/PodMonitor do) so the exported value wins.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import prometheus, stat, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import dashboard as dm

DS = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")
RATE = "$__rate_interval"


@dataclass(frozen=True)
class Query:
    """One PromQL target of a panel."""

    expr: str
    legend: str = ""


@dataclass(frozen=True)
class PanelSpec:
    """A panel: title, what it means (shown as the panel description), unit and queries."""

    title: str
    description: str
    queries: tuple[Query, ...]
    unit: str = "short"
    kind: str = "timeseries"  # or "stat"
    min: float | None = None
    max: float | None = None


def _quantiles(pool_sel: str) -> tuple[Query, ...]:
    return tuple(
        Query(
            f"histogram_quantile({q}, sum by (le, outcome) "
            f"(rate(kuberl_tool_call_latency_seconds_bucket{{{pool_sel}}}[{RATE}])))",
            f"p{int(q * 100)} {{{{outcome}}}}",
        )
        for q in (0.5, 0.95, 0.99)
    )


J = 'job=~"$job"'
P = 'pool=~"$pool"'
E = 'engine=~"$engine"'

TRAINING: tuple[PanelSpec, ...] = (
    PanelSpec(
        "Stage and step",
        "Current training step of each stage of the job (SFT, RL stages); the legend names the stage.",
        (Query(f"max by (job, stage) (kuberl_train_step{{{J}}})", "{{job}} {{stage}}"),),
        kind="stat",
    ),
    PanelSpec(
        "Reward (mean)",
        "Mean binary reward (math-verify) over the step's kept rollouts.",
        (Query(f"kuberl_train_reward_mean{{{J}}}", "{{job}}"),),
        unit="percentunit",
        min=0,
        max=1,
    ),
    PanelSpec(
        "Pass rate (5m average)",
        "Fraction of rollouts whose answer verifies, averaged over the last 5 minutes of steps; the "
        "reward is binary, so this is the smoothed reward mean.",
        (Query(f"avg_over_time(kuberl_train_reward_mean{{{J}}}[5m])", "{{job}}"),),
        unit="percentunit",
        min=0,
        max=1,
    ),
    PanelSpec(
        "Response length",
        "Mean response length in tokens (policy and tool-response tokens).",
        (Query(f"kuberl_train_response_length_tokens{{{J}}}", "{{job}}"),),
    ),
    PanelSpec(
        "Response clip ratio",
        "Fraction of rollouts truncated at the stage's maxResponseTokens; rising values mean the "
        "budget is too small for the stage.",
        (Query(f"kuberl_train_response_clip_ratio{{{J}}}", "{{job}}"),),
        unit="percentunit",
        min=0,
    ),
    PanelSpec(
        "PG clip fraction (low / high)",
        "Token-level fraction of policy-gradient terms clipped at 1-eps_low and 1+eps_high (clip-higher).",
        (Query(f"kuberl_train_clip_ratio{{{J}}}", "{{job}} {{side}}"),),
        unit="percentunit",
        min=0,
    ),
    PanelSpec(
        "Tool-error ratio in positive rollouts",
        "Tool errors per tool call inside correct rollouts (rStar2-Agent fig. 4); GRPO-RoC should push it down.",
        (Query(f"kuberl_train_tool_error_ratio_positive{{{J}}}", "{{job}}"),),
        unit="percentunit",
        min=0,
    ),
    PanelSpec(
        "Rollout staleness (asyncLevel)",
        "Rollouts of the last step by how many policy versions behind the trained one they were "
        "sampled (age 0 = fresh; asynchronous runs stay within asyncLevel), and how many rollouts the "
        "run dropped for being older or from a version never pushed (an engine out of step; 0 normally).",
        (
            Query(f"kuberl_train_rollout_staleness{{{J}}}", "{{job}} age {{age}}"),
            Query(f"kuberl_train_rollouts_stale_total{{{J}}}", "{{job}} dropped (run total)"),
        ),
        min=0,
    ),
    PanelSpec(
        "Engine log-prob gap (spot check)",
        "Mean |engine - trainer| log-probability per token of the step's rollouts sampled by the "
        "current policy version, per engine. A correct bf16 vLLM server measures ~0.03 nats/token; an "
        "engine above rollout.spotCheckTolerance (0.15) serves other weights than were pushed to it.",
        (Query(f"kuberl_train_engine_logprob_gap{{{J}}}", "{{job}} {{engine}}"),),
        min=0,
    ),
    PanelSpec(
        "Thinking budgets (lengthReward)",
        "Mean |l_target - l_y| in tokens per target length (and over all), and the fraction of rollouts "
        "within 10 % of their target (INTELLECT-2 section 3.1.2): both fall and rise as the model learns "
        "to keep the budget its prompt names. Empty without spec.algorithm.lengthReward.",
        (
            Query(f"kuberl_train_length_gap_tokens{{{J}}}", "{{job}} |gap| target {{target}}"),
            Query(f"kuberl_train_length_adherence{{{J}}}", "{{job}} adherence target {{target}}"),
            Query(f"kuberl_train_length_penalty_mean{{{J}}}", "{{job}} penalty"),
        ),
        min=0,
    ),
    PanelSpec(
        "Step time",
        "Wall time of the last optimizer step including rollouts, rewards and weight sync.",
        (Query(f"kuberl_train_step_seconds{{{J}}}", "{{job}}"),),
        unit="s",
        min=0,
    ),
)

SANDBOX: tuple[PanelSpec, ...] = (
    PanelSpec(
        "Tool-call latency p50 / p95 / p99 by outcome",
        "Quantiles of submission-to-result time of tool calls, per outcome "
        "(stdout, no_stdout, error, timeout, memory_limit).",
        _quantiles(P),
        unit="s",
        min=0,
    ),
    PanelSpec(
        "Throughput",
        "Tool calls answered per second, per pool.",
        (Query(f"sum by (pool) (rate(kuberl_tool_calls_total{{{P}}}[{RATE}]))", "{{pool}}"),),
        unit="reqps",
        min=0,
    ),
    PanelSpec(
        "Outcome mix",
        "Share of each outcome among answered calls; a growing timeout or error share shows "
        "misbehaving code or too tight limits.",
        (
            Query(
                f"sum by (outcome) (rate(kuberl_tool_calls_total{{{P}}}[{RATE}])) "
                f"/ ignoring (outcome) group_left sum(rate(kuberl_tool_calls_total{{{P}}}[{RATE}]))",
                "{{outcome}}",
            ),
        ),
        unit="percentunit",
        min=0,
        max=1,
    ),
    PanelSpec(
        "Queue depth",
        "Calls waiting for a free worker; the SandboxPool autoscaler targets queue per worker.",
        (Query(f"sum by (pool) (kuberl_sandbox_queue_depth{{{P}}})", "{{pool}}"),),
        min=0,
    ),
    PanelSpec(
        "Busy workers",
        "Workers executing a call right now, summed over the pool's pods.",
        (Query(f"sum by (pool) (kuberl_sandbox_workers_busy{{{P}}})", "{{pool}}"),),
        min=0,
    ),
    PanelSpec(
        "Answer verification",
        "math-verify calls per second by outcome (correct, wrong, timeout, error); timeouts are "
        "answers the verifier had to be killed on.",
        (Query(f"sum by (outcome) (rate(kuberl_sandbox_verify_calls_total{{{P}}}[{RATE}]))", "{{outcome}}"),),
        unit="reqps",
        min=0,
    ),
    PanelSpec(
        "Replicas",
        "What the operator's autoscaler wants for the pool, what is ready, and the pods scraped "
        "(one series per pod); a lasting gap between desired and ready is a pool that cannot schedule.",
        (
            Query(
                'max by (name) (kuberl_autoscaler_desired_replicas{kind="SandboxPool", name=~"$pool"})',
                "desired {{name}}",
            ),
            Query(
                'max by (name) (kuberl_autoscaler_ready_replicas{kind="SandboxPool", name=~"$pool"})',
                "ready {{name}}",
            ),
            Query(f"count by (pool) (kuberl_sandbox_workers_busy{{{P}}})", "scraped {{pool}}"),
        ),
        min=0,
    ),
    PanelSpec(
        "Workers announced by the trainers",
        "Sandbox workers each trainer's coming or current rollout phase asks for (0 between "
        "phases): the autoscaler holds the pool at least that large until the phase is over, so "
        "a step's burst meets ready pods; against them, the workers busy now.",
        (
            Query("kuberl_rollout_phase_workers", "announced {{job}}"),
            Query(f"sum by (pool) (kuberl_sandbox_workers_busy{{{P}}})", "busy {{pool}}"),
        ),
        min=0,
    ),
)

ROLLOUT: tuple[PanelSpec, ...] = (
    PanelSpec(
        "KV-cache utilization per engine",
        "KV-cache tokens reserved by the scheduler (prompt + max response per rollout) / engine capacity.",
        (Query(f"kuberl_rollout_kv_cache_utilization{{{E}}}", "{{engine}}"),),
        unit="percentunit",
        min=0,
        max=1,
    ),
    PanelSpec(
        "In-flight requests",
        "Multi-turn rollouts currently assigned to each engine.",
        (Query(f"kuberl_rollout_requests_inflight{{{E}}}", "{{engine}}"),),
        min=0,
    ),
    PanelSpec(
        "Tokens/s per engine",
        "Tokens each engine generated per second for the rollouts (policy tokens, not prompts or "
        "tool responses); the sum is the fleet's generation rate.",
        (
            Query(
                f"sum by (engine) (rate(kuberl_rollout_generated_tokens_total{{{E}}}[{RATE}]))", "{{engine}}"
            ),
            Query(f"sum(rate(kuberl_rollout_generated_tokens_total{{{E}}}[{RATE}]))", "fleet"),
        ),
        min=0,
    ),
    PanelSpec(
        "Asynchronous pipeline: who waits",
        "Per job with asyncLevel > 0, over its last RL step: the fraction the trainer waited for "
        "rollouts (starved: the fleet autoscaler adds engines) and the fraction no rollout batch was "
        "generating (engines waiting for weights: it removes engines).",
        (
            Query("kuberl_train_rollout_wait_ratio", "{{job}} trainer waits"),
            Query("kuberl_train_engine_idle_ratio", "{{job}} engines idle"),
        ),
        unit="percentunit",
        min=0,
    ),
    PanelSpec(
        "Autoscaler replicas",
        "Per RolloutFleet: the replicas the operator's autoscaler wants (KV-cache use, queued "
        "requests, the trainers' backlog and, for asynchronous runs, who waits in the pipeline) and "
        "those ready; the engines the trainer's scheduler has in rotation, and (asynchronous runs) "
        "those that served its last step, from which the pipeline rule scales.",
        (
            Query(
                'max by (name) (kuberl_autoscaler_desired_replicas{kind="RolloutFleet"})', "desired {{name}}"
            ),
            Query('max by (name) (kuberl_autoscaler_ready_replicas{kind="RolloutFleet"})', "ready {{name}}"),
            Query(f"count(kuberl_rollout_kv_cache_utilization{{{E}}})", "in rotation"),
            Query("max by (fleet) (kuberl_train_engines_in_service)", "serving the last step {{fleet}}"),
        ),
        min=0,
    ),
)


def _datasource_var() -> db.DatasourceVariable:
    return db.DatasourceVariable("datasource").label("Data source").type("prometheus")


def _label_var(name: str, metric: str) -> db.QueryVariable:
    return (
        db.QueryVariable(name)
        .label(name)
        .datasource(DS)
        .query(f"label_values({metric}, {name})")
        .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .multi(True)
        .include_all(True)
        .all_value(".*")
        .current(dm.VariableOption(selected=True, text="All", value="$__all"))
    )


def _panel(spec: PanelSpec):
    builder = stat.Panel() if spec.kind == "stat" else timeseries.Panel()
    builder = builder.title(spec.title).description(spec.description).datasource(DS).unit(spec.unit)
    builder = builder.height(8).span(12 if spec.kind == "timeseries" else 24)
    if spec.min is not None:
        builder = builder.min(spec.min)
    if spec.max is not None:
        builder = builder.max(spec.max)
    for i, q in enumerate(spec.queries):
        target = prometheus.Dataquery().expr(q.expr).legend_format(q.legend).ref_id(chr(ord("A") + i))
        builder = builder.with_target(target)
    return builder


def _dashboard(uid: str, title: str, description: str, var: tuple[str, str], panels: tuple[PanelSpec, ...]):
    d = (
        db.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags(["kuberl"])
        .refresh("10s")
        .time("now-1h", "now")
        .timezone("browser")
        .with_variable(_datasource_var())
        .with_variable(_label_var(*var))
    )
    if uid == "kuberl-training":
        # Run events posted by `kuberl dashboards upload --annotations` (stage changes, checkpoints).
        d = d.annotation(
            db.AnnotationQuery()
            .name("kuberl run events")
            .datasource(dm.DataSourceRef(type_val="grafana", uid="-- Grafana --"))
            .enable(True)
            .icon_color("purple")
            .target(db.AnnotationTarget().type("tags").tags(["kuberl"]).match_any(True).limit(500))
        )
    for spec in panels:
        d = d.with_panel(_panel(spec))
    return d


@dataclass(frozen=True)
class DashboardDef:
    uid: str
    title: str
    description: str
    variable: tuple[str, str]  # (name, metric used for label_values)
    panels: tuple[PanelSpec, ...]

    def build(self) -> dm.Dashboard:
        return _dashboard(self.uid, self.title, self.description, self.variable, self.panels).build()

    def to_json(self) -> str:
        """Deterministic dashboard JSON (what is committed in dashboards/generated/)."""
        return json.dumps(self.build(), cls=JSONEncoder, sort_keys=True, indent=2) + "\n"


DASHBOARDS: dict[str, DashboardDef] = {
    d.uid: d
    for d in (
        DashboardDef(
            "kuberl-training",
            "kuberl / Training run",
            "GRPO-RoC training of one AgenticRLJob: reward, lengths, clipping, tool errors, step time.",
            ("job", "kuberl_train_step"),
            TRAINING,
        ),
        DashboardDef(
            "kuberl-sandbox",
            "kuberl / Sandbox",
            "Python tool execution service: latency by outcome, throughput, queueing, workers, replicas.",
            ("pool", "kuberl_sandbox_workers_busy"),
            SANDBOX,
        ),
        DashboardDef(
            "kuberl-rollout",
            "kuberl / Rollout",
            "Rollout fleet: KV-cache utilization, in-flight rollouts, generation speed, replicas.",
            ("engine", "kuberl_rollout_kv_cache_utilization"),
            ROLLOUT,
        ),
    )
}


def all_expressions() -> list[tuple[str, str, str]]:
    """(dashboard uid, panel title, PromQL expr) for every query of every dashboard."""
    return [(uid, p.title, q.expr) for uid, d in DASHBOARDS.items() for p in d.panels for q in p.queries]
