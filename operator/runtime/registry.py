"""The kopf registry: which kopf handler calls which reconcile function, bound to one
OperatorContext; and the operator-wide kopf settings.

The reconcile logic is ``handlers`` (one pass over one object) and ``loops`` (the resync and
autoscale loops over every object); this module only wires them to kopf's events, the probe,
startup and cleanup, and admission (``admission``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import kopf

from kuberl.api.group import API_VERSION, GROUP, VERSION
from kuberl.operator.decide import status
from kuberl.operator.decide.children import job_owner
from kuberl.operator.runtime.context import PLURALS, OperatorConfig, OperatorContext
from kuberl.operator.runtime.handlers import post_events, reconcile
from kuberl.operator.runtime.kube import KUEUE_API_VERSION, ApiError, kind_of
from kuberl.operator.runtime.loops import autoscale_loop, resync_loop, resync_object, stale_loops
from kuberl.operator.validate import admission

log = logging.getLogger("kuberl.operator")


def build_registry(
    config: OperatorConfig | None = None, namespaces: list[str] | None = None
) -> tuple[kopf.OperatorRegistry, OperatorContext]:
    """A kopf registry with every kuberl handler bound to one OperatorContext.

    ``namespaces=None`` means cluster-wide (the resync loop lists across namespaces).
    """
    ctx = OperatorContext(config or OperatorConfig(), namespaces=namespaces)
    reg = kopf.OperatorRegistry()
    cfg = ctx.config

    @kopf.on.login(registry=reg)
    def _login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        info = cfg.login(**kwargs)
        if info is not None:
            ctx.connection = info
        return info

    @kopf.on.cleanup(registry=reg)
    async def _cleanup(**_: Any) -> None:
        for task in ctx.tasks:
            task.cancel()
        for task in ctx.tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        ctx.tasks.clear()
        await ctx.close()

    @kopf.on.probe(id="loops", registry=reg)
    def _probe(**_: Any) -> dict[str, float]:
        """kopf's liveness endpoint runs this: a wedged periodic loop fails the probe."""
        now = time.monotonic()
        stale = stale_loops(ctx, now)
        if stale:
            raise kopf.PermanentError("; ".join(stale))
        return {name: round(now - beat, 1) for name, beat in ctx.heartbeats.items()}

    @kopf.on.startup(registry=reg)
    async def _startup(**_: Any) -> None:
        ctx.tasks = [asyncio.create_task(resync_loop(ctx)), asyncio.create_task(autoscale_loop(ctx))]

    if cfg.kueue:

        async def on_workload(body: kopf.Body, **_: Any) -> None:
            # Kueue admitted, evicted or finished a job's Workload: reconcile the job now
            name = job_owner(dict(body), API_VERSION)
            namespace = body.get("metadata", {}).get("namespace")
            if name is None or namespace is None:
                return
            # read as the resync reads it: the chart grants list and watch on jobs, not get
            for job in await ctx.client().list(
                kind_of(API_VERSION, "AgenticRLJob"), namespace, fields={"metadata.name": name}
            ):
                try:
                    await resync_object(ctx, job)
                except ApiError as err:
                    if err.status != 404:  # deleted since: its DELETED event does the rest
                        raise

        group, version = KUEUE_API_VERSION.split("/")
        kopf.on.event(group, version, "workloads", id="kueue-workloads", registry=reg)(on_workload)

    for kind, plural in PLURALS.items():
        res_args = (GROUP, VERSION, plural)

        async def on_change(body: kopf.Body, patch: kopf.Patch, reason: str, **_: Any) -> None:
            new, events = await reconcile(ctx, body, first_time=reason == "create")
            patch.status.update(new)
            await post_events(ctx, body, events)

        kopf.on.create(*res_args, id=f"{kind}-create", registry=reg)(on_change)
        kopf.on.update(*res_args, id=f"{kind}-update", registry=reg)(on_change)
        kopf.on.resume(*res_args, id=f"{kind}-resume", registry=reg)(on_change)

        async def on_event(type: str | None, body: kopf.Body, **_: Any) -> None:  # noqa: A002 - kopf's name
            if type != "DELETED":
                return
            ctx.forget(body.get("metadata", {}).get("uid", ""))
            what = f"{body.get('kind')} {body.get('metadata', {}).get('name')}"
            gone = status.Event(
                "Normal", "Deleted", f"{what} deleted; the garbage collector removes its children"
            )
            await post_events(ctx, body, [gone])

        kopf.on.event(*res_args, id=f"{kind}-event", registry=reg)(on_event)

        if cfg.admission:

            async def on_validate(
                body: kopf.Body, warnings: list[str], old: kopf.Body | None = None, **_: Any
            ) -> None:
                before = dict(old) if old is not None else None
                errors = await admission.validation_errors(dict(body), _lookup(ctx), before)
                if errors:
                    raise kopf.AdmissionError("; ".join(errors), code=422)
                # kubectl prints these as `Warning:` lines, as `kuberl validate` does
                warnings.extend(await admission.validation_warnings(dict(body), _lookup(ctx)))

            def on_mutate(body: kopf.Body, patch: kopf.Patch, **_: Any) -> None:
                changes = admission.mutation(dict(body))
                for key, value in changes.items():
                    patch[key] = value

            kopf.on.validate(
                *res_args, id=f"validate-{plural}", operations=["CREATE", "UPDATE"], registry=reg
            )(on_validate)
            kopf.on.mutate(*res_args, id=f"mutate-{plural}", operations=["CREATE", "UPDATE"], registry=reg)(
                on_mutate
            )

    return reg, ctx


def _lookup(ctx: OperatorContext) -> admission.Lookup:
    async def get(kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        if kind != "LocalQueue":
            return await ctx.client().get(kind_of(f"{GROUP}/{VERSION}", kind), namespace, name, fresh=True)
        try:
            return await ctx.client().get(kind_of(KUEUE_API_VERSION, kind), namespace, name, fresh=True)
        except ApiError as err:
            if err.status == 403:  # not granted (chart without kueue.enabled): cannot know, so admit
                log.warning("cannot check LocalQueue %s/%s: %s", namespace, name, err)
                return {}
            raise

    return get


def configure_settings(settings: kopf.OperatorSettings, *, fast: bool = False) -> None:
    """Operator-wide kopf settings: explicit events only, and (for tests) short timeouts."""
    settings.posting.loggers = False  # only the explicit kopf.event() transitions become events
    settings.persistence.finalizer = f"{GROUP}/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    if fast:
        settings.watching.server_timeout = 5
        settings.watching.client_timeout = 10
        settings.watching.reconnect_backoff = 0.2
        settings.queueing.idle_timeout = 0.2
        settings.queueing.exit_timeout = 1
        settings.posting.default_backoffs = (0.1, 0.2)
