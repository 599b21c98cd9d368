"""The API models, the generated CRDs, the examples and the invalid-manifest corpus."""

import asyncio
import copy
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import builders
import jsonschema
import kubernetes_validate
import pytest
import yaml

import kuberl
from kuberl.api import AgenticRLJob, ManifestError, Resource, SandboxPool, load_manifests, parse_resource
from kuberl.api.crdgen import CEL_RULES, ROOT_RULES, all_crds, render, stale_crds
from kuberl.api.loader import load_documents
from kuberl.cli import main
from kuberl.operator.validate import admission
from kuberl.operator.validate.checks import check_file
from tests.apiserver_emulation import admission_errors, compile_rule

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
INVALID = sorted((REPO / "examples" / "invalid").glob("*.yaml"))
CRDS = list(all_crds().values())


def _run_installed(site: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """Python with the unpacked wheel ahead of everything else, outside the checkout."""
    env = {**os.environ, "PYTHONPATH": str(site)}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True)


def test_wheel_installs_only_the_kuberl_package(installed_wheel):
    assert sorted(p.name for p in installed_wheel.iterdir()) == [
        "kuberl",
        f"kuberl-{kuberl.__version__}.dist-info",
    ]
    for component in ("api", "operator", "sandbox", "rollout", "trainer", "dashboards", "util"):
        assert (installed_wheel / "kuberl" / component / "__init__.py").is_file(), component


def test_stdlib_operator_not_shadowed(installed_wheel, tmp_path):
    # Evict the stdlib module the interpreter imported at start-up, then ask the import system
    # afresh: with the installed kuberl first on sys.path, `operator` must still be the stdlib's.
    code = (
        "import sys, importlib.util; sys.modules.pop('operator', None); "
        "print(importlib.util.find_spec('operator').origin); "
        "import kuberl.operator; print(kuberl.operator.__file__)"
    )
    proc = _run_installed(installed_wheel, tmp_path, "-c", code)
    assert proc.returncode == 0, proc.stderr
    stdlib_origin, component = proc.stdout.split()
    assert Path(stdlib_origin) == Path(sysconfig.get_paths()["stdlib"]) / "operator.py"
    assert Path(component) == installed_wheel / "kuberl" / "operator" / "__init__.py"


def test_crds_outside_a_source_checkout_need_out(installed_wheel, tmp_path):
    proc = _run_installed(installed_wheel, tmp_path, "-m", "kuberl", "crds")
    assert proc.returncode == 2
    assert "not a kuberl source checkout" in proc.stderr and "--out DIR" in proc.stderr
    assert not list(installed_wheel.rglob("*.kuberl.io.yaml")), "wrote CRDs into site-packages"
    proc = _run_installed(installed_wheel, tmp_path, "-m", "kuberl", "crds", "--out", "out")
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(all_crds())


def test_paper_defaults():
    job = parse_resource(
        {
            "apiVersion": "kuberl.io/v1alpha1",
            "kind": "AgenticRLJob",
            "metadata": {"name": "j"},
            "spec": {"model": {"base": "m"}, "data": {"train": "d"}},
        }
    )
    a = job.spec.algorithm
    assert (a.name, a.group_size, a.oversample, a.rollouts_per_prompt) == ("grpo-roc", 16, 2.0, 32)
    assert (a.clip.low, a.clip.high, a.kl_coef, a.entropy_coef) == (0.2, 0.28, 0.0, 0.0)
    assert (a.loss_aggregation, a.learning_rate, a.warmup_steps) == ("token-mean", 1e-6, 20)
    assert job.spec.rollout.temperature == 1.0
    rl = [s for s in job.spec.stages if s.type == "rl"]
    assert [job.spec.stage_max_response_tokens(s) for s in rl] == [8192, 12288, 12288]
    assert [s.steps for s in rl] == [300, 85, 125]
    assert rl[-1].difficulty_filter.rollouts == 8 and rl[-1].reset_optimizer
    assert job.spec.stages[0].type == "sft"
    assert job.spec.trainer.accelerator.profile == "mi300x"


def test_plain_grpo_does_not_oversample():
    algo = builders.job(algorithm={"name": "grpo"}).spec.algorithm
    assert (algo.oversample, algo.rollouts_per_prompt) == (1.0, 16)
    assert builders.job(algorithm={"name": "grpo", "oversample": 1}).spec.algorithm.oversample == 1
    assert builders.job(algorithm={"oversample": 1.5}).spec.algorithm.rollouts_per_prompt == 24
    with pytest.raises(ValueError, match=r"algorithm.oversample \(3\) needs name: grpo-roc"):
        builders.job(algorithm={"name": "grpo", "oversample": 3})


def test_kind_names_are_class_constants_not_fields():
    assert set(Resource.model_fields) == {"api_version", "metadata"}
    for kind in (AgenticRLJob, SandboxPool):
        assert not {"KIND", "PLURAL", "SHORT_NAMES"} & set(kind.model_fields)
    with pytest.raises(ValueError, match="unknown field 'KIND'"):
        parse_resource(
            {
                "apiVersion": "kuberl.io/v1alpha1",
                "kind": "SandboxPool",
                "metadata": {"name": "p"},
                "KIND": "x",
            }
        )
    assert "KIND" not in _crd_schema("SandboxPool")["properties"]


def test_response_budget_must_fit_the_inline_fleet_context():
    fleet = {"engine": {"contextLength": 16384}}
    ok = builders.job(rollout={"maxResponseTokens": 8192, "fleet": fleet})  # the paper's stages: 8K, 12K, 12K
    assert ok.spec.response_budgets_over_context() == []
    # An sft stage never calls the engine; a fleetRef's context length is not known here.
    assert builders.job(
        rollout={"maxResponseTokens": 100, "fleet": {"engine": {"contextLength": 256}}},
        stages=[{"name": "sft", "type": "sft", "steps": 1, "maxResponseTokens": 9999}],
    )
    assert builders.job(rollout={"fleetRef": "f", "maxResponseTokens": 10**6})
    with pytest.raises(
        ValueError, match=r"reach it: stage 'stage-2' has 12288; stage 'stage-3' has 12288 \["
    ):
        builders.job(rollout={"maxResponseTokens": 4096, "fleet": {"engine": {"contextLength": 12288}}})


def test_wire_roundtrip_uses_camel_case():
    pool = SandboxPool.model_validate({"metadata": {"name": "p"}, "spec": {"limits": {"memoryMB": 256}}})
    wire = pool.wire()
    assert wire["spec"]["limits"]["memoryMB"] == 256 and "workersPerPod" in wire["spec"]
    assert SandboxPool.model_validate(wire) == pool


def test_crds_are_up_to_date():
    assert stale_crds(REPO / "crds") == [], "crds/ is stale: run `kuberl crds`"


def test_crd_check_detects_staleness(tmp_path):
    assert main(["crds", "--out", str(tmp_path)]) == 0
    assert main(["crds", "--check", "--out", str(tmp_path)]) == 0
    victim = next(tmp_path.glob("sandboxpools*"))
    victim.write_text(victim.read_text().replace("workersPerPod", "workersPerNode"))
    assert main(["crds", "--check", "--out", str(tmp_path)]) == 1


def test_orphaned_crd_files_are_stale_and_removed(tmp_path):
    """A CRD file of a kind that is no longer generated would still be applied by
    `kubectl apply -f crds/` and by Helm."""
    assert main(["crds", "--out", str(tmp_path)]) == 0
    orphan = tmp_path / "oldkinds.kuberl.io.yaml"
    orphan.write_text(next(tmp_path.glob("sandboxpools*")).read_text())
    unrelated = tmp_path / "values.yaml"  # not written by `kuberl crds`: neither stale nor removed
    unrelated.write_text("a: 1\n")
    assert stale_crds(tmp_path) == ["oldkinds.kuberl.io.yaml"]
    assert main(["crds", "--check", "--out", str(tmp_path)]) == 1
    assert main(["crds", "--out", str(tmp_path)]) == 0
    assert not orphan.exists() and unrelated.exists()
    assert stale_crds(tmp_path) == []


@pytest.mark.parametrize("name", sorted(all_crds()))
def test_crd_is_valid_kubernetes_object(name):
    crd = all_crds()[name]
    kubernetes_validate.validate(crd, "1.33", strict=True)  # raises on any violation
    broken = yaml.safe_load(yaml.safe_dump(crd))
    broken["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["minimum"] = "zero"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, "1.33", strict=True)


def _structural_violations(node, path="schema"):
    """Kubernetes structural-schema rules that kubernetes-validate does not check."""
    bad = []
    if isinstance(node, dict):
        if "$ref" in node or "anyOf" in node and "x-kubernetes-int-or-string" not in node:
            bad.append(f"{path}: $ref/anyOf")
        if "properties" in node and node.get("type") != "object":
            bad.append(f"{path}: properties without type object")
        if not ({"type", "x-kubernetes-int-or-string", "x-kubernetes-preserve-unknown-fields"} & node.keys()):
            bad.append(f"{path}: no type")
        if node.get("additionalProperties") is False:
            bad.append(f"{path}: additionalProperties false")
        for key in ("properties",):
            for k, v in node.get(key, {}).items():
                bad += _structural_violations(v, f"{path}.{k}")
        for key in ("items", "additionalProperties"):
            if isinstance(node.get(key), dict):
                bad += _structural_violations(node[key], f"{path}[{key}]")
    return bad


@pytest.mark.parametrize("name", sorted(all_crds()))
def test_crd_schema_is_structural(name):
    crd = all_crds()[name]
    version = crd["spec"]["versions"][0]
    assert _structural_violations(version["schema"]["openAPIV3Schema"]) == []
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]
    assert status["x-kubernetes-preserve-unknown-fields"] is True


def test_scale_subresources():
    crds = {c["spec"]["names"]["kind"]: c for c in all_crds().values()}
    for kind in ("SandboxPool", "RolloutFleet"):
        scale = crds[kind]["spec"]["versions"][0]["subresources"]["scale"]
        assert scale == {
            "specReplicasPath": ".spec.replicas",
            "statusReplicasPath": ".status.replicas",
            "labelSelectorPath": ".status.selector",
        }
    assert "scale" not in crds["AgenticRLJob"]["spec"]["versions"][0]["subresources"]
    assert crds["AgenticRLJob"]["spec"]["names"]["shortNames"] == ["arj"]
    assert crds["SandboxPool"]["spec"]["names"]["shortNames"] == ["sbx"]
    assert crds["RolloutFleet"]["spec"]["names"]["shortNames"] == ["rf"]


def _crd_schema(kind):
    crd = next(c for c in all_crds().values() if c["spec"]["names"]["kind"] == kind)
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def _merge(base: dict, patch: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


MINIMAL_SPECS = {
    "SandboxPool": {},
    "RolloutFleet": {"model": {"uri": "m"}},
    "AgenticRLJob": {"model": {"base": "m"}, "data": {"train": "d"}},
}


def _doc(kind: str, spec_patch: dict) -> dict:
    return {
        "apiVersion": "kuberl.io/v1alpha1",
        "kind": kind,
        "metadata": {"name": "x"},
        "spec": _merge(MINIMAL_SPECS[kind], spec_patch),
    }


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_are_admitted_by_the_generated_crds(path):
    for doc in load_documents(path):
        jsonschema.Draft4Validator(_crd_schema(doc["kind"])).validate(doc)
        assert admission_errors(CRDS, doc) == []
        # What the models fill in (e.g. oversample 1 for grpo) must satisfy the CRD's rules too.
        assert admission_errors(CRDS, parse_resource(doc).wire()) == []
    assert main(["validate", str(path)]) == 0


@pytest.mark.parametrize("kind", sorted(MINIMAL_SPECS))
def test_minimal_manifests_are_valid_for_both(kind):
    doc = _doc(kind, {})
    assert admission_errors(CRDS, doc) == []
    parse_resource(doc)


# Values of the wrong JSON type. Lax pydantic coerced most of these ("3" -> 3, true -> 1); the
# CRD's schema refuses them, so `kuberl validate` must refuse them too.
TYPE_WRONG = [
    ("SandboxPool", {"replicas": "3"}),
    ("SandboxPool", {"replicas": True}),
    ("SandboxPool", {"replicas": 2.5}),
    ("SandboxPool", {"workersPerPod": "2"}),
    ("SandboxPool", {"image": 7}),
    ("SandboxPool", {"limits": {"timeoutSeconds": "5"}}),
    ("SandboxPool", {"limits": {"memoryMB": "512"}}),
    ("SandboxPool", {"autoscaling": {"targetQueuePerWorker": "4"}}),
    ("RolloutFleet", {"engine": {"tensorParallel": "2"}}),
    ("RolloutFleet", {"engine": {"memFractionStatic": "0.8"}}),
    ("RolloutFleet", {"engine": {"contextLength": "8192"}}),
    ("RolloutFleet", {"engine": {"extraArgs": "--foo"}}),
    ("RolloutFleet", {"engine": {"extraArgs": [1]}}),
    ("RolloutFleet", {"accelerator": {"count": True}}),
    ("RolloutFleet", {"autoscaling": {"targetKVCacheUtilization": "high"}}),
    ("AgenticRLJob", {"suspend": "yes"}),
    ("AgenticRLJob", {"suspend": 1}),
    ("AgenticRLJob", {"seed": "0"}),
    ("AgenticRLJob", {"model": {"base": 123}}),
    ("AgenticRLJob", {"data": {"eval": "s3://x"}}),
    ("AgenticRLJob", {"algorithm": {"groupSize": "16"}}),
    ("AgenticRLJob", {"algorithm": {"learningRate": "1e-6"}}),
    ("AgenticRLJob", {"algorithm": {"clip": {"low": "0.2"}}}),
    ("AgenticRLJob", {"rollout": {"tools": "python"}}),
    ("AgenticRLJob", {"rollout": {"temperature": "1.0"}}),
    ("AgenticRLJob", {"stages": {"name": "rl", "type": "rl", "steps": 1}}),
    ("AgenticRLJob", {"stages": [{"name": "rl", "type": "rl", "steps": "10"}]}),
    ("AgenticRLJob", {"checkpoint": {"everySteps": 1.5}}),
]


@pytest.mark.parametrize(("kind", "patch"), TYPE_WRONG, ids=lambda v: v if isinstance(v, str) else repr(v))
def test_wrong_types_are_rejected_by_models_and_crd(kind, patch):
    doc = _doc(kind, patch)
    assert [layer for layer, _ in admission_errors(CRDS, doc)] == ["schema"]
    with pytest.raises(ManifestError, match=r"Input should be a valid"):
        parse_resource(doc)


def test_floats_are_numbers_even_without_a_dot(tmp_path):
    """kubectl reads `1e-6` as a number; PyYAML (YAML 1.1) would read a string, which strict
    models then reject."""
    path = tmp_path / "job.yaml"
    path.write_text(
        yaml.safe_dump(_doc("AgenticRLJob", {})) + "---\n"
        "apiVersion: kuberl.io/v1alpha1\nkind: AgenticRLJob\nmetadata: {name: y}\n"
        "spec: {model: {base: m}, data: {train: d}, algorithm: {learningRate: 1e-6, clip: {high: 3E-1}}}\n"
    )
    job = load_manifests(path)[1]
    assert (job.spec.algorithm.learning_rate, job.spec.algorithm.clip.high) == (1e-6, 0.3)


# Which API-server check rejects each invalid manifest when only the generated CRDs are installed
# (no admission webhook): served (no CRD serves that apiVersion/kind), fields (strict field
# validation, kubectl's default), schema (OpenAPI), list-type (duplicate map keys), cel
# (x-kubernetes-validations), yaml (kubectl cannot parse it either), json (kubectl cannot encode
# it: NaN, infinity), metadata (ObjectMeta's own validation), children (the server takes the
# kuberl object but refuses a child the operator makes of it). An empty set marks a rule that only
# `kuberl validate` and the admission webhook enforce (operator/validate/feasibility.py: settings
# under which a run cannot learn or start, documents read together). Every corpus file must be
# listed, so such a gap cannot appear without this table saying so. The real API server's verdict
# on every file is tests/test_k8s_validate.py's; the emulator below covers the CRD layers only.
APISERVER_REJECTS: dict[str, set[str]] = {
    "accelerator.yaml": {"schema"},
    "autoscale-from-zero.yaml": {"schema"},
    "autoscaling-order.yaml": {"cel"},
    "bad-name.yaml": {"schema"},
    "bad-quantity.yaml": {"schema"},
    "digit-name.yaml": {"schema"},
    "long-job-name.yaml": {"cel"},
    "both-fleets.yaml": {"cel"},
    "both-pools.yaml": {"cel"},
    "clip-order.yaml": {"cel"},
    "context-length-rollout.yaml": {"cel"},
    "context-length.yaml": {"cel"},
    "duplicate-stages.yaml": {"list-type"},
    "grpo-oversample.yaml": {"cel"},
    "inline-pool-bounds.yaml": {"cel"},
    "mini-batches.yaml": {"cel"},
    "missing-model.yaml": {"schema"},
    "negative-ratio-cap.yaml": {"cel"},
    "not-yaml.yaml": {"yaml"},
    "replicas-bounds.yaml": {"cel"},
    "sandbox-from-zero.yaml": {"schema"},
    "sft-filter.yaml": {"cel"},
    "stage-steps.yaml": {"schema"},
    "tp-one-gpu-pods.yaml": {"cel"},
    "tp-span.yaml": {"cel"},
    "unknown-field.yaml": {"fields"},
    "wrong-kind.yaml": {"served"},
    "wrong-type.yaml": {"schema"},
    "wrong-version.yaml": {"served"},
    "annotation-key-invalid.yaml": {"metadata"},
    "finalizer-invalid.yaml": {"metadata"},
    "float-for-integer.yaml": {"schema"},
    "inf-float.yaml": {"json"},
    "job-without-spec.yaml": {"schema"},
    "label-key-invalid.yaml": {"metadata"},
    "label-value-too-long.yaml": {"metadata"},
    "name-with-dot.yaml": {"schema"},
    "nan-float.yaml": {"json"},
    "owner-ref-invalid.yaml": {"metadata"},
    "pool-without-spec.yaml": {"schema"},
    "port-name-digits.yaml": {"children"},
    "probe-port-numeric-string.yaml": {"children"},
    "requests-over-limits.yaml": {"children"},
    "toleration-exists-with-value.yaml": {"children"},
    "topology-spread-bad-when.yaml": {"children"},
    "topology-spread-skew-zero.yaml": {"children"},
    "container-port-name-dup.yaml": {"children"},
    "dns-policy-none-no-config.yaml": {"children"},
    "fsgroup-policy-bad.yaml": {"children"},
    "preemption-bad.yaml": {"children"},
    "resources-limit-extended-fraction.yaml": {"children"},
    "sysctl-invalid.yaml": {"children"},
    "length-target-over-budget.yaml": {"cel"},
    "length-instruction-no-target.yaml": {"cel"},
    "greedy-decoding.yaml": set(),
    "greedy-decoding-grpo.yaml": set(),
    "roc-nothing-to-resample.yaml": set(),
    "roc-oversample-rounds-away.yaml": set(),
    "stage-batch-under-minibatches.yaml": set(),
    "tp-idle-gpus.yaml": set(),
    "tp-idle-gpus-inline.yaml": set(),
    "tp-not-power-of-two.yaml": set(),
    "tp-span-not-power-of-two.yaml": set(),
    "fleet-ref-engine-mismatch.yaml": set(),
    "fleet-ref-engine-mismatch-sglang.yaml": set(),
    "fleet-ref-no-weight-sync.yaml": set(),
    "inline-fleet-no-weight-sync.yaml": set(),
    "partial-rollouts-synchronous.yaml": set(),
    "partial-rollouts-sglang.yaml": set(),
    "fleet-ref-zero-replicas.yaml": set(),
    "inline-fleet-zero-replicas.yaml": set(),
    "pool-ref-zero-replicas.yaml": set(),
    "inline-pool-zero-replicas.yaml": set(),
    "near-greedy-temperature.yaml": set(),
    "near-greedy-top-p.yaml": set(),
    "stage-response-budget-no-answer.yaml": set(),
    "response-budget-no-answer.yaml": set(),
    "learning-rate-vanishes.yaml": set(),
    "stage-learning-rate-vanishes.yaml": set(),
    "fleet-ref-other-model.yaml": set(),
    "inline-fleet-other-model.yaml": set(),
    "trainer-cuda-on-cpu-pods.yaml": set(),
    "builtin-model-on-vllm.yaml": set(),
    "builtin-model-on-fleet-ref.yaml": set(),
    "hugepages-request-below-limit.yaml": {"children"},
    "hugepages-not-whole-pages.yaml": {"children"},
    "hugepages-without-limit.yaml": {"children"},
    "hugepages-without-cpu-or-memory.yaml": {"children"},
}
EMULATED_LAYERS = {"served", "fields", "schema", "list-type", "cel", "yaml"}
# What the CRDs admit: refused by kuberl's own rules or by the API server only on a child the
# operator makes; the admission webhook refuses each at apply time (tests/test_real_node_operator.py
# sends them through a real API server to the operator's pod)
SCHEMA_ADMITS = sorted(name for name, layers in APISERVER_REJECTS.items() if layers <= {"children"})


def _apiserver_verdict(path: Path) -> tuple[set[str], list[str]]:
    try:
        docs = load_documents(path)
    except ManifestError as err:
        if "not valid YAML" not in str(err):
            raise
        return {"yaml"}, [str(err)]
    errors = [e for doc in docs for e in admission_errors(CRDS, doc)]
    return {layer for layer, _ in errors}, [msg for _, msg in errors]


def test_every_invalid_manifest_has_a_recorded_apiserver_verdict():
    assert sorted(p.name for p in INVALID) == sorted(APISERVER_REJECTS)


@pytest.mark.parametrize("name", SCHEMA_ADMITS)
def test_what_only_kuberl_refuses_parses_and_the_webhook_refuses_alike(name):
    """A file the CRDs admit is refused by kuberl's own rules or its rendered children's, which the
    admission webhook shares: each resource parses, and the webhook refuses the one validate
    refuses with the same words (a cross-field rule of the model refuses the file as it loads)."""
    path = REPO / "examples" / "invalid" / name
    expected = re.search(r"^# expect: (.+)$", path.read_text(), re.M).group(1).strip()
    docs = {(d["kind"], d["metadata"]["name"]): d for d in load_documents(path)}

    async def lookup(kind: str, namespace: str, name: str) -> dict | None:
        return docs.get((kind, name))

    said = [e for d in docs.values() for e in asyncio.run(admission.validation_errors(d, lookup))]
    try:
        verdicts = [p for v in check_file(load_manifests(path)) for p in v.problems]
    except ManifestError as err:
        verdicts = [str(err)]
    assert any(expected in p for p in verdicts), verdicts
    # the webhook names a live fleet by namespace/name where validate names the one in the file
    assert any(expected.replace("RolloutFleet ", "RolloutFleet default/") in e or expected in e for e in said), said


# kubectl never sends a manifest it cannot encode as JSON: nothing for the CRD layers to judge
SENT = [p for p in INVALID if "json" not in APISERVER_REJECTS.get(p.name, set())]


@pytest.mark.parametrize("path", SENT, ids=lambda p: p.name)
def test_invalid_corpus_against_the_generated_crds(path):
    expected = APISERVER_REJECTS[path.name]
    layers, messages = _apiserver_verdict(path)
    assert layers == expected & EMULATED_LAYERS, messages
    assert not any("evaluating" in m for m in messages), messages  # a CEL rule that errors is a bug


def test_every_cel_rule_compiles_and_fires_on_the_corpus():
    rules = [r for by_path in CEL_RULES.values() for rs in by_path.values() for r in rs]
    # transition rules (oldSelf) need an update to run: tests/test_operator_runs.py exercises them
    rules += [r for rs in ROOT_RULES.values() for r in rs if "oldSelf" not in r["rule"]]
    for rule in rules:
        compile_rule(rule["rule"])
    fired = {m.split(": ", 1)[1] for p in INVALID for m in _apiserver_verdict(p)[1] if ": " in m}
    unexercised = sorted({r["message"] for r in rules} - fired)
    assert unexercised == [], "add an examples/invalid/ manifest that breaks each rule"


def test_crd_rules_are_where_the_api_server_enforces_them():
    spec = _crd_schema("AgenticRLJob")["properties"]["spec"]
    stages = spec["properties"]["stages"]
    assert stages["x-kubernetes-list-type"] == "map" and stages["x-kubernetes-list-map-keys"] == ["name"]
    assert stages["items"]["properties"]["steps"]["minimum"] == 1 and stages["maxItems"] >= 4
    assert "name" in stages["items"]["required"]  # list-map keys must be required
    assert "default" not in spec["properties"]["algorithm"]["properties"]["oversample"]
    for kind in ("SandboxPool", "RolloutFleet"):
        auto = _crd_schema(kind)["properties"]["spec"]["properties"]["autoscaling"]
        assert auto["properties"]["minReplicas"]["minimum"] == 1


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.name)
def test_invalid_corpus_rejected_with_expected_message(path, capsys):
    expected = re.search(r"^# expect: (.+)$", path.read_text(), re.M).group(1).strip()
    child = expected.split(":")[0].split("/")[0] in ("Deployment", "Job", "Service", "LeaderWorkerSet")
    if not child and APISERVER_REJECTS[path.name]:
        with pytest.raises(ManifestError) as err:
            load_manifests(path)
        assert expected in str(err.value)
    # else: the resource itself is fine; a child the operator renders from it, or kuberl's own
    # rules (operator/validate/feasibility.py), refuse it
    assert main(["validate", str(path)]) == 1
    assert expected in capsys.readouterr().err


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            {"rollout": {"fleet": {"engine": {"tensorparallel": 2}}}},
            "spec.rollout.fleet.engine.tensorparallel: "
            "unknown field 'tensorparallel'; did you mean 'tensorParallel'?",
        ),
        (
            {"stages": [{"name": "a", "type": "rl", "steps": 1, "maxResponseToken": 3}]},
            "spec.stages[0].maxResponseToken: unknown field 'maxResponseToken'; did you mean 'maxResponseTokens'?",
        ),
        ({"xyz": 1}, "spec.xyz: unknown field 'xyz'; known fields: algorithm, checkpoint, data, model"),
        (
            {"stages": [{"name": "a", "type": "ppo", "steps": 1}]},
            "spec.stages[0].type: unknown stage type 'ppo'; expected one of sft, rl",
        ),
        (
            {"rollout": {"tools": ["bash"]}},
            "spec.rollout.tools[0]: unknown rollout tool 'bash'; expected python",
        ),
        (
            {"algorithm": {"lossAggregation": "sum"}},
            "unknown algorithm loss aggregation 'sum'; expected one of token-mean, seq-mean-token-mean",
        ),
        (
            {"stages": [{"name": "Stage_1", "type": "rl", "steps": 1}]},
            "spec.stages[0].name: must be a lowercase RFC 1123 label",
        ),
        (
            {"sandbox": {"pool": {"resources": {"requests": {"cpu": 0.5}}}}},
            "spec.sandbox.pool.resources.requests.cpu: Input should be a valid integer or a valid string (got float 0.5)",
        ),
    ],
)
def test_error_messages_name_the_field_and_the_fix(spec, message):
    with pytest.raises(ManifestError) as err:
        parse_resource(_doc("AgenticRLJob", spec))
    assert message in str(err.value)


def test_yaml_errors_name_the_file_and_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("apiVersion: kuberl.io/v1alpha1\nkind: SandboxPool\nmetadata: {name: x\n")
    with pytest.raises(ManifestError) as err:
        load_documents(path)
    assert str(err.value).startswith(f"{path}:4:1: not valid YAML: ")
    assert "<unicode string>" not in str(err.value)


def test_validate_missing_file_is_clear(capsys):
    assert main(["validate", "does/not/exist.yaml"]) == 1
    assert "cannot read" in capsys.readouterr().err


def test_render_crds_header():
    text = render(next(iter(all_crds().values())))
    assert text.startswith("# Generated by `kuberl crds`")


def test_engine_type_defaults_to_sglang_and_names_what_conflicts():
    from kuberl.api import AgenticRLJob, RolloutFleet

    fleet = RolloutFleet.model_validate({"metadata": {"name": "f"}, "spec": {"model": {"uri": "m"}}})
    assert fleet.spec.engine.type == "sglang"
    with pytest.raises(ValueError, match="engine.type vllm: engine.tensorParallel \\(16\\) must fit one node"):
        RolloutFleet.model_validate(
            {
                "metadata": {"name": "f"},
                "spec": {
                    "model": {"uri": "m"},
                    "engine": {"type": "vllm", "tensorParallel": 16},
                    "accelerator": {"profile": "mi300x", "count": 8},
                },
            }
        )
    with pytest.raises(ValueError, match="Input should be 'sglang' or 'vllm'"):
        RolloutFleet.model_validate(
            {"metadata": {"name": "f"}, "spec": {"model": {"uri": "m"}, "engine": {"type": "tgi"}}}
        )
    base = {"model": {"base": "m"}, "data": {"train": "x.jsonl"}}
    with pytest.raises(ValueError, match="rollout.engine is vllm but rollout.fleet.engine.type is sglang"):
        AgenticRLJob.model_validate(
            {
                "metadata": {"name": "j"},
                "spec": {**base, "rollout": {"engine": "vllm", "fleet": {"engine": {"type": "sglang"}}}},
            }
        )
