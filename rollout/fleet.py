"""The engines (SGLang or vLLM) of a run's RolloutFleet, kept in step with the fleet while the run goes on.

Where the engines are (:class:`FleetSource`, read from the environment the operator gives
trainer pods, or from ``kuberl run --engines``):

* ``KUBERL_ROLLOUT_URLS``: a fixed comma-separated list of engine URLs;
* ``KUBERL_ROLLOUT_FLEET`` (+ ``KUBERL_NAMESPACE``, else the pod's own namespace): the ready
  endpoints of the fleet's headless Service, listed from its EndpointSlices;
* ``KUBERL_ROLLOUT_ENGINE``: which server they are (``sglang``, the default, or ``vllm``);
* ``KUBERL_ROLLOUT_RESYNC_S``: how often the fleet is listed again (default 15 s).

:class:`FleetWatcher` re-lists the fleet every ``resync_s`` seconds so that replicas added by
``kubectl scale`` or the autoscaler start taking rollouts and removed ones drain: a draining
engine finishes the turns it is generating and hands its rollouts on to the others at their
next turn (``rollout.loop``), and one that goes unreachable hands them on at once. A joining engine first loads the
policy's current weights (:meth:`FleetWatcher.load_weights` remembers the last version): a new
SGLang pod starts from the base model, and rollouts sampled from stale weights would silently
be off-policy. Joins and weight pushes hold one lock, so an engine can never join with the
version a concurrent push has just replaced.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kuberl.rollout.discovery import discover_fleet_urls, parse_url_list, sync_engines
from kuberl.rollout.engines import make_engine
from kuberl.rollout.http_engine import ENGINE_KINDS, EngineUnreachable, HTTPEngine
from kuberl.rollout.scheduler import Scheduler
from kuberl.util.envvars import env_number

log = logging.getLogger("kuberl.rollout.fleet")

SA_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
DEFAULT_RESYNC_S = 15.0


async def push_weights(
    engines: Iterable[Any], path: str, version: int | None = None, *, tolerate: bool = False
) -> list[tuple[Any, BaseException]]:
    """Every engine loads the HF folder ``path`` concurrently, labelled ``version`` (the trainer's
    step). Raises naming each engine that failed; with ``tolerate``, only when none succeeded,
    and returns the (engine, error) pairs of those that failed."""
    targets = list(engines)
    results = await asyncio.gather(
        *(e.update_weights_from_disk(path, version=version) for e in targets), return_exceptions=True
    )
    failed = [(e, r) for e, r in zip(targets, results, strict=True) if isinstance(r, BaseException)]
    if failed and (not tolerate or len(failed) == len(targets)):
        named = "; ".join(f"{e.name}: {r}" for e, r in failed)
        raise RuntimeError(f"weight update to {path} failed on {len(failed)} engine(s): {named}")
    return failed


@dataclass(frozen=True)
class FleetSource:
    urls: tuple[str, ...] = ()
    fleet: str | None = None
    namespace: str | None = None
    engine: str = "sglang"
    # how long a request waits for an engine that went away to answer again: for servers the
    # run restarts itself (a local run's vLLM); a fleet's replicas come and go by discovery
    reconnect_s: float = 0.0
    resync_s: float = DEFAULT_RESYNC_S

    def __post_init__(self) -> None:
        if self.engine not in ENGINE_KINDS:
            raise ValueError(f"engine type {self.engine!r} is not one of {', '.join(ENGINE_KINDS)}")
        if self.resync_s <= 0:
            raise ValueError(f"the fleet's resync period must be > 0 s, got {self.resync_s}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> FleetSource | None:
        """The source the environment names, or None when it names none (local engine)."""
        env = os.environ if env is None else env
        engine = env.get("KUBERL_ROLLOUT_ENGINE", "").strip() or "sglang"
        resync_s = env_number("KUBERL_ROLLOUT_RESYNC_S", DEFAULT_RESYNC_S, dict(env))
        if env.get("KUBERL_ROLLOUT_URLS", "").strip():
            return cls(urls=tuple(parse_url_list(env["KUBERL_ROLLOUT_URLS"])), engine=engine, resync_s=resync_s)
        fleet = env.get("KUBERL_ROLLOUT_FLEET", "").strip()
        if not fleet:
            return None
        ns = env.get("KUBERL_NAMESPACE", "").strip()
        if not ns and SA_NAMESPACE_FILE.is_file():
            ns = SA_NAMESPACE_FILE.read_text().strip()
        return cls(fleet=fleet, namespace=ns or "default", engine=engine, resync_s=resync_s)

    def describe(self) -> str:
        where = f"fleet {self.namespace}/{self.fleet}" if self.fleet else f"engines {', '.join(self.urls)}"
        return f"{self.engine} {where}"

    def list_urls(self, api: Any = None) -> list[str]:
        if self.fleet is None:
            return list(self.urls)
        return discover_fleet_urls(self.fleet, self.namespace or "default", api=api)


class FleetWatcher:
    """Owns the scheduler's HTTP engines: initial discovery, joins (prepared), drains."""

    def __init__(
        self,
        source: FleetSource,
        *,
        policy: str = "kv-aware",
        interval: float | None = None,
        api: Any = None,
        engine_kwargs: dict[str, Any] | None = None,
    ):
        self.source = source
        self.policy = policy
        self.interval = source.resync_s if interval is None else interval
        self.api = api
        self.engine_kwargs = dict(engine_kwargs or {})
        self.scheduler: Scheduler | None = None
        self.weights_path: str | None = None  # the policy version every engine in service has loaded
        self.weights_version: int | None = None
        self.lock = asyncio.Lock()
        self.push_failures = 0  # engines that left the fleet for a failed push
        self._task: asyncio.Task | None = None

    async def _list(self) -> list[str]:
        return await asyncio.to_thread(self.source.list_urls, self.api)

    async def _ready_engine(self, url: str) -> HTTPEngine | None:
        """An engine for ``url`` that is healthy and prepared, or None (tried again next round).

        A server of another engine type than the fleet names is an error at once: no later
        round would make it right.
        """
        engine = make_engine(self.source.engine, url, reconnect_s=self.source.reconnect_s, **self.engine_kwargs)
        try:
            if not await engine.health():
                raise RuntimeError("not healthy yet")
            await engine.check_kind()
        except EngineUnreachable as err:  # gone again since /health answered: next round
            log.warning("engine %s not added: %s", url, err)
            await engine.close()
            return None
        except engine.error_type:
            await engine.close()
            raise
        except Exception as err:  # a pod that is still loading its model: next round
            log.warning("engine %s not added: %s", url, err)
            await engine.close()
            return None
        try:
            if self.weights_path is not None:
                await engine.update_weights_from_disk(self.weights_path, version=self.weights_version)
            return engine
        except Exception as err:
            log.warning("engine %s not added: %s", url, err)
            await engine.close()
            return None

    async def start(self, timeout: float = 900.0) -> Scheduler:
        """Wait (up to ``timeout`` s) for at least one ready engine; returns the scheduler."""
        deadline = time.monotonic() + timeout
        while True:
            urls = await self._list()
            engines = [e for e in await asyncio.gather(*(self._ready_engine(u) for u in urls)) if e]
            if engines:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"no ready engine in {self.source.describe()} after {timeout:.0f} s "
                    f"(listed: {', '.join(urls) or 'none'})"
                )
            await asyncio.sleep(min(self.interval, 5.0))
        self.scheduler = Scheduler(engines, policy=self.policy)
        await self.scheduler.refresh_capacities()
        if self.interval > 0:  # a fixed list too: an engine that left for a fault rejoins
            self._task = asyncio.get_running_loop().create_task(self._watch(), name="fleet-watch")
        return self.scheduler

    @property
    def engines(self) -> Sequence[HTTPEngine]:
        if self.scheduler is None:
            return []
        return [st.engine for st in self.scheduler.stats if isinstance(st.engine, HTTPEngine)]

    async def sync_once(self) -> tuple[list[str], list[str]]:
        """Make the scheduler's engines match the fleet's ready endpoints; (added, drained)."""
        assert self.scheduler is not None, "start() first"
        wanted = await self._list()
        async with self.lock:  # no weight push between a joining engine's load and its join
            added, drained = await sync_engines(self.scheduler, wanted, prepare=self._ready_engine)
        if added or drained:
            log.info("fleet %s: added %s, draining %s", self.source.describe(), added, drained)
        return added, drained

    async def load_weights(self, path: str, version: int | None = None) -> None:
        """Every engine in service loads ``path``; engines that join later load it first. An
        engine that fails the push leaves the fleet (drained, closed once idle) and rejoins at
        a later sync with the then current weights; the push fails only if no engine took it."""
        assert self.scheduler is not None, "start() first"
        async with self.lock:
            failed = await push_weights(self.engines, path, version, tolerate=True)
            self.weights_path, self.weights_version = path, version
            for engine, err in failed:
                log.warning("engine %s left the fleet: its push of %s failed: %s", engine.name, path, err)
                self.scheduler.drain_engine(engine.name, failed=True)
                self.push_failures += 1
            for engine in self.scheduler.remove_drained():
                await engine.close()

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.sync_once()
            except Exception as err:  # the API server blinking must not end the run
                log.warning("fleet discovery failed: %s", err)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        for engine in self.engines:
            await engine.close()
