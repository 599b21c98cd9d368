"""Pods and their metrics, for status and autoscaling: which pods are ready, their /metrics
pages, and a trainer's progress read from its kuberl_train_* series (DESIGN.md)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kuberl.operator.render.render_common import APP_NAME, LABEL_COMPONENT, LABEL_NAME
from kuberl.operator.runtime.kube import KubeClient, kind_of

log = logging.getLogger("kuberl.operator")


async def http_scrape(url: str, timeout: float = 2.0) -> str:
    """GET a /metrics page (the default scraper)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as s, s.get(url) as rsp:
        rsp.raise_for_status()
        return await rsp.text()


async def ready_pods(client: KubeClient, namespace: str, labels: dict[str, str]) -> list[dict[str, Any]]:
    pods = await client.list(kind_of("v1", "Pod"), namespace, labels)
    out = []
    for pod in pods:
        st = pod.get("status") or {}
        ready = any(
            c.get("type") == "Ready" and c.get("status") == "True" for c in st.get("conditions") or []
        )
        if (
            st.get("phase") == "Running"
            and ready
            and st.get("podIP")
            and not pod["metadata"].get("deletionTimestamp")
        ):
            out.append(pod)
    return out


async def trainer_pods_using(client: KubeClient, namespace: str, variable: str, name: str) -> list[dict[str, Any]]:
    """The ready kuberl trainer pods whose ``variable`` names ``name``: ``KUBERL_ROLLOUT_FLEET``
    for a RolloutFleet (their schedulers hold the rollouts the engines cannot see yet),
    ``KUBERL_SANDBOX_POOL`` for a SandboxPool (they announce their rollout phases)."""
    labels = {LABEL_NAME: APP_NAME, LABEL_COMPONENT: "trainer"}
    return [
        pod
        for pod in await ready_pods(client, namespace, labels)
        if any(
            e.get("name") == variable and e.get("value") == name
            for c in pod.get("spec", {}).get("containers") or []
            for e in c.get("env") or []
        )
    ]


def pod_port(pod: dict[str, Any], names: tuple[str, ...] = ("metrics", "http")) -> int | None:
    for c in pod.get("spec", {}).get("containers") or []:
        for p in c.get("ports") or []:
            if p.get("name") in names:
                return int(p["containerPort"])
    return None


async def scrape_pods(
    scrape: Callable[[str], Awaitable[str]], pods: list[dict[str, Any]], names: tuple[str, ...]
) -> list[str]:
    """The /metrics pages of ``pods`` on their named port (pods that fail are left out)."""

    async def one(pod: dict[str, Any]) -> str | None:
        port = pod_port(pod, names)
        if port is None:
            return None
        try:
            return await scrape(f"http://{pod['status']['podIP']}:{port}/metrics")
        except (aiohttp.ClientError, TimeoutError, OSError) as err:
            log.debug("scrape of %s failed: %s", pod["metadata"]["name"], err)
            return None

    results = await asyncio.gather(*(one(p) for p in pods))
    return [r for r in results if r is not None]


def engine_gaps(text: str, job: str) -> dict[str, float]:
    """The trainer's spot check per engine (``kuberl_train_engine_logprob_gap{engine}``, mean
    |engine - trainer| nats/token at its last check) from its /metrics page."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "kuberl_train_engine_logprob_gap" and s.labels.get("job", job) == job:
                if "engine" in s.labels and s.value == s.value:  # NaN: not checked
                    out[s.labels["engine"]] = s.value
    return out


def train_progress(text: str, job: str) -> dict[str, Any]:
    """status.stage/step/summary from a trainer's /metrics (kuberl_train_* of DESIGN.md)."""
    out: dict[str, Any] = {}
    summary: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.labels.get("job", job) != job:
                continue
            if s.name == "kuberl_train_step":
                if s.value >= out.get("step", -1):
                    out["step"] = int(s.value)
                    if "stage" in s.labels:
                        out["stage"] = s.labels["stage"]
            elif s.name == "kuberl_train_reward_mean":
                summary["rewardMean"] = s.value
            elif s.name == "kuberl_train_tool_error_ratio_positive":
                summary["toolErrorRatio"] = s.value
    if summary:
        out["summary"] = summary
    return out
