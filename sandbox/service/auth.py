"""Who may run code in a sandbox pool: a per-pool bearer token.

The operator keeps a random token in the Secret ``<pool>-sandbox-token`` (key ``token``) and
hands it to the pool's pods and to the trainer pods of jobs that use the pool, both as
``KUBERL_SANDBOX_TOKEN``. The service then answers ``/v1/*`` (execute, verify) only to
requests carrying ``Authorization: Bearer <token>``; ``/healthz``, ``/readyz`` and ``/metrics``
stay open for the kubelet and Prometheus. The NetworkPolicy limits who can connect at all; the
token is what stops any pod that can (Prometheus' namespace, a misconfigured CNI, a pod in the
same namespace) from running code. Without the variable (a local service on loopback) there is
no check.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Awaitable, Callable, Mapping

from aiohttp import web

TOKEN_ENV = "KUBERL_SANDBOX_TOKEN"
PROTECTED_PREFIX = "/v1/"


def token_from_env(env: Mapping[str, str] | None = None) -> str | None:
    value = (os.environ if env is None else env).get(TOKEN_ENV, "").strip()
    return value or None


def authorized(header: str | None, token: str) -> bool:
    """Whether an Authorization header carries ``token`` (constant-time comparison)."""
    scheme, _, value = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), token.encode())


def auth_headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def require_token(token: str | None) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    """aiohttp middleware: 401 on ``/v1/*`` without the token (no-op when ``token`` is None)."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if token and request.path.startswith(PROTECTED_PREFIX):
            if not authorized(request.headers.get("Authorization"), token):
                return web.json_response(
                    {"error": f"missing or wrong bearer token (the pool's {TOKEN_ENV})"},
                    status=401,
                    headers={"WWW-Authenticate": 'Bearer realm="kuberl-sandbox"'},
                )
        return await handler(request)

    return middleware
