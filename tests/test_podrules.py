"""Issue 14 item 1 / "fix the classes": what a real API server refuses in a pod that a
``podTemplate`` override can put there, refused by `kuberl validate`, the operator's pre-flight
and the emulator (all three run ``apirules.object_problems``)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml

from kuberl.api import parse_resource
from kuberl.cli import main
from kuberl.operator.render.builders import build_for
from kuberl.operator.validate.apirules import children_problems, object_problems


def _pod(pod: dict[str, Any] | None = None, meta: dict[str, Any] | None = None, **container: Any) -> dict[str, Any]:
    c = {"name": "c", "image": "i", **container}
    spec = {"containers": [c], **(pod or {})}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "d"},
        "spec": {"template": {"metadata": meta or {}, "spec": spec}},
    }


SECRET_ENV = {"name": "X", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "token"}}}


@pytest.mark.parametrize(
    ("obj", "fragment"),
    [
        # references to Secrets and ConfigMaps are DNS subdomains, keys config keys
        (_pod(envFrom=[{"secretRef": {"name": "AWS_Creds"}}]), "envFrom[0].secretRef.name: 'AWS_Creds' is not a DNS subdomain"),
        (_pod(envFrom=[{"secretRef": {"name": "a"}, "configMapRef": {"name": "b"}}]), "exactly one of configMapRef, secretRef"),
        (_pod(envFrom=[{"prefix": "P_"}]), "exactly one of configMapRef, secretRef (got none)"),
        (_pod(env=[{**SECRET_ENV, "valueFrom": {"secretKeyRef": {"name": "Hf", "key": "t"}}}]), "secretKeyRef.name: 'Hf'"),
        (_pod(env=[{**SECRET_ENV, "valueFrom": {"configMapKeyRef": {"name": "c", "key": "a b"}}}]), "configMapKeyRef.key: 'a b'"),
        (_pod(env=[{**SECRET_ENV, "valueFrom": {"secretKeyRef": {"name": "c"}}}]), "secretKeyRef.key: Required value"),
        (_pod(env=[{**SECRET_ENV, "value": "1"}]), "may not be specified when `value` is not empty"),
        (_pod(env=[{"name": "X", "valueFrom": {}}]), "must specify exactly one of fieldRef"),
        # volumes: one source each, with the name it needs; mounts: a path, relative subPaths
        (_pod({"volumes": [{"name": "v"}]}), "must specify a volume type"),
        (_pod({"volumes": [{"name": "v", "emptyDir": {}, "secret": {"secretName": "s"}}]}), "more than 1 volume type"),
        (_pod({"volumes": [{"name": "v", "secret": {}}]}), "secret.secretName: Required value"),
        (_pod({"volumes": [{"name": "v", "persistentVolumeClaim": {"claimName": ""}}]}), "claimName: Required value"),
        (_pod({"volumes": [{"name": "v", "secret": {"secretName": "s", "items": [{"key": "k", "path": "../x"}]}}]}), "relative path"),
        (_pod({"volumes": [{"name": "v", "emptyDir": {}}]}, volumeMounts=[{"name": "v", "mountPath": ""}]), "mountPath: Required value"),
        (_pod({"volumes": [{"name": "v", "emptyDir": {}}]}, volumeMounts=[{"name": "v", "mountPath": "/d", "subPath": "/etc"}]), "subPath"),
        # enumerations and ids
        (_pod(imagePullPolicy="Sometimes"), "imagePullPolicy: Unsupported value 'Sometimes'"),
        (_pod(ports=[{"containerPort": 80, "protocol": "tcp"}]), "protocol: Unsupported value 'tcp'"),
        (_pod({"dnsPolicy": "Cluster"}), "dnsPolicy: Unsupported value"),
        (_pod({"securityContext": {"supplementalGroups": [44, -1]}}), "supplementalGroups: -1 must be between"),
        (_pod(securityContext={"runAsUser": 2**31}), "runAsUser: 2147483648 must be between"),
        # scheduling
        (_pod({"schedulerName": "Volcano"}), "schedulerName: 'Volcano' is not a DNS subdomain"),
        (_pod({"runtimeClassName": "g_visor"}), "runtimeClassName: 'g_visor'"),
        (_pod({"tolerations": [{"key": "k", "operator": "Exists", "effect": "NoSchedule", "tolerationSeconds": 60}]}), "must be 'NoExecute'"),
        (_pod({"tolerations": [{"key": "bad key", "operator": "Exists"}]}), "tolerations[0].key: 'bad key'"),
        (
            _pod({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [{"key": "gpu", "operator": "Is", "values": ["mi300x"]}]}]}}}}),
            "operator: Unsupported value 'Is'",
        ),
        (
            _pod({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [{"key": "gpu", "operator": "In"}]}]}}}}),
            "must be specified when `operator` is 'In'",
        ),
        (
            _pod({"affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 500, "podAffinityTerm": {"topologyKey": ""}}]}}}),
            "weight: 500 must be in the range 1-100",
        ),
        (_pod({"hostAliases": [{"ip": "10.0.0.300", "hostnames": ["h"]}]}), "must be a valid IP address"),
        (_pod({"activeDeadlineSeconds": 0}), "activeDeadlineSeconds: 0 must be a positive integer"),
        # the template's and the object's annotations
        (_pod(meta={"annotations": {"k8s.v1.cni.cncf.io/ networks": "rdma"}}), "metadata.annotations"),
        (_pod(meta={"annotations": {"a": "x" * 300_000}}), "more than the limit"),
    ],
)
def test_pod_classes_the_api_server_refuses(obj: dict[str, Any], fragment: str) -> None:
    problems = object_problems(obj)
    assert any(fragment in p for p in problems), problems


def test_valid_pods_of_the_same_shapes_pass() -> None:
    """The rules refuse the bad values only: their valid counterparts pass."""
    ok = _pod(
        {
            "volumes": [{"name": "v", "secret": {"secretName": "s", "items": [{"key": "k", "path": "a/b"}]}}],
            "schedulerName": "volcano",
            "runtimeClassName": "gvisor",
            "dnsPolicy": "ClusterFirst",
            "securityContext": {"supplementalGroups": [44, 110], "fsGroup": 0},
            "tolerations": [{"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute",
                             "tolerationSeconds": 60}],
            "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["mi300x"]},
                                      {"key": "cores", "operator": "Gt", "values": ["8"]}]}]}}},
            "hostAliases": [{"ip": "10.0.0.3", "hostnames": ["minio.local"]}],
        },
        meta={"annotations": {"k8s.v1.cni.cncf.io/networks": "rdma-net"}},
        env=[SECRET_ENV, {"name": "P", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
        envFrom=[{"secretRef": {"name": "aws-credentials", "optional": True}, "prefix": "S3_"}],
        volumeMounts=[{"name": "v", "mountPath": "/creds", "subPath": "a"}],
        imagePullPolicy="IfNotPresent",
        ports=[{"containerPort": 80, "protocol": "TCP"}],
    )
    assert object_problems(ok) == []


def test_everything_kuberl_renders_passes_the_new_rules() -> None:
    """No false refusals of kuberl's own children (all three kinds, every profile's shape)."""
    for path in ("examples/rstar2-mi300x.yaml", "examples/h100-inline.yaml", "examples/quickstart.yaml"):
        for doc in yaml.safe_load_all(open(path)):
            assert children_problems(o for o in build_for(parse_resource(doc)) if o["kind"] not in (
                "AgenticRLJob", "RolloutFleet", "SandboxPool")) == [], path


def test_validate_refuses_a_trainer_pod_template_the_api_server_would(tmp_path: Any, capsys: Any) -> None:
    doc = yaml.safe_load(open("examples/h100-inline.yaml"))
    bad = copy.deepcopy(doc)
    bad["spec"]["trainer"]["podTemplate"]["spec"]["containers"][0]["envFrom"] = [{"secretRef": {"name": "AWS_Creds"}}]
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(bad))
    assert main(["validate", str(path)]) == 1
    err = capsys.readouterr().err
    assert "Job/qwen-1p5b-h100-trainer" in err and "'AWS_Creds' is not a DNS subdomain" in err


def test_a_resource_whose_own_annotations_pass_256_kib_is_refused(tmp_path: Any) -> None:
    from kuberl.api import ManifestError
    from kuberl.api.loader import load_manifests

    doc = yaml.safe_load(open("examples/quickstart.yaml"))
    doc["metadata"]["annotations"] = {"note": "x" * (256 * 1024)}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ManifestError, match="more than the API server's limit of 262144"):
        load_manifests(str(path))


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ({"tolerations": "all"}, "podTemplate.spec.tolerations: must be a list of objects (got str 'all')"),
        ({"nodeSelector": ["gpu"]}, "nodeSelector: must be a map of strings"),
        ({"containers": [{"name": "trainer", "env": ["HF_TOKEN=x"]}]}, "env[0]: must be an object"),
        ({"containers": [{"name": "trainer", "env": [{"name": "N", "value": 1}]}]}, "env[0].value: must be a string"),
        ({"containers": [{"name": "trainer", "resources": "big"}]}, "resources: must be an object"),
        ({"containers": [{"name": "trainer", "envFrom": [{"secretRef": "aws"}]}]}, "secretRef: must be an object"),
        ({"volumes": {"cache": {}}}, "volumes: must be a list of objects"),
        ({"containers": [{"name": "trainer", "envFrom": [None]}]}, "envFrom[0]: must be an object (got null)"),
        ({"securityContext": {"supplementalGroups": "44"}}, "supplementalGroups: must be a list of integers"),
        ({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [{"key": "k", "operator": "Gt", "values": [8]}]}]}}}},
         "values[0]: must be a string"),
    ],
)
def test_a_pod_template_of_the_wrong_types_is_refused_where_it_was_a_crash(
    tmp_path: Any, capsys: Any, spec: dict[str, Any], fragment: str
) -> None:
    """Free-form in the CRD, a podTemplate of the wrong JSON types crashed `kuberl validate` (and
    the operator's pre-flight) with an AttributeError; now it is refused with the field's name."""
    doc = yaml.safe_load(open("examples/h100-inline.yaml"))
    doc["spec"]["trainer"]["podTemplate"] = {"spec": spec}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    assert main(["validate", str(path)]) == 1
    err = capsys.readouterr().err
    assert fragment in err and "Traceback" not in err, err


def test_a_null_volume_source_is_no_source() -> None:
    assert any("must specify a volume type" in p for p in object_problems(_pod({"volumes": [{"name": "v", "emptyDir": None}]})))
