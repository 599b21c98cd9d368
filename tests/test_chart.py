"""Helm chart charts/kuberl: render offline (helm-python-sdk) and validate every object.

Core objects go through kubernetes-validate (strict, Kubernetes 1.33); prometheus-operator
objects through minimal JSON schemas written from the monitoring.coreos.com/v1 API reference
(only the fields the chart uses, unknown fields rejected); alert expressions through
``promtool check rules``; the chart's CRDs, RBAC and dashboards must equal their sources.
"""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
from pathlib import Path

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml

from kuberl.dashboards.cli import rendered as rendered_dashboards
from kuberl.dashboards.metrics_catalog import check_expression
from kuberl.operator.builders import operator_cluster_rules, operator_namespaced_rules, operator_rbac_rules
from kuberl.operator.main import ServiceWebhookServer, webhook_server_from_env

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "charts" / "kuberl"

DURATION = {"type": "string", "pattern": r"^(0|(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"}
STR_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
LABEL_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "matchLabels": STR_MAP,
        "matchExpressions": {"type": "array", "items": {"type": "object"}},
    },
}
NS_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {"any": {"type": "boolean"}, "matchNames": {"type": "array", "items": {"type": "string"}}},
}
ENDPOINT = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "port": {"type": "string", "minLength": 1},
        "path": {"type": "string", "pattern": "^/"},
        "interval": DURATION,
        "scrapeTimeout": DURATION,
        "honorLabels": {"type": "boolean"},
        "scheme": {"enum": ["http", "https"]},
    },
    "required": ["port"],
}
METADATA = {
    "type": "object",
    "required": ["name", "namespace"],
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", "maxLength": 253}
    },
}


def _kind(kind: str, spec: dict) -> dict:
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "kind": {"const": kind},
            "metadata": METADATA,
            "spec": spec,
        },
    }


MONITORING_SCHEMAS = {
    "ServiceMonitor": _kind(
        "ServiceMonitor",
        {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "endpoints"],
            "properties": {
                "selector": LABEL_SELECTOR,
                "namespaceSelector": NS_SELECTOR,
                "podTargetLabels": {"type": "array", "items": {"type": "string"}},
                "endpoints": {"type": "array", "minItems": 1, "items": ENDPOINT},
            },
        },
    ),
    "PodMonitor": _kind(
        "PodMonitor",
        {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "podMetricsEndpoints"],
            "properties": {
                "selector": LABEL_SELECTOR,
                "namespaceSelector": NS_SELECTOR,
                "podTargetLabels": {"type": "array", "items": {"type": "string"}},
                "podMetricsEndpoints": {"type": "array", "minItems": 1, "items": ENDPOINT},
            },
        },
    ),
    "PrometheusRule": _kind(
        "PrometheusRule",
        {
            "type": "object",
            "additionalProperties": False,
            "required": ["groups"],
            "properties": {
                "groups": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["name", "rules"],
                        "properties": {
                            "name": {"type": "string", "minLength": 1},
                            "interval": DURATION,
                            "rules": {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "additionalProperties": False,
                                    "required": ["expr"],
                                    "oneOf": [{"required": ["alert"]}, {"required": ["record"]}],
                                    "properties": {
                                        "alert": {"type": "string", "minLength": 1},
                                        "record": {"type": "string", "minLength": 1},
                                        "expr": {"type": "string", "minLength": 1},
                                        "for": DURATION,
                                        "labels": STR_MAP,
                                        "annotations": STR_MAP,
                                    },
                                },
                            },
                        },
                    },
                }
            },
        },
    ),
}


def render(values: dict | None = None) -> list[dict]:
    chart = helm.Chart.load(str(CHART))
    out = chart.render(values, name="kuberl", namespace="kuberl-system", is_install=True)
    return [d for text in out.values() for d in yaml.safe_load_all(text) if d]


def _validate(obj: dict) -> None:
    if obj["apiVersion"] == "monitoring.coreos.com/v1":
        jsonschema.validate(obj, MONITORING_SCHEMAS[obj["kind"]])
    else:
        kubernetes_validate.validate(obj, "1.33", strict=True)


@pytest.fixture(scope="module")
def objects() -> list[dict]:
    return render()


def test_every_rendered_object_is_valid(objects):
    kinds = sorted(o["kind"] for o in objects)
    assert kinds == sorted(
        [
            "ServiceAccount",
            "ClusterRole",
            "ClusterRoleBinding",
            "Deployment",
            "ServiceMonitor",
            "PrometheusRule",
        ]
        + ["PodMonitor"] * 3
        + ["ConfigMap"] * 3
    )
    for obj in objects:
        _validate(obj)


def test_monitoring_schemas_reject_malformed_objects(objects):
    by_kind = {o["kind"]: o for o in objects}
    bad = json.loads(json.dumps(by_kind["ServiceMonitor"]))
    bad["spec"]["endpoints"][0]["interval"] = "often"
    bad2 = json.loads(json.dumps(by_kind["PodMonitor"]))
    del bad2["spec"]["selector"]
    bad3 = json.loads(json.dumps(by_kind["PrometheusRule"]))
    bad3["spec"]["groups"][0]["rules"][0]["exprs"] = bad3["spec"]["groups"][0]["rules"][0].pop("expr")
    bad4 = json.loads(json.dumps(by_kind["PrometheusRule"]))
    bad4["spec"]["groups"][0]["rules"][0]["record"] = "x"
    for b in (bad, bad2, bad3, bad4):
        with pytest.raises(jsonschema.ValidationError):
            _validate(b)
    broken = json.loads(json.dumps(by_kind["Deployment"]))
    broken["spec"]["replicas"] = "one"
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(broken)


def test_chart_crds_equal_generated_crds():
    chart_crds = {p.name: p.read_text() for p in (CHART / "crds").glob("*.yaml")}
    repo_crds = {p.name: p.read_text() for p in (ROOT / "crds").glob("*.yaml")}
    assert chart_crds == repo_crds, (
        "charts/kuberl/crds/ is stale: run `kuberl crds` (writes crds/ and the chart copy)"
    )
    loaded = helm.Chart.load(str(CHART)).crds
    assert len(loaded) == 3
    for text in chart_crds.values():
        kubernetes_validate.validate(yaml.safe_load(text), "1.33", strict=True)


def test_rbac_is_the_operators_least_privilege(objects):
    role = next(o for o in objects if o["kind"] == "ClusterRole")
    assert role["rules"] == operator_rbac_rules()
    flat = [
        (g, r, v)
        for rule in role["rules"]
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    ]
    assert all("*" not in x for t in flat for x in t)
    for res in ("agenticrljobs/status", "sandboxpools/scale", "pods", "services", "deployments", "statefulsets",
                "jobs", "configmaps", "networkpolicies", "events", "customresourcedefinitions", "namespaces"):  # fmt: skip
        assert any(r == res for _, r, _ in flat), res
    binding = next(o for o in objects if o["kind"] == "ClusterRoleBinding")
    sa = next(o for o in objects if o["kind"] == "ServiceAccount")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": "kuberl-system"}
    ]
    dep = next(o for o in objects if o["kind"] == "Deployment")
    pod = dep["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == sa["metadata"]["name"]
    c = pod["containers"][0]
    assert c["command"] + c["args"] == ["kuberl", "operator", "--all-namespaces"]
    assert pod["securityContext"]["runAsNonRoot"] is True and c["securityContext"]["readOnlyRootFilesystem"]


def test_dashboards_configmaps_carry_the_generated_json(objects):
    cms = [o for o in objects if o["kind"] == "ConfigMap"]
    want = rendered_dashboards()
    got = {}
    for cm in cms:
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        got.update(cm["data"])
    assert {k: json.loads(v) for k, v in got.items()} == {k: json.loads(v) for k, v in want.items()}


def test_release_label_and_namespaces_are_configurable():
    objs = render(
        {
            "monitoring": {"release": "prom", "prometheusRule": {"enabled": False}},
            "operator": {"watchAllNamespaces": False, "namespaces": ["rl-a", "rl-b"]},
            "dashboards": {"enabled": False},
        }
    )
    mons = [o for o in objs if o["apiVersion"] == "monitoring.coreos.com/v1"]
    assert {o["kind"] for o in mons} == {"ServiceMonitor", "PodMonitor"}
    assert all(o["metadata"]["labels"]["release"] == "prom" for o in mons)
    assert not any(o["kind"] == "ConfigMap" for o in objs)
    dep = next(o for o in objs if o["kind"] == "Deployment")
    assert dep["spec"]["template"]["spec"]["containers"][0]["args"] == [
        "--namespace=rl-a",
        "--namespace=rl-b",
    ]
    for obj in objs:
        _validate(obj)


def test_watching_some_namespaces_grants_roles_there_only():
    objs = render({"operator": {"watchAllNamespaces": False, "namespaces": ["rl-a", "rl-b"]}})
    for obj in objs:
        _validate(obj)
    sa = next(o for o in objs if o["kind"] == "ServiceAccount")["metadata"]["name"]
    roles = {o["metadata"]["namespace"]: o for o in objs if o["kind"] == "Role"}
    bindings = {o["metadata"]["namespace"]: o for o in objs if o["kind"] == "RoleBinding"}
    assert set(roles) == set(bindings) == {"rl-a", "rl-b"}
    for ns, role in roles.items():
        assert role["rules"] == operator_namespaced_rules()
        assert bindings[ns]["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": role["metadata"]["name"],
        }
        assert bindings[ns]["subjects"] == [
            {"kind": "ServiceAccount", "name": sa, "namespace": "kuberl-system"}
        ]
    # The ClusterRole keeps only what has no namespace: kopf's scans of namespaces and CRDs.
    cluster = next(o for o in objs if o["kind"] == "ClusterRole")
    assert cluster["rules"] == operator_cluster_rules(admission=False)
    assert {r for rule in cluster["rules"] for r in rule["resources"]} == {
        "namespaces",
        "customresourcedefinitions",
    }
    # No namespaces listed: the release namespace is watched, with its Role.
    objs = render({"operator": {"watchAllNamespaces": False}})
    assert [o["metadata"]["namespace"] for o in objs if o["kind"] == "Role"] == ["kuberl-system"]
    dep = next(o for o in objs if o["kind"] == "Deployment")
    assert dep["spec"]["template"]["spec"]["containers"][0]["args"] == ["--namespace=kuberl-system"]


def _env(container: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", [])}


def test_operator_metrics_are_exposed_and_scraped(objects):
    dep = next(o for o in objects if o["kind"] == "Deployment")
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "metrics", "containerPort": 8080, "protocol": "TCP"} in c["ports"]
    assert _env(c)["KUBERL_OPERATOR_METRICS_PORT"] == "8080"
    mon = next(
        o for o in objects if o["kind"] == "PodMonitor" and o["metadata"]["name"].endswith("-operator")
    )
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert mon["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert mon["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    # The workloads' monitors carry the instance label KEDA queries select on.
    for o in objects:
        if o["kind"] in ("ServiceMonitor", "PodMonitor") and not o["metadata"]["name"].endswith("-operator"):
            assert o["spec"]["podTargetLabels"] == ["app.kubernetes.io/instance"]


def test_admission_is_off_by_default(objects):
    assert not any(o["kind"] in ("Service", "Secret") for o in objects)
    role = next(o for o in objects if o["kind"] == "ClusterRole")
    assert not any("validatingwebhookconfigurations" in r["resources"] for r in role["rules"])
    dep = next(o for o in objects if o["kind"] == "Deployment")
    assert not any(
        k.startswith("KUBERL_WEBHOOK") for k in _env(dep["spec"]["template"]["spec"]["containers"][0])
    )


def test_admission_enabled_is_deployable():
    from cryptography import x509

    objs = render({"admission": {"enabled": True}})
    for obj in objs:
        _validate(obj)
    by_kind = {o["kind"]: o for o in objs}
    svc, secret, dep = by_kind["Service"], by_kind["Secret"], by_kind["Deployment"]
    pod = dep["spec"]["template"]
    c = pod["spec"]["containers"][0]
    # The Service reaches the operator pod's webhook port.
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert svc["spec"]["ports"] == [
        {"name": "webhook", "port": 443, "targetPort": "webhook", "protocol": "TCP"}
    ]
    assert {"name": "webhook", "containerPort": 9443, "protocol": "TCP"} in c["ports"]
    # The operator, started with this environment, announces exactly this Service.
    server = webhook_server_from_env(_env(c))
    assert isinstance(server, ServiceWebhookServer)
    assert (server.service, server.namespace, server.service_port, server.port) == (
        svc["metadata"]["name"],
        "kuberl-system",
        443,
        9443,
    )
    mount = next(m for m in c["volumeMounts"] if m["name"] == "webhook-tls")
    assert all(
        _env(c)[f"KUBERL_WEBHOOK_{k}"].startswith(mount["mountPath"] + "/") for k in ("CERT", "KEY", "CA")
    )
    vol = next(v for v in pod["spec"]["volumes"] if v["name"] == "webhook-tls")
    assert vol["secret"]["secretName"] == secret["metadata"]["name"]
    # The generated certificate is for the Service's DNS names and signed by the bundled CA.
    decode = lambda k: x509.load_pem_x509_certificate(base64.b64decode(secret["data"][k]))  # noqa: E731
    cert, ca = decode("tls.crt"), decode("ca.crt")
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.DNSName
    )
    assert f"{svc['metadata']['name']}.kuberl-system.svc" in sans
    cert.verify_directly_issued_by(ca)
    # Webhook configurations are cluster-scoped and kopf keeps them current: granted only now.
    role = by_kind["ClusterRole"]
    assert role["rules"] == operator_rbac_rules(admission=True)
    # A Secret of one's own (e.g. from cert-manager) replaces the generated one.
    objs = render({"admission": {"enabled": True, "certSecret": "webhook-cert"}})
    assert not any(o["kind"] == "Secret" for o in objs)
    dep = next(o for o in objs if o["kind"] == "Deployment")
    vol = next(v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "webhook-tls")
    assert vol["secret"]["secretName"] == "webhook-cert"


@pytest.mark.parametrize(
    "values",
    [
        {"monitoring": {"interval": "often"}},
        {"operator": {"replicas": 2}},
        {"monitoring": {"prometheusRule": {"kvCacheSaturation": 1.5}}},
        {"operator": {"imagee": {}}},
        {"admission": {"enabled": "yes"}},
        {"admission": {"port": 70000}},
        {"operator": {"metricsPort": "http"}},
    ],
)
def test_values_schema_rejects_bad_values(values):
    with pytest.raises(helm.HelmError):
        render(values)


def test_lint_is_clean():
    report = helm.lint(str(CHART), strict=True)
    assert report["errors"] == [] and not [m for m in report["messages"] if m["severity"] >= 2], report


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian package prometheus) missing")
def test_alert_rules_pass_promtool_and_use_catalogued_metrics(objects, tmp_path):
    rule = next(o for o in objects if o["kind"] == "PrometheusRule")
    names = {r["alert"] for g in rule["spec"]["groups"] for r in g["rules"]}
    assert names == {"KuberlSandboxErrorRatioHigh", "KuberlKVCacheSaturated", "KuberlRewardCollapse"}
    for g in rule["spec"]["groups"]:
        for r in g["rules"]:
            assert check_expression(r["expr"]) == [], r["expr"]
    f = tmp_path / "rules.yaml"
    f.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    res = subprocess.run(["promtool", "check", "rules", str(f)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    f.write_text(yaml.safe_dump({"groups": [{"name": "x", "rules": [{"alert": "A", "expr": "rate(x[5m]"}]}]}))
    assert (
        subprocess.run(["promtool", "check", "rules", str(f)], capture_output=True, timeout=60).returncode
        != 0
    )
