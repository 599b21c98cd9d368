"""The API models, the generated CRDs, the examples and the invalid-manifest corpus."""

import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from kuberl.api import AgenticRLJob, ManifestError, SandboxPool, load_manifests, parse_resource
from kuberl.api.crdgen import all_crds, render, stale_crds
from kuberl.api.loader import load_documents
from kuberl.cli import main

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
INVALID = sorted((REPO / "examples" / "invalid").glob("*.yaml"))


def test_stdlib_operator_not_shadowed():
    out = subprocess.run(
        [sys.executable, "-c", "import operator, kuberl.operator; print(operator.__file__)"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert Path(out).parent != REPO / "operator" and Path(out).name == "operator.py"


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
    job = AgenticRLJob.model_validate(
        {
            "metadata": {"name": "j"},
            "spec": {"model": {"base": "m"}, "data": {"train": "d"}, "algorithm": {"name": "grpo"}},
        }
    )
    assert job.spec.algorithm.rollouts_per_prompt == 16


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


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_validate_against_generated_schema(path):
    for doc in load_documents(path):
        jsonschema.Draft4Validator(_crd_schema(doc["kind"])).validate(doc)
    assert main(["validate", str(path)]) == 0


def test_generated_schema_rejects_what_models_reject():
    doc = yaml.safe_load((REPO / "examples" / "invalid" / "accelerator.yaml").read_text())
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft4Validator(_crd_schema("RolloutFleet")).validate(doc)
    # Structural schemas prune unknown fields rather than reject them (kubectl --validate=strict does).
    assert (
        "groupsize"
        not in _crd_schema("AgenticRLJob")["properties"]["spec"]["properties"]["algorithm"]["properties"]
    )


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.name)
def test_invalid_corpus_rejected_with_expected_message(path, capsys):
    expected = re.search(r"^# expect: (.+)$", path.read_text(), re.M).group(1).strip()
    with pytest.raises(ManifestError) as err:
        load_manifests(path)
    assert expected in str(err.value)
    assert main(["validate", str(path)]) == 1
    assert expected in capsys.readouterr().err


def test_validate_missing_file_is_clear(capsys):
    assert main(["validate", "does/not/exist.yaml"]) == 1
    assert "cannot read" in capsys.readouterr().err


def test_render_crds_header():
    text = render(next(iter(all_crds().values())))
    assert text.startswith("# Generated by `kuberl crds`")
