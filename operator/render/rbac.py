"""The operator's own RBAC: exactly the API calls it makes, nothing more (charts/kuberl).

Every verb below is one the operator (its KubeClient or the kopf runtime) really sends:

* kuberl kinds: kopf lists and watches them and patches them (annotations, status); the
  operator creates, patches and deletes a job's inline fleet and pool (never a job), and GETs
  fleets and pools only for admission's reference checks (everything else reads the list
  cache). ``/status`` and (pools and fleets only: jobs have no scale subresource) ``/scale``
  are patched. ``/finalizers`` ``update`` is what the API server's OwnerReferencesPermission
  admission asks of whoever sets ``blockOwnerDeletion: true`` on a child (kopf.adopt does):
  without it, child creation fails on clusters that enforce it (OpenShift, hardened ones).
* children (Deployments, LeaderWorkerSets, Jobs, Services, ConfigMaps, Secrets, NetworkPolicies,
  the trainer's ServiceAccount/Role/RoleBinding): list (the read cache, ``cache.py``: one LIST
  per kind and namespace per pass serves apply's reads and pruning), create + patch
  (``KubeClient.apply``) and delete (pruning). Never ``get``, ``update`` (PUT) or ``watch``.
* pods: list (readiness, scraping, trainer failures); events: create, and list (a trainer Job
  short of pods: the Job controller's FailedCreate events say why).
* endpointslices get/list/watch: never called by the operator, held only because RBAC forbids
  granting a permission one lacks and the trainer's Role grants exactly these.
* cluster scope: kopf's namespace and CRD observers (list, watch). Webhook configurations are
  the chart's objects: the operator needs no access to them, so it cannot patch any webhook
  configuration in the cluster.
* the leader-election Lease, in the operator's own namespace only (a Role there).
* with Kueue (chart value ``kueue.enabled``; ``operator/runtime/queueing.py``): a queued job's
  Workload get, create and delete (a changed shape is a new Workload) and its ``/status`` patch
  (giving an evicted admission back, Finished); LocalQueues get (admission checks the queue
  label); ResourceFlavors and WorkloadPriorityClasses get (cluster-scoped: the flavor's node
  labels and tolerations, the priority's value).
"""

from __future__ import annotations

from typing import Any

KUBERL_PLURALS = ("agenticrljobs", "rolloutfleets", "sandboxpools")
SCALED_PLURALS = ("rolloutfleets", "sandboxpools")
# read = list (the cache); apply = create + patch; prune = delete
CHILD_VERBS = ["list", "create", "patch", "delete"]


def operator_namespaced_rules(kueue: bool = False) -> list[dict[str, Any]]:
    """What the operator needs in each watched namespace (a Role per namespace, or the ClusterRole)."""
    return [
        {"apiGroups": ["kuberl.io"], "resources": ["agenticrljobs"], "verbs": ["list", "watch", "patch"]},
        {
            "apiGroups": ["kuberl.io"],
            "resources": list(SCALED_PLURALS),
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
        {"apiGroups": [""], "resources": ["events"], "verbs": ["list", "create"]},
        {"apiGroups": ["apps"], "resources": ["deployments"], "verbs": CHILD_VERBS},
        {"apiGroups": ["batch"], "resources": ["jobs"], "verbs": CHILD_VERBS},
        {"apiGroups": ["networking.k8s.io"], "resources": ["networkpolicies"], "verbs": CHILD_VERBS},
        {"apiGroups": ["leaderworkerset.x-k8s.io"], "resources": ["leaderworkersets"], "verbs": CHILD_VERBS},
        {"apiGroups": ["policy"], "resources": ["poddisruptionbudgets"], "verbs": CHILD_VERBS},
        # a job's checkpoint volume (operator/render/trainer_runs.py): created, never deleted by the operator
        {"apiGroups": [""], "resources": ["persistentvolumeclaims"], "verbs": ["list", "create", "patch"]},
    ] + (KUEUE_NAMESPACED_RULES if kueue else [])


def operator_cluster_rules(kueue: bool = False) -> list[dict[str, Any]]:
    """What only a ClusterRole can grant: kopf's scans of namespaces and CRDs (the chart owns
    the admission webhook's configurations, so admission adds nothing here)."""
    return [
        {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "watch"]},
        {
            "apiGroups": ["apiextensions.k8s.io"],
            "resources": ["customresourcedefinitions"],
            "verbs": ["list", "watch"],
        },
    ] + (KUEUE_CLUSTER_RULES if kueue else [])


KUEUE_NAMESPACED_RULES: list[dict[str, Any]] = [
    {"apiGroups": ["kueue.x-k8s.io"], "resources": ["workloads"], "verbs": ["get", "list", "watch", "create", "delete"]},
    {"apiGroups": ["kueue.x-k8s.io"], "resources": ["workloads/status"], "verbs": ["patch"]},
    {"apiGroups": ["kueue.x-k8s.io"], "resources": ["localqueues"], "verbs": ["get"]},
]
KUEUE_CLUSTER_RULES: list[dict[str, Any]] = [
    {"apiGroups": ["kueue.x-k8s.io"], "resources": ["resourceflavors", "workloadpriorityclasses"], "verbs": ["get"]},
]


def operator_rbac_rules(kueue: bool = False) -> list[dict[str, Any]]:
    """The least the operator needs when it watches every namespace (one ClusterRole)."""
    return operator_namespaced_rules(kueue) + operator_cluster_rules(kueue)


def leader_election_rules() -> list[dict[str, Any]]:
    """The Role in the operator's namespace for its leader-election Lease."""
    return [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["get", "create", "patch"]}
    ]
