"""How a child the API server refused shows up on its owner, as pure functions.

A refusal must reach the owner's status, not only the operator's log (a reconcile that raised
before writing status would leave it empty while kopf retried for ever). Each refusal becomes a
``ChildFailure``; the reconcile goes on with the other children and the owner's status gets

* an ``Applied`` condition (True when every child was accepted; False naming each refused
  child, the API's status code and its answer);
* ``Ready=False`` with the same reason and message, and phase ``Degraded`` (a running job or
  fleet is not marked Failed for it: the next resync tries again);
* one Warning event per refusal, posted again only when the answer changes (the resync retries
  every ``reconcile_interval`` and must not flood the namespace's events).

The API server's answers are explained where the code alone is cryptic: 404 on create means the
kind is not served (a CRD such as LeaderWorkerSet not installed), 403 with "exceeded quota"
is a ResourceQuota, other 403s are RBAC or admission.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kuberl.operator.decide.status import Event, condition

APPLIED = "Applied"
DEGRADED = "Degraded"
KEEP_PHASES = ("Invalid", "Failed", "Succeeded")
"""Phases a refused child does not override (they say more about the object already)."""


@dataclass(frozen=True)
class ChildFailure:
    kind: str
    name: str
    api_version: str
    code: int
    reason: str
    message: str
    pods: bool = False  # the object was accepted; its controller cannot create its pods

    @property
    def what(self) -> str:
        return f"{self.kind}/{self.name}"

    @property
    def cause(self) -> str:
        """A CamelCase reason for the condition (Invalid, Forbidden, QuotaExceeded, KindNotInstalled)."""
        if self.code == 404:
            return "KindNotInstalled"
        if (self.code == 403 or self.pods) and "quota" in self.message.lower():
            return "QuotaExceeded"
        if self.pods:
            return "PodsRefused"
        return self.reason if self.reason.isalnum() and self.reason[:1].isupper() else f"Http{self.code}"

    def line(self) -> str:
        if self.pods:
            return f"{self.what} cannot create its pods: {self.message}"
        if self.code == 404:
            return (
                f"{self.what}: the API server does not serve {self.api_version} {self.kind} (is its "
                f"CRD installed?): {self.message}"
            )
        return f"{self.what} was refused by the API server ({self.code} {self.reason}): {self.message}"


def failure_from_api(
    obj: dict[str, Any], code: int, reason: str, message: str, *, pods: bool = False
) -> ChildFailure:
    meta = obj.get("metadata") or {}
    return ChildFailure(
        kind=str(obj.get("kind", "?")),
        name=str(meta.get("name", "?")),
        api_version=str(obj.get("apiVersion", "batch/v1" if pods else "?")),
        code=code,
        reason=reason,
        message=message,
        pods=pods,
    )


def trainer_short_of_pods(trainer: dict[str, Any] | None) -> bool:
    """Whether a running (not suspended, not finished) trainer Job has fewer pods than it wants:
    then the Job controller's FailedCreate events say why (a quota, Pod Security admission);
    a Job, unlike a Deployment, has no status condition for it."""
    if trainer is None:
        return False
    spec, st = trainer.get("spec") or {}, trainer.get("status") or {}
    finished = any(
        c.get("type") in ("Complete", "Failed") and c.get("status") == "True" for c in st.get("conditions") or []
    )
    return not spec.get("suspend") and not finished and int(st.get("active") or 0) < int(spec.get("parallelism") or 1)


def latest_failed_create(trainer: dict[str, Any], events: list[dict[str, Any]]) -> ChildFailure | None:
    if not events:
        return None
    latest = max(events, key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")
    return failure_from_api(trainer, 403, "FailedCreate", str(latest.get("message", "")), pods=True)


def _message(failures: list[ChildFailure]) -> str:
    return "; ".join(f.line() for f in failures)[:4000]


def with_child_failures(
    new: dict[str, Any], failures: list[ChildFailure], generation: int | None, previous: dict[str, Any]
) -> dict[str, Any]:
    """``new`` (a computed status) with the ``Applied`` condition, and when children were refused,
    Ready=False naming them and phase Degraded. An empty ``new`` (nothing to report) stays empty."""
    if not new:
        return new
    prev_conds = list(previous.get("conditions") or [])
    conds = [c for c in new.get("conditions") or [] if c.get("type") != APPLIED]
    if not failures:
        conds.append(condition(APPLIED, True, "AllChildrenApplied", "", generation, prev_conds))
        return {**new, "conditions": conds}
    msg = _message(failures)
    cause = failures[0].cause
    conds = [c for c in conds if c.get("type") != "Ready"]
    conds.append(condition("Ready", False, cause, msg, generation, prev_conds))
    refused = [f for f in failures if not f.pods]
    if refused:
        conds.append(condition(APPLIED, False, refused[0].cause, _message(refused), generation, prev_conds))
    else:
        conds.append(condition(APPLIED, True, "AllChildrenApplied", "", generation, prev_conds))
    out = {**new, "conditions": conds}
    if new.get("phase") not in KEEP_PHASES:
        out["phase"] = DEGRADED
    return out


def failure_events(
    failures: list[ChildFailure], previous: dict[str, Any], already: set[str] | frozenset[str] = frozenset()
) -> list[Event]:
    """A Warning per refused child, unless this answer was reported already: in the previous
    status (so an operator restart does not repeat it) or in ``already`` (what this operator
    posted since; a status write may still be in flight when the next pass runs)."""
    before = next((c for c in previous.get("conditions") or [] if c.get("type") == "Ready"), None)
    reported = (before or {}).get("message", "") if (before or {}).get("status") == "False" else ""
    return [
        Event("Warning", f"Child{f.cause}", f.line())
        for f in failures
        if f.line() not in already and f.line()[:4000] not in reported
    ]


def invalid_children_message(problems: list[str]) -> str:
    return (
        "the API server would refuse the objects this resource creates, so none was created: "
        + "; ".join(problems)
    )
