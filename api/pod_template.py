"""PodTemplate overrides: the per-component escape hatch for what kuberl does not model.

Environment (``env``/``envFrom`` from Secrets: AWS_*, HF_TOKEN), imagePullSecrets, extra
tolerations/nodeSelector/affinity, priorityClassName, schedulerName (gang schedulers),
securityContext and supplementalGroups (video/render for /dev/kfd), capabilities (IPC_LOCK for
RDMA), annotations (Multus) and sidecars: as KubeRay, LeaderWorkerSet and Kubeflow do, each
component embeds a PodTemplateSpec that is merged over what the operator renders
(``kuberl.operator.render.podtemplate.merge`` says how).

The pod spec is free-form in the CRD (``x-kubernetes-preserve-unknown-fields``: the core/v1
PodSpec schema would triple the CRDs' size), so the checks that matter are made here: field
names (a typo such as ``tolerationz`` would otherwise be dropped without a word by the API
server), container names, and the fields the operator must own.
"""

from __future__ import annotations

import difflib
from typing import Any

from pydantic import Field, field_validator

from kuberl.api.common import KubeModel
from kuberl.api.pod_shapes import POD_SPEC, shape_problems

POD_SPEC_FIELDS = frozenset(
    """activeDeadlineSeconds affinity automountServiceAccountToken containers dnsConfig dnsPolicy
    enableServiceLinks ephemeralContainers hostAliases hostIPC hostNetwork hostPID hostUsers hostname
    imagePullSecrets initContainers nodeName nodeSelector os overhead preemptionPolicy priority
    priorityClassName readinessGates resourceClaims resources restartPolicy runtimeClassName
    schedulerName schedulingGates securityContext serviceAccount serviceAccountName
    setHostnameAsFQDN shareProcessNamespace subdomain terminationGracePeriodSeconds tolerations
    topologySpreadConstraints volumes""".split()
)
CONTAINER_FIELDS = frozenset(
    """args command env envFrom image imagePullPolicy lifecycle livenessProbe name ports
    readinessProbe resizePolicy resources restartPolicy securityContext startupProbe stdin stdinOnce
    terminationMessagePath terminationMessagePolicy tty volumeDevices volumeMounts workingDir""".split()
)
OPERATOR_OWNED = {
    "restartPolicy": "the trainer's Job needs Never and Deployments Always",
    "subdomain": "the trainer's rendezvous DNS depends on it",
    "hostname": "pods of one template would share it",
    "nodeName": "it bypasses the scheduler and the accelerator affinity",
}
SELECTOR_LABELS = (
    "app.kubernetes.io/name",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/component",
    "kuberl.io/role",
)


def _unknown(key: str, known: frozenset[str], where: str) -> str:
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"{where}: unknown field {key!r}{hint}"


class PodTemplateMeta(KubeModel):
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)

    @field_validator("labels")
    @classmethod
    def _not_selectors(cls, labels: dict[str, str]) -> dict[str, str]:
        taken = sorted(set(labels) & set(SELECTOR_LABELS))
        if taken:
            raise ValueError(
                f"podTemplate.metadata.labels may not set {', '.join(taken)}: the operator selects its pods "
                "with them"
            )
        return labels


class PodTemplateOverride(KubeModel):
    """A core/v1 PodTemplateSpec merged over the pods the operator renders for this component."""

    metadata: PodTemplateMeta = Field(default_factory=PodTemplateMeta)
    spec: dict[str, Any] = Field(
        default_factory=dict,
        description=(
            "core/v1 PodSpec fields merged over the rendered pod: containers, env, volumes, volumeMounts "
            "and imagePullSecrets by name (volumeMounts by mountPath), tolerations and envFrom added, "
            "maps merged, anything else replaced. A container named like the rendered one (trainer, "
            "sglang, vllm, sandbox) changes it; another name adds a sidecar."
        ),
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True, "type": "object"},
    )

    @field_validator("spec")
    @classmethod
    def _pod_spec(cls, spec: dict[str, Any]) -> dict[str, Any]:
        problems = [_unknown(k, POD_SPEC_FIELDS, "podTemplate.spec") for k in spec if k not in POD_SPEC_FIELDS]
        problems += [
            f"podTemplate.spec.{k} is set by the operator ({why})" for k, why in OPERATOR_OWNED.items() if k in spec
        ]
        for field in ("containers", "initContainers"):
            items = spec.get(field)
            if items is None:
                continue
            if not isinstance(items, list):
                problems.append(f"podTemplate.spec.{field} must be a list")
                continue
            for i, c in enumerate(items):
                if not isinstance(c, dict) or not c.get("name"):
                    problems.append(f"podTemplate.spec.{field}[{i}] needs a name (the rendered one to change, or a new one)")
                    continue
                where = f"podTemplate.spec.{field}[{c['name']}]"
                problems += [_unknown(k, CONTAINER_FIELDS, where) for k in c if k not in CONTAINER_FIELDS]
        # JSON types of what the merge and the API rules read (reported above: unnamed containers)
        typed = {
            k: [c for c in v if isinstance(c, dict) and c.get("name")] if k in ("containers", "initContainers") else v
            for k, v in spec.items()
            if k not in ("containers", "initContainers") or isinstance(v, list)
        }
        problems += shape_problems(typed, POD_SPEC, "podTemplate.spec")
        if problems:
            raise ValueError("; ".join(problems))
        return spec
