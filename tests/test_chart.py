"""Helm chart charts/kuberl: render offline (helm-python-sdk) and validate every object.

Core objects go through kubernetes-validate (strict, Kubernetes 1.33); prometheus-operator
objects through the real openAPIV3Schemas of their CRDs, vendored under
tests/data/prometheus-operator/ (upstream version and URL in each file), made strict the way the
API server's field validation is (unknown fields rejected); alert expressions through
``promtool check rules`` and every alert's behaviour through ``promtool test rules``; the
chart's CRDs, RBAC and dashboards must equal their sources.
"""

from __future__ import annotations

import base64
import copy
import json
import shutil
import subprocess
from pathlib import Path

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml
from chart_render import MONITORING_API, render

from kuberl.dashboards.cli import rendered as rendered_dashboards
from kuberl.dashboards.metrics_catalog import check_expression
from kuberl.operator.render.rbac import operator_cluster_rules, operator_namespaced_rules, operator_rbac_rules
from kuberl.operator.runtime.main import ServiceWebhookServer, webhook_server_from_env

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "charts" / "kuberl"
CRD_SCHEMAS = ROOT / "tests" / "data" / "prometheus-operator"
CRD_SCHEMA_FILES = {
    "ServiceMonitor": "servicemonitors.schema.yaml",
    "PodMonitor": "podmonitors.schema.yaml",
    "PrometheusRule": "prometheusrules.schema.yaml",
}
# The API server validates ObjectMeta itself (the CRD schema only says `type: object`).
OBJECT_META = {
    "type": "object",
    "required": ["name", "namespace"],
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", "maxLength": 253},
        "namespace": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63},
        "labels": {"type": "object", "additionalProperties": {"type": "string", "maxLength": 63}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    },
}


def python_pattern(go_pattern: str) -> str:
    """A CRD ``pattern`` (Go RE2 syntax) as Python ``re`` accepts it.

    RE2 allows a flag group such as ``(?i)`` after ``^`` (upstream writes ``^(?i)(abort|warn)?$``);
    Python only accepts global flags at the very start, where they mean the same here.
    """
    head, flags, rest = go_pattern.partition("(?i)")
    if not flags or not head:
        return go_pattern
    if head.strip("^"):
        raise ValueError(f"cannot translate the Go pattern {go_pattern!r}")
    return f"(?i){head}{rest}"


def strict(schema: dict) -> dict:
    """A CRD schema as ``kubectl apply`` sees it with field validation Strict (the default since 1.27).

    The API server rejects fields that a structural schema does not declare unless the node has
    ``x-kubernetes-preserve-unknown-fields``; JSON Schema allows them, so every object node with
    ``properties`` and no ``additionalProperties`` gets ``additionalProperties: false``. Patterns
    are translated from Go to Python syntax.
    """
    out = copy.deepcopy(schema)
    nodes = [out]
    while nodes:
        node = nodes.pop()
        if (
            "properties" in node
            and "additionalProperties" not in node
            and not node.get("x-kubernetes-preserve-unknown-fields")
        ):
            node["additionalProperties"] = False
        if "pattern" in node:
            node["pattern"] = python_pattern(node["pattern"])
        nodes.extend(node.get("properties", {}).values())
        nodes.extend(node[k] for k in ("items", "additionalProperties") if isinstance(node.get(k), dict))
        nodes.extend(s for k in ("anyOf", "allOf", "oneOf") for s in node.get(k, []))
    return out


def crd_schema(kind: str) -> dict:
    """The vendored openAPIV3Schema of one monitoring.coreos.com/v1 kind, strict, with ObjectMeta checks."""
    schema = strict(yaml.safe_load((CRD_SCHEMAS / CRD_SCHEMA_FILES[kind]).read_text())["openAPIV3Schema"])
    schema["properties"]["apiVersion"] = {"const": "monitoring.coreos.com/v1"}
    schema["properties"]["kind"] = {"const": kind}
    schema["properties"]["metadata"] = OBJECT_META
    schema["required"] = sorted({*schema.get("required", []), "apiVersion", "kind", "metadata"})
    return schema


MONITORING_SCHEMAS = {kind: crd_schema(kind) for kind in CRD_SCHEMA_FILES}


def _validate(obj: dict) -> None:
    if obj["apiVersion"] == "monitoring.coreos.com/v1":
        if obj["kind"] not in MONITORING_SCHEMAS:
            raise jsonschema.ValidationError(f"no monitoring.coreos.com/v1 kind {obj['kind']!r} in this test")
        jsonschema.Draft7Validator(MONITORING_SCHEMAS[obj["kind"]]).validate(obj)
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
            "Role",  # the leader-election Lease
            "RoleBinding",
            "Deployment",
            "ServiceMonitor",
            "PrometheusRule",
        ]
        + ["PodMonitor"] * 3
        + ["ConfigMap"] * 3
    )
    for obj in objects:
        _validate(obj)


def test_vendored_crd_schemas_are_the_upstream_ones():
    """The vendored files name their upstream version and carry the fields the chart relies on."""
    for kind, name in CRD_SCHEMA_FILES.items():
        text = (CRD_SCHEMAS / name).read_text()
        assert "github.com/prometheus-operator/prometheus-operator/blob/" in text, name
        doc = yaml.safe_load(text)
        assert doc["x-prometheus-operator-version"].startswith("0."), name
        jsonschema.Draft7Validator.check_schema(MONITORING_SCHEMAS[kind])
    spec = MONITORING_SCHEMAS["ServiceMonitor"]["properties"]["spec"]
    assert spec["required"] == ["endpoints", "selector"]
    endpoint = spec["properties"]["endpoints"]["items"]["properties"]
    assert {"port", "path", "interval", "honorLabels", "tlsConfig", "relabelings"} <= set(endpoint)
    rule = MONITORING_SCHEMAS["PrometheusRule"]["properties"]["spec"]["properties"]["groups"]["items"]
    assert rule["required"] == ["name"] and rule["properties"]["rules"]["items"]["required"] == ["expr"]


def test_monitoring_schemas_reject_malformed_objects(objects):
    by_kind = {o["kind"]: o for o in objects}

    def broken(kind: str, edit) -> dict:
        obj = json.loads(json.dumps(by_kind[kind]))
        edit(obj)
        return obj

    bad = [
        broken("ServiceMonitor", lambda o: o["spec"]["endpoints"][0].update(interval="often")),
        broken("ServiceMonitor", lambda o: o["spec"]["endpoints"][0].update(scheme="ftp")),
        broken(
            "ServiceMonitor", lambda o: o["spec"]["endpoints"][0].update(intervall="15s")
        ),  # unknown field
        broken("ServiceMonitor", lambda o: o["spec"].pop("endpoints")),
        broken("PodMonitor", lambda o: o["spec"].pop("selector")),
        broken("PodMonitor", lambda o: o["spec"]["podMetricsEndpoints"][0].update(portNumber=70000)),
        broken("PodMonitor", lambda o: o["spec"]["selector"].update(matchLabels={"a": 1})),
        broken("PodMonitor", lambda o: o.update(kind="PodMonitors")),
        broken(
            "PrometheusRule",
            lambda o: o["spec"]["groups"][0]["rules"][0].update(
                exprs=o["spec"]["groups"][0]["rules"][0].pop("expr")
            ),
        ),  # fmt: skip
        broken("PrometheusRule", lambda o: o["spec"]["groups"][0]["rules"][0].update({"for": "10 minutes"})),
        broken("PrometheusRule", lambda o: o["spec"]["groups"][0].update(name="")),
        broken("PrometheusRule", lambda o: o["metadata"].update(name="Kuberl_Rules")),
    ]
    for b in bad:
        with pytest.raises(jsonschema.ValidationError):
            _validate(b)
    dep = json.loads(json.dumps(by_kind["Deployment"]))
    dep["spec"]["replicas"] = "one"
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(dep)


def test_go_patterns_keep_their_meaning(objects):
    """Upstream's RE2 ``^(?i)(abort|warn)?$`` still matches case-insensitively after translation."""
    rule = next(o for o in objects if o["kind"] == "PrometheusRule")
    for value, ok in (("warn", True), ("ABORT", True), ("", True), ("maybe", False)):
        obj = json.loads(json.dumps(rule))
        obj["spec"]["groups"][0]["partial_response_strategy"] = value
        if ok:
            _validate(obj)
        else:
            with pytest.raises(jsonschema.ValidationError):
                _validate(obj)
    assert python_pattern("^(?i)(a|b)$") == "(?i)^(a|b)$"
    assert python_pattern("^[a-z]+$") == "^[a-z]+$"
    with pytest.raises(ValueError):
        python_pattern("x(?i)y")


def test_operator_pod_monitor_selects_the_operator_pods(objects):
    mon = next(
        o for o in objects if o["kind"] == "PodMonitor" and o["metadata"]["name"].endswith("-operator")
    )
    dep = next(o for o in objects if o["kind"] == "Deployment")
    template_labels = dep["spec"]["template"]["metadata"]["labels"]
    selector = mon["spec"]["selector"]["matchLabels"]
    assert selector.items() <= template_labels.items()
    assert selector["app.kubernetes.io/component"] == "operator"
    assert mon["spec"]["namespaceSelector"] == {"matchNames": [dep["metadata"]["namespace"]]}
    # The other kuberl monitors must not pick the operator up (and this one no workload pods).
    for other in objects:
        if other["kind"] in ("PodMonitor", "ServiceMonitor") and other is not mon:
            assert not other["spec"]["selector"]["matchLabels"].items() <= template_labels.items()
    (endpoint,) = mon["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
    ports = [p for c in dep["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])]
    if ports:  # the Deployment declares its ports: the scraped one must be among them
        assert "metrics" in {p.get("name") for p in ports}, ports
    off = render({"monitoring": {"operatorMonitor": {"enabled": False}}})
    assert not any(
        o["metadata"]["name"].endswith("-kuberl-operator") and o["kind"] == "PodMonitor" for o in off
    )
    assert sum(o["kind"] == "PodMonitor" for o in off) == 2


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
    for res in ("agenticrljobs/status", "sandboxpools/scale", "pods", "services", "deployments", "secrets",
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
    leader = lambda o: o["metadata"]["name"].endswith("-leader")  # noqa: E731 - the Lease's Role
    roles = {o["metadata"]["namespace"]: o for o in objs if o["kind"] == "Role" and not leader(o)}
    bindings = {o["metadata"]["namespace"]: o for o in objs if o["kind"] == "RoleBinding" and not leader(o)}
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
    assert cluster["rules"] == operator_cluster_rules()
    assert {r for rule in cluster["rules"] for r in rule["resources"]} == {
        "namespaces",
        "customresourcedefinitions",
    }
    # No namespaces listed: the release namespace is watched, with its Role.
    objs = render({"operator": {"watchAllNamespaces": False}})
    assert [o["metadata"]["name"] for o in objs if o["kind"] == "Role"] == [
        "kuberl-kuberl-operator",
        "kuberl-kuberl-operator-leader",
    ]
    dep = next(o for o in objs if o["kind"] == "Deployment")
    assert dep["spec"]["template"]["spec"]["containers"][0]["args"] == ["--namespace=kuberl-system"]


def test_kueue_enabled_grants_the_integrations_rbac_and_nothing_by_default(objects):
    kueue_rules = lambda rules: [r for r in rules if "kueue.x-k8s.io" in r["apiGroups"]]  # noqa: E731
    role = next(o for o in objects if o["kind"] == "ClusterRole")
    assert kueue_rules(role["rules"]) == []
    assert not any(o["metadata"]["name"].endswith("-kueue") for o in objects)
    objs = render({"kueue": {"enabled": True}})
    for obj in objs:
        _validate(obj)
    roles = {o["metadata"]["name"]: o for o in objs if o["kind"] == "ClusterRole"}
    assert roles["kuberl-kuberl-operator"]["rules"] == operator_rbac_rules(kueue=True)
    granted = _flat_rules(kueue_rules(roles["kuberl-kuberl-operator"]["rules"]))
    assert ("kueue.x-k8s.io", "workloads/status", "patch") in granted
    assert ("kueue.x-k8s.io", "localqueues", "get") in granted
    # list and watch on Workloads only (the operator's watch of them); nothing is updated
    assert {(r, v) for _, r, v in granted if v in ("update", "watch", "list")} == {
        ("workloads", "list"), ("workloads", "watch")}
    env = {e["name"]: e.get("value") for e in next(o for o in objs if o["kind"] == "Deployment")
           ["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env.get("KUBERL_KUEUE") == "1"
    # Kueue's manager reads the owners of the Workloads and child Jobs it holds
    assert _flat_rules(roles["kuberl-kuberl-operator-kueue"]["rules"]) == {
        ("kuberl.io", "agenticrljobs", v) for v in ("get", "list", "watch")}
    binding = next(o for o in objs if o["kind"] == "ClusterRoleBinding" and o["metadata"]["name"].endswith("-kueue"))
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "kueue-controller-manager",
                                    "namespace": "kueue-system"}]
    # watching some namespaces: the Workload rules go into each Role, the flavor reads stay cluster-wide
    objs = render({"kueue": {"enabled": True}, "operator": {"watchAllNamespaces": False, "namespaces": ["rl-a"]}})
    role = next(o for o in objs if o["kind"] == "Role" and o["metadata"]["namespace"] == "rl-a")
    assert role["rules"] == operator_namespaced_rules(kueue=True)
    cluster = next(o for o in objs if o["kind"] == "ClusterRole" and o["metadata"]["name"] == "kuberl-kuberl-operator")
    assert cluster["rules"] == operator_cluster_rules(kueue=True)


def _env(container: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


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
    # The chart owns the webhook configurations: the operator gets no access to any of them.
    role = by_kind["ClusterRole"]
    assert role["rules"] == operator_rbac_rules()
    assert not any(g == "admissionregistration.k8s.io" for r in role["rules"] for g in r["apiGroups"])
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
        {"operator": {"replicas": 9}},
        {"operator": {"replicas": 2, "leaderElection": {"enabled": False}}},
        {"monitoring": {"prometheusRule": {"kvCacheSaturation": 1.5}}},
        {"monitoring": {"operatorMonitor": {"enabled": "yes"}}},
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


NEEDS_PROMTOOL = pytest.mark.skipif(
    shutil.which("promtool") is None, reason="promtool (Debian package prometheus) missing"
)


def rule_groups(objects: list[dict]) -> list[dict]:
    return next(o for o in objects if o["kind"] == "PrometheusRule")["spec"]["groups"]


def promtool(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=120, cwd=tmp_path)


@NEEDS_PROMTOOL
def test_alert_rules_pass_promtool_and_use_catalogued_metrics(objects, tmp_path):
    groups = rule_groups(objects)
    names = {r["alert"] for g in groups for r in g["rules"]}
    assert names == {"KuberlSandboxErrorRatioHigh", "KuberlKVCacheSaturated", "KuberlRewardCollapse"}
    for g in groups:
        for r in g["rules"]:
            assert check_expression(r["expr"]) == [], r["expr"]
    f = tmp_path / "rules.yaml"
    f.write_text(yaml.safe_dump({"groups": groups}))
    res = promtool(tmp_path, "check", "rules", str(f))
    assert res.returncode == 0, res.stdout + res.stderr
    broken = json.loads(json.dumps(groups))
    broken[0]["rules"][0]["record"] = "kuberl:both"  # an alert and a record at once
    for bad in ([{"name": "x", "rules": [{"alert": "A", "expr": "rate(x[5m]"}]}], broken):
        f.write_text(yaml.safe_dump({"groups": bad}))
        assert promtool(tmp_path, "check", "rules", str(f)).returncode != 0, bad


# promtool unit tests of every alert, for the chart's default thresholds (sandbox error ratio 0.2,
# KV cache 0.95, reward below 0.5 of its 1h max and that max above 0.1; `for: 10m` each). Samples
# are one minute apart; `a+bxN` is N+1 samples a, a+b, ...; an alert is listed only once firing.
def _description(groups: list[dict], alert: str) -> str:
    return next(r for g in groups for r in g["rules"] if r.get("alert") == alert)["annotations"][
        "description"
    ]


def alert_tests(groups: list[dict]) -> list[dict]:
    """(input series, expected firing alerts) per alert: fires above threshold after `for:`, not below."""
    sandbox, kv, reward = "KuberlSandboxErrorRatioHigh", "KuberlKVCacheSaturated", "KuberlRewardCollapse"

    def firing(alert: str, labels: dict, summary: str) -> dict:
        return {"exp_labels": labels, "exp_annotations": {"summary": summary, "description": _description(groups, alert)}}  # fmt: skip

    calls = "kuberl_tool_calls_total"
    return [
        {  # pool a: (20 errors + 10 timeouts + 5 memory kills) of 95 calls a minute = 36.8% > 20%
            "interval": "1m",
            "input_series": [
                {"series": f'{calls}{{pool="a",outcome="stdout"}}', "values": "0+60x40"},
                {"series": f'{calls}{{pool="a",outcome="error"}}', "values": "0+20x40"},
                {"series": f'{calls}{{pool="a",outcome="timeout"}}', "values": "0+10x40"},
                {"series": f'{calls}{{pool="a",outcome="memory_limit"}}', "values": "0+5x40"},
                {"series": f'{calls}{{pool="b",outcome="stdout"}}', "values": "0+95x40"},
                {"series": f'{calls}{{pool="b",outcome="error"}}', "values": "0+5x40"},
            ],
            "alert_rule_test": [
                # true from 1m (rate needs two samples): pending until 11m
                {"eval_time": "10m", "alertname": sandbox, "exp_alerts": []},
                {
                    "eval_time": "12m",
                    "alertname": sandbox,
                    "exp_alerts": [
                        firing(
                            sandbox,
                            {"severity": "warning", "pool": "a"},
                            "Sandbox pool a: 36.84% of tool calls fail",
                        )
                    ],
                },  # fmt: skip
                {
                    "eval_time": "40m",
                    "alertname": sandbox,
                    "exp_alerts": [
                        firing(
                            sandbox,
                            {"severity": "warning", "pool": "a"},
                            "Sandbox pool a: 36.84% of tool calls fail",
                        )
                    ],
                },  # fmt: skip
            ],
        },
        {  # 10% errors, and verifier/no_stdout outcomes, never count as failing
            "interval": "1m",
            "input_series": [
                {"series": f'{calls}{{pool="c",outcome="stdout"}}', "values": "0+80x60"},
                {"series": f'{calls}{{pool="c",outcome="no_stdout"}}', "values": "0+10x60"},
                {"series": f'{calls}{{pool="c",outcome="error"}}', "values": "0+10x60"},
            ],
            "alert_rule_test": [
                {"eval_time": t, "alertname": sandbox, "exp_alerts": []} for t in ("15m", "60m")
            ],
        },
        {  # e0 at 97% for 30 minutes; e1 at 50%
            "interval": "1m",
            "input_series": [
                {"series": 'kuberl_rollout_kv_cache_utilization{engine="e0"}', "values": "0.97x30"},
                {"series": 'kuberl_rollout_kv_cache_utilization{engine="e1"}', "values": "0.5x30"},
            ],
            "alert_rule_test": [
                {"eval_time": "9m", "alertname": kv, "exp_alerts": []},
                {
                    "eval_time": "11m",
                    "alertname": kv,
                    "exp_alerts": [
                        firing(
                            kv,
                            {"severity": "warning", "engine": "e0"},
                            "Rollout engine e0: KV cache 97% reserved",
                        )
                    ],
                },  # fmt: skip
            ],
        },
        {  # e2 at 90% (below 95%) all along; e3 at 99% for only 6 minutes, then 50%
            "interval": "1m",
            "input_series": [
                {"series": 'kuberl_rollout_kv_cache_utilization{engine="e2"}', "values": "0.9x30"},
                {"series": 'kuberl_rollout_kv_cache_utilization{engine="e3"}', "values": "0.99x5 0.5x24"},
            ],
            "alert_rule_test": [
                {"eval_time": t, "alertname": kv, "exp_alerts": []} for t in ("8m", "12m", "30m")
            ],
        },
        {  # run-a: reward 0.6 for 21 minutes, then 0.2 (< 0.5 x 0.6): true from 21m, firing from 31m
            "interval": "1m",
            "input_series": [{"series": 'kuberl_train_reward_mean{job="run-a"}', "values": "0.6x20 0.2x40"}],
            "alert_rule_test": [
                {"eval_time": "30m", "alertname": reward, "exp_alerts": []},
                {
                    "eval_time": "32m",
                    "alertname": reward,
                    "exp_alerts": [
                        firing(
                            reward,
                            {"severity": "critical", "job": "run-a"},
                            "Job run-a: reward collapsed to 0.2",
                        )
                    ],
                },  # fmt: skip
            ],
        },
        {  # run-b drops only to 0.35 (> 0.3); run-c never exceeded the 0.1 floor
            "interval": "1m",
            "input_series": [
                {"series": 'kuberl_train_reward_mean{job="run-b"}', "values": "0.6x20 0.35x40"},
                {"series": 'kuberl_train_reward_mean{job="run-c"}', "values": "0.08x20 0.01x40"},
            ],
            "alert_rule_test": [
                {"eval_time": t, "alertname": reward, "exp_alerts": []} for t in ("35m", "60m")
            ],
        },
    ]


def run_rule_tests(tmp_path: Path, groups: list[dict], tests: list[dict]) -> subprocess.CompletedProcess:
    """``promtool test rules`` of `tests` against the chart's rendered rule groups."""
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}))
    spec = {"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": tests}
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    return promtool(tmp_path, "test", "rules", "tests.yaml")


@NEEDS_PROMTOOL
def test_every_alert_fires_above_threshold_after_its_for_duration_and_not_below(objects, tmp_path):
    groups = rule_groups(objects)
    assert {r["for"] for g in groups for r in g["rules"]} == {"10m"}
    tests = alert_tests(groups)
    alerts = {r["alert"] for g in groups for r in g["rules"] if "alert" in r}
    fired = {c["alertname"] for t in tests for c in t["alert_rule_test"] if c["exp_alerts"]}
    silent = {c["alertname"] for t in tests for c in t["alert_rule_test"] if not c["exp_alerts"]}
    assert fired == silent == alerts, "every alert needs a firing and a silent case"
    res = run_rule_tests(tmp_path, groups, tests)
    assert res.returncode == 0, res.stdout + res.stderr


@NEEDS_PROMTOOL
def test_alert_thresholds_and_for_come_from_values(objects, tmp_path):
    """e2's 90% KV cache is below the default 95% (a test expecting it to fire fails), above 85%."""
    case = {
        "interval": "1m",
        "input_series": [{"series": 'kuberl_rollout_kv_cache_utilization{engine="e2"}', "values": "0.9x30"}],
        "alert_rule_test": [
            {"eval_time": "4m", "alertname": "KuberlKVCacheSaturated", "exp_alerts": []},
            {
                "eval_time": "6m",
                "alertname": "KuberlKVCacheSaturated",
                "exp_alerts": [{"exp_labels": {"severity": "warning", "engine": "e2"}}],
            },
        ],
    }
    custom = rule_groups(render({"monitoring": {"prometheusRule": {"kvCacheSaturation": 0.85, "for": "5m"}}}))
    kv_rule = next(r for g in custom for r in g["rules"] if r["alert"] == "KuberlKVCacheSaturated")
    kv_rule.pop("annotations")  # this case is about the threshold and `for:`, not the wording
    res = run_rule_tests(tmp_path, custom, [case])
    assert res.returncode == 0, res.stdout + res.stderr
    defaults = json.loads(json.dumps(rule_groups(objects)))
    for g in defaults:
        for r in g["rules"]:
            r.pop("annotations")
    res = run_rule_tests(tmp_path, defaults, [case])
    assert res.returncode != 0 and "KuberlKVCacheSaturated" in res.stdout + res.stderr, res.stdout


# --- issue 14: what a real cluster does that offline rendering hid ------------------------------


def _flat_rules(rules: list[dict]) -> set[tuple[str, str, str]]:
    return {
        (g, r, v)
        for rule in rules
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }


def test_rbac_grants_owner_finalizers_and_nothing_unused(objects):
    """kopf.adopt sets blockOwnerDeletion: true on every child; where the API server enforces
    owner-reference permission (OpenShift) that needs `update` on the owner's finalizers. Nothing
    the operator never calls is granted: no StatefulSets, no jobs' scale (the CRD has none), no PUT,
    no watch on children."""
    role = next(o for o in objects if o["kind"] == "ClusterRole")
    flat = _flat_rules(role["rules"])
    for plural in ("agenticrljobs", "rolloutfleets", "sandboxpools"):
        assert ("kuberl.io", f"{plural}/finalizers", "update") in flat
    assert not any(r == "statefulsets" for _, r, _ in flat)
    assert ("kuberl.io", "agenticrljobs/scale", "patch") not in flat
    assert not any(v == "update" and not r.endswith("/finalizers") for _, r, v in flat)
    for _, r, v in flat:
        if r in (
            "deployments",
            "jobs",
            "services",
            "configmaps",
            "secrets",
            "leaderworkersets",
            "networkpolicies",
        ):
            assert v != "watch", r


def _selects(selector: dict, labels: dict) -> bool:
    """metav1.LabelSelector semantics (matchLabels and In/NotIn/Exists/DoesNotExist)."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for e in selector.get("matchExpressions", []):
        have = e["key"] in labels
        value = labels.get(e["key"])
        ok = {
            "In": have and value in e.get("values", []),
            "NotIn": not have or value not in e.get("values", []),
            "Exists": have,
            "DoesNotExist": not have,
        }[e["operator"]]
        if not ok:
            return False
    return True


def test_monitors_need_prometheus_operator_crds():
    """A plain install on a cluster without prometheus-operator: no monitoring objects at all
    (they would fail the install with "no matches for kind"), everything else still there."""
    objs = render(api_versions=())
    assert not any(o["apiVersion"] == MONITORING_API for o in objs)
    assert {"Deployment", "ClusterRole", "ServiceAccount"} <= {o["kind"] for o in objs}
    assert any(o["apiVersion"] == MONITORING_API for o in render())


def test_pod_monitors_select_only_pods_that_serve_metrics(objects):
    """Only trainer rank 0 serves /metrics (the other ranks would be TargetDown), and only the
    leader of an engine spanning nodes serves HTTP (LeaderWorkerSet workers serve nothing)."""
    from kuberl.api import parse_resource
    from kuberl.operator.render.builders import build_for

    mons = {o["metadata"]["name"].rsplit("-", 1)[-1]: o["spec"] for o in objects if o["kind"] == "PodMonitor"}
    job = parse_resource(
        {
            "apiVersion": "kuberl.io/v1alpha1",
            "kind": "AgenticRLJob",
            "metadata": {"name": "j", "namespace": "ns"},
            "spec": {
                "model": {"base": "m"},
                "data": {"train": "s3://d/train.jsonl"},
                "trainer": {"replicas": 3},
                "rollout": {"engine": "local"},
                "sandbox": {"poolRef": "p"},
            },
        }
    )
    trainer = next(o for o in build_for(job) if o["kind"] == "Job")
    pod_labels = trainer["spec"]["template"]["metadata"]["labels"]
    # the Job controller labels each pod of an Indexed Job with its completion index
    ranks = [{**pod_labels, "batch.kubernetes.io/job-completion-index": str(i)} for i in range(3)]
    assert [_selects(mons["trainer"]["selector"], r) for r in ranks] == [True, False, False]
    fleet = parse_resource(
        {
            "apiVersion": "kuberl.io/v1alpha1",
            "kind": "RolloutFleet",
            "metadata": {"name": "big", "namespace": "ns"},
            "spec": {"model": {"uri": "m"}, "engine": {"tensorParallel": 16}, "accelerator": {"count": 8}},
        }
    )
    lws = next(o for o in build_for(fleet) if o["kind"] == "LeaderWorkerSet")
    tmpl = lws["spec"]["leaderWorkerTemplate"]
    assert _selects(mons["rollout"]["selector"], tmpl["leaderTemplate"]["metadata"]["labels"])
    assert not _selects(mons["rollout"]["selector"], tmpl["workerTemplate"]["metadata"]["labels"])
    single = parse_resource({**fleet.wire(), "spec": {"model": {"uri": "m"}}})
    dep = next(o for o in build_for(single) if o["kind"] == "Deployment")
    assert _selects(mons["rollout"]["selector"], dep["spec"]["template"]["metadata"]["labels"])


def test_chart_owns_the_webhook_configurations():
    """helm uninstall / admission.enabled=false removes them (kopf-written ones stayed behind and
    blocked every write of kuberl objects). They point at exactly the operator's handlers, trust
    the generated CA, fail closed only for validation, and bound the wait."""
    from kuberl.operator.runtime.context import OperatorConfig
    from kuberl.operator.runtime.registry import build_registry

    objs = render({"admission": {"enabled": True}})
    for obj in objs:
        _validate(obj)
    by_kind = {o["kind"]: o for o in objs}
    secret, svc = by_kind["Secret"], by_kind["Service"]
    registry, _ = build_registry(OperatorConfig(admission=True))
    handler_ids = {h.id for h in registry._webhooks.get_all_handlers()}
    paths = set()
    for kind, policy in (
        ("ValidatingWebhookConfiguration", "Fail"),
        ("MutatingWebhookConfiguration", "Ignore"),
    ):
        cfg = by_kind[kind]
        for hook in cfg["webhooks"]:
            ref = hook["clientConfig"]["service"]
            assert (ref["name"], ref["namespace"], ref["port"]) == (
                svc["metadata"]["name"],
                "kuberl-system",
                443,
            )
            assert hook["clientConfig"]["caBundle"] == secret["data"]["ca.crt"]
            assert hook["failurePolicy"] == policy and hook["timeoutSeconds"] <= 15
            assert hook["sideEffects"] == "None" and hook["rules"][0]["operations"] == ["CREATE", "UPDATE"]
            paths.add(ref["path"].lstrip("/"))
    assert paths == handler_ids
    # Off: neither configuration nor Service is rendered.
    assert not any("Webhook" in o["kind"] for o in render())
    # Watching some namespaces: the webhooks only look at those.
    objs = render(
        {"admission": {"enabled": True}, "operator": {"watchAllNamespaces": False, "namespaces": ["rl"]}}
    )
    cfg = next(o for o in objs if o["kind"] == "ValidatingWebhookConfiguration")
    for hook in cfg["webhooks"]:
        assert hook["namespaceSelector"]["matchExpressions"] == [
            {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["rl"]}
        ]
    # Own certificate: the CA comes from values (or cert-manager's injector).
    objs = render(
        {"admission": {"enabled": True, "certSecret": "own", "certManagerInjectFrom": "kuberl-system/own"}}
    )
    cfg = next(o for o in objs if o["kind"] == "MutatingWebhookConfiguration")
    assert cfg["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == "kuberl-system/own"


def test_operator_pod_probes_and_leader_election(objects):
    """Ready = kopf's liveness endpoint (leader only: webhook traffic reaches the leader);
    alive = /livez in every replica; the operator serves both where the chart says, and with
    leader election its environment names a Lease it may read and write (a Role, no more)."""
    from kuberl.operator.render.rbac import leader_election_rules
    from kuberl.operator.runtime.main import (
        DEFAULT_HEALTH_PORT,
        DEFAULT_LIVENESS_PORT,
        election_from_env,
        liveness_endpoint,
    )

    dep = next(o for o in objects if o["kind"] == "Deployment")
    c = dep["spec"]["template"]["spec"]["containers"][0]
    env = _env(c)
    health, live = int(env["KUBERL_HEALTH_PORT"]), int(env["KUBERL_LIVENESS_PORT"])
    assert (health, live) == (DEFAULT_HEALTH_PORT, DEFAULT_LIVENESS_PORT)
    assert {"name": "health", "containerPort": health, "protocol": "TCP"} in c["ports"]
    assert {"name": "live", "containerPort": live, "protocol": "TCP"} in c["ports"]
    assert c["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert liveness_endpoint(health).endswith(f":{health}/healthz")
    assert c["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "live"}
    election = election_from_env(
        {**env, "KUBERL_LEASE_NAMESPACE": "kuberl-system", "KUBERL_POD_NAME": "op-1"}
    )
    assert election is not None and (election.name, election.identity) == (dep["metadata"]["name"], "op-1")
    downward = {e["name"]: e.get("valueFrom") for e in c["env"]}
    assert downward["KUBERL_LEASE_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    assert downward["KUBERL_POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    role = next(o for o in objects if o["kind"] == "Role")
    assert role["metadata"]["namespace"] == "kuberl-system" and role["rules"] == leader_election_rules()
    binding = next(o for o in objects if o["kind"] == "RoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert dep["spec"]["strategy"]["type"] == "RollingUpdate"
    # standbys: more replicas are allowed; without election only one, replaced by Recreate
    assert (
        next(o for o in render({"operator": {"replicas": 2}}) if o["kind"] == "Deployment")["spec"][
            "replicas"
        ]
        == 2
    )
    off = render({"operator": {"leaderElection": {"enabled": False}}})
    dep = next(o for o in off if o["kind"] == "Deployment")
    assert dep["spec"]["strategy"]["type"] == "Recreate" and not any(o["kind"] == "Role" for o in off)
    assert election_from_env(_env(dep["spec"]["template"]["spec"]["containers"][0])) is None
