"""The operator pod's liveness endpoint (``/livez``), separate from kopf's readiness one.

kopf's liveness endpoint (``/healthz`` on ``KUBERL_HEALTH_PORT``) runs only where kopf runs:
in the leader. It is the readiness probe, so only the leader receives webhook traffic. A
standby must still look alive, or the kubelet would restart it forever while it waits for the
Lease; so liveness is this small server, on its own port, in every replica: a standby answers
200 while it campaigns, the leader answers what kopf's endpoint answers (its probe handlers
fail on a wedged periodic loop).
"""

from __future__ import annotations

from typing import Any, Protocol

import aiohttp
from aiohttp import web


class Leading(Protocol):
    leading: bool


async def serve_livez(
    port: int, kopf_url: str | None, elector: Leading | None, host: str = "0.0.0.0"
) -> web.AppRunner:  # noqa: S104 - a probe port
    """Start the /livez server; the caller cleans the returned runner up."""

    async def livez(_: web.Request) -> web.Response:
        if elector is not None and not elector.leading:
            return web.json_response({"role": "standby"})
        if kopf_url is None:
            return web.json_response({"role": "leader"})
        try:
            timeout = aiohttp.ClientTimeout(total=5)
            async with aiohttp.ClientSession(timeout=timeout) as s, s.get(kopf_url) as rsp:
                body: Any = await rsp.json(content_type=None)
                return web.json_response(
                    {"role": "leader", "kopf": body}, status=200 if rsp.status == 200 else 503
                )
        except (aiohttp.ClientError, TimeoutError, ValueError) as err:
            # kopf starts its endpoint a moment after winning the Lease; the probe's
            # failureThreshold covers that moment, not a kopf that never comes up
            return web.json_response({"role": "leader", "error": str(err)}, status=503)

    app = web.Application()
    app.router.add_get("/livez", livez)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
