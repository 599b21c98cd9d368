"""`kuberl validate` answers every manifest with a verdict, never a traceback (issue 14: "more bad
manifests than these will be tried ... fix the classes").

Every field of the examples and of a podTemplate that sets most PodSpec fields kuberl reads is
replaced, one at a time, by values of each other JSON type; the model, the rendered children's
API rules and the notes must refuse or accept each, never crash (before the PodSpec type
check, ``tolerations: all`` raised AttributeError in the rule checks)."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from kuberl.api import ManifestError, parse_resource
from kuberl.operator.validate.checks import check_file

pytestmark = pytest.mark.timeout(300)
VALUES: tuple[Any, ...] = ("x", 7, None, [], {}, [1])
RICH_TEMPLATE = {
    "metadata": {"annotations": {"k8s.v1.cni.cncf.io/networks": "rdma"}, "labels": {"team": "rl"}},
    "spec": {
        "volumes": [
            {"name": "v", "secret": {"secretName": "s", "items": [{"key": "k", "path": "a/b"}]}},
            {"name": "p", "persistentVolumeClaim": {"claimName": "pvc"}},
        ],
        "schedulerName": "volcano",
        "securityContext": {"supplementalGroups": [44], "runAsUser": 1000},
        "tolerations": [{"key": "k", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 60}],
        "nodeSelector": {"pool": "gpu"},
        "affinity": {
            "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["a"]}]}]}},
            "podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 10, "podAffinityTerm": {
                "topologyKey": "kubernetes.io/hostname", "labelSelector": {"matchLabels": {"a": "b"}}}}]},
        },
        "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "ScheduleAnyway"}],
        "hostAliases": [{"ip": "10.0.0.3", "hostnames": ["minio.local"]}],
        "imagePullSecrets": [{"name": "regcred"}],
        "containers": [
            {
                "name": "trainer",
                "env": [{"name": "X", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "token"}}}],
                "envFrom": [{"secretRef": {"name": "aws"}, "prefix": "S3_"}],
                "volumeMounts": [{"name": "v", "mountPath": "/creds", "subPath": "a"}],
                "securityContext": {"capabilities": {"add": ["IPC_LOCK"]}},
                "resources": {"limits": {"memory": "600Gi"}},
            },
            {"name": "side", "image": "busybox", "ports": [{"name": "x", "containerPort": 81}]},
        ],
    },
}  # fmt: skip


def _paths(obj: Any, pre: tuple = ()) -> Iterator[tuple]:
    if pre:
        yield pre
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        yield from _paths(v, (*pre, k))


def _verdicts(docs: list[dict[str, Any]]) -> None:
    try:
        check_file([parse_resource(d) for d in docs])
    except ManifestError:
        pass  # a refusal, with its message


def _mutants(docs: list[dict[str, Any]], roots: list[tuple]) -> Iterator[list[dict[str, Any]]]:
    for i, doc in enumerate(docs):
        for root in roots:
            node = doc
            for k in root:
                node = node[k]
            for path in _paths(node):
                for value in VALUES:
                    out = copy.deepcopy(docs)
                    target = out[i]
                    for k in (*root, *path[:-1]):
                        target = target[k]
                    target[path[-1]] = value
                    yield out


def test_no_field_of_another_type_crashes_validate() -> None:
    job = yaml.safe_load(open("examples/h100-inline.yaml"))
    job["spec"]["trainer"]["podTemplate"] = copy.deepcopy(RICH_TEMPLATE)
    _verdicts([job])  # the baseline is a verdict too
    count = 0
    for docs in _mutants([job], [("spec", "trainer", "podTemplate")]):
        _verdicts(docs)
        count += 1
    assert count > 300
    mi300x = list(yaml.safe_load_all(open("examples/rstar2-mi300x.yaml")))
    for docs in _mutants(mi300x, [("spec",), ("metadata",)]):
        _verdicts(docs)
