"""The operator's own RBAC: exactly the API calls it makes, nothing more (charts/kuberl).

Every verb below is one the operator (its KubeClient or the kopf runtime) really sends:

* kuberl kinds: kopf lists and watches them and patches them (annotations, status); the
  operator GETs referenced fleets/pools, creates, patches and deletes a job's inline ones.
  ``/status`` and (pools and fleets only: jobs have no scale subresource) ``/scale`` are
  patched. ``/finalizers`` ``update`` is what the API server's OwnerReferencesPermission
  admission asks of whoever sets ``blockOwnerDeletion: true`` on a child (kopf.adopt does):
  without it, child creation fails on clusters that enforce it (OpenShift, hardened ones).
* children (Deployments, LeaderWorkerSets, Jobs, Services, ConfigMaps, Secrets, NetworkPolicies,
  the trainer's ServiceAccount/Role/RoleBinding): get + create + patch (``KubeClient.apply``),
  list (pruning by label) and delete. Never ``update`` (PUT) and never ``watch``: the operator
  re-reads children on its resync, it keeps no watch on them.
* pods: list (readiness, scraping, trainer failures); events: create.
* endpointslices get/list/watch: never called by the operator, held only because RBAC forbids
  granting a permission one lacks and the trainer's Role grants exactly these.
* cluster scope: kopf's namespace and CRD observers (list, watch). Webhook configurations are
  the chart's objects: the operator needs no access to them (it used to be able to patch every
  webhook configuration in the cluster).
* the leader-election Lease, in the operator's own namespace only (a Role there).
"""

from __future__ import annotations

from typing import Any

KUBERL_PLURALS = ("agenticrljobs", "rolloutfleets", "sandboxpools")
SCALED_PLURALS = ("rolloutfleets", "sandboxpools")
# apply = get + create + patch; prune = list + delete
CHILD_VERBS = ["get", "list", "create", "patch", "delete"]


def operator_namespaced_rules() -> list[dict[str, Any]]:
    """What the operator needs in each watched namespace (a Role per namespace, or the ClusterRole)."""
    return [
        {
            "apiGroups": ["kuberl.io"],
            "resources": list(KUBERL_PLURALS),
            "verbs": ["get", "list", "watch", "create", "patch", "delete"],
        },
        {
            "apiGroups": ["kuberl.io"],
            "resources": [f"{p}/status" for p in KUBERL_PLURALS] + [f"{p}/scale" for p in SCALED_PLURALS],
            "verbs": ["patch"],
        },
        {
            "apiGroups": ["kuberl.io"],
            "resources": [f"{p}/finalizers" for p in KUBERL_PLURALS],
            "verbs": ["update"],
        },
        {
            "apiGroups": [""],
            "resources": ["services", "configmaps", "secrets", "serviceaccounts"],
            "verbs": CHILD_VERBS,
        },
        {
            "apiGroups": ["rbac.authorization.k8s.io"],
            "resources": ["roles", "rolebindings"],
            "verbs": CHILD_VERBS,
        },
        # Held so that it can be granted to trainers (RBAC forbids granting what one lacks).
        {
            "apiGroups": ["discovery.k8s.io"],
            "resources": ["endpointslices"],
            "verbs": ["get", "list", "watch"],
        },
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]},
        {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
        {"apiGroups": ["apps"], "resources": ["deployments"], "verbs": CHILD_VERBS},
        {"apiGroups": ["batch"], "resources": ["jobs"], "verbs": CHILD_VERBS},
        {"apiGroups": ["networking.k8s.io"], "resources": ["networkpolicies"], "verbs": CHILD_VERBS},
        {"apiGroups": ["leaderworkerset.x-k8s.io"], "resources": ["leaderworkersets"], "verbs": CHILD_VERBS},
    ]


def operator_cluster_rules(admission: bool = False) -> list[dict[str, Any]]:
    """What only a ClusterRole can grant: kopf's scans of namespaces and CRDs.

    ``admission`` no longer changes anything (the chart owns the webhook configurations); the
    parameter stays so callers written against the old signature keep working.
    """
    del admission
    return [
        {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "watch"]},
        {
            "apiGroups": ["apiextensions.k8s.io"],
            "resources": ["customresourcedefinitions"],
            "verbs": ["list", "watch"],
        },
    ]


def operator_rbac_rules(admission: bool = False) -> list[dict[str, Any]]:
    """The least the operator needs when it watches every namespace (one ClusterRole)."""
    return operator_namespaced_rules() + operator_cluster_rules(admission)


def leader_election_rules() -> list[dict[str, Any]]:
    """The Role in the operator's namespace for its leader-election Lease."""
    return [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["get", "create", "patch"]}
    ]
