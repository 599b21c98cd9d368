"""The pure parts of `kuberl cluster` and of the vLLM install: build module, nodes, kwok stages,
kubeconfigs, the error that names what to install."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from kuberl.cluster import build, nodes
from kuberl.cluster.control_plane import kubeconfig_text
from kuberl.cluster.errors import ClusterError
from kuberl.rollout.vllm_env import requirements_without_torch
from kuberl.rollout.vllm_server import STOP_GRACE_S, stop_grace_s

KUBERNETES_GO_MOD = """module k8s.io/kubernetes

go 1.24.0

require (
\tk8s.io/api v0.0.0
\tk8s.io/client-go v0.0.0
)

replace (
\tk8s.io/api => ./staging/src/k8s.io/api
\tk8s.io/client-go => ./staging/src/k8s.io/client-go
\tk8s.io/kube-openapi => k8s.io/kube-openapi v0.0.0-2025
)
"""


def test_staging_modules_are_replaced_by_their_releases():
    assert build.staging_replacements(KUBERNETES_GO_MOD, "v1.34.4") == [
        ("k8s.io/api", "v0.34.4"),
        ("k8s.io/client-go", "v0.34.4"),
    ]
    with pytest.raises(ClusterError, match="v1.MINOR.PATCH"):
        build.staging_replacements(KUBERNETES_GO_MOD, "1.34")
    with pytest.raises(ClusterError, match="no staging modules"):
        build.staging_replacements("module x\n", "v1.34.4")


def test_build_module_go_mod():
    text = build.go_mod("kuberl.local/kubernetes", "1.24.0", [("k8s.io/kubernetes", "v1.34.4")],
                        [("k8s.io/api", "v0.34.4")])
    assert "require (\n\tk8s.io/kubernetes v1.34.4\n)" in text
    assert "\tk8s.io/api => k8s.io/api v0.34.4\n" in text
    assert text.startswith("module kuberl.local/kubernetes\n\ngo 1.24.0\n")


def test_version_stamps_name_the_release():
    flags = build.kubernetes_ldflags("v1.34.4")
    assert "-X k8s.io/component-base/version.gitVersion=v1.34.4" in flags
    assert "-X k8s.io/component-base/version.gitMinor=34" in flags


def test_a_missing_go_names_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setattr(shutil, "which", lambda _: None)
    monkeypatch.setattr(build, "Path", lambda p: tmp_path / "absent" if p == "/usr/local/go/bin/go" else Path(p))
    with pytest.raises(ClusterError, match=r"needs Go 1\.26 or newer.*install Go"):
        build.find_go()


def test_an_old_go_is_refused(monkeypatch):
    monkeypatch.setattr(build, "go_version", lambda go: (1, 22))
    monkeypatch.setattr(shutil, "which", lambda _: "/usr/bin/go")
    with pytest.raises(ClusterError, match="is 1.22: install a newer Go"):
        build.find_go()


def test_nodes_carry_the_labels_taints_and_gpus_the_operator_schedules_by():
    pools = nodes.default_pools(mi300x=1, h100=1, cpu=1)
    by_name = {n["metadata"]["name"]: n for n in nodes.node_manifests(pools)}
    assert set(by_name) == {"mi300x-0", "h100-0", "cpu-0"}
    amd = by_name["mi300x-0"]
    assert amd["status"]["allocatable"]["amd.com/gpu"] == "8"
    assert amd["metadata"]["labels"]["amd.com/gpu.product-name"] == "AMD_Instinct_MI300X_OAM"
    assert amd["spec"]["taints"] == [{"key": "amd.com/gpu", "value": "present", "effect": "NoSchedule"}]
    assert by_name["h100-0"]["status"]["capacity"]["nvidia.com/gpu"] == "8"
    cpu = by_name["cpu-0"]
    assert "taints" not in cpu["spec"] and "amd.com/gpu" not in cpu["status"]["capacity"]
    assert all(n["metadata"]["annotations"][nodes.KWOK_NODE_ANNOTATION] == "fake" for n in by_name.values())


def test_kwok_completes_job_pods_only_when_told(tmp_path):
    complete = tmp_path / "pod-complete.yaml"
    complete.write_text(yaml.safe_dump({
        "apiVersion": "kwok.x-k8s.io/v1alpha1", "kind": "Stage", "metadata": {"name": "pod-complete"},
        "spec": {"selector": {"matchExpressions": [{"key": ".status.phase", "operator": "In", "values": ["Running"]}]}},
    }))
    ready = tmp_path / "pod-ready.yaml"
    ready.write_text(yaml.safe_dump({"apiVersion": "kwok.x-k8s.io/v1alpha1", "kind": "Stage",
                                     "metadata": {"name": "pod-ready"}, "spec": {"selector": {}}}))
    stages = list(yaml.safe_load_all(nodes.kwok_config([ready, complete])))
    assert [s["metadata"]["name"] for s in stages] == ["pod-ready", "pod-complete"]
    exprs = stages[1]["spec"]["selector"]["matchExpressions"]
    assert exprs[-1] == {"key": f'.metadata.labels["{nodes.COMPLETE_LABEL}"]', "operator": "In", "values": ["true"]}
    assert stages[0]["spec"]["selector"] == {}


def test_kubeconfig_by_certificate_or_token(tmp_path):
    ca = tmp_path / "ca.crt"
    cert = yaml.safe_load(kubeconfig_text("https://127.0.0.1:6443", ca, "admin", cert=tmp_path / "a.crt",
                                          key=tmp_path / "a.key"))
    assert cert["clusters"][0]["cluster"] == {"server": "https://127.0.0.1:6443", "certificate-authority": str(ca)}
    assert cert["users"][0]["user"] == {"client-certificate": str(tmp_path / "a.crt"),
                                        "client-key": str(tmp_path / "a.key")}
    token = yaml.safe_load(kubeconfig_text("https://x", ca, "sa", token="abc", namespace="kuberl-system"))
    assert token["users"][0]["user"] == {"token": "abc"}
    assert token["contexts"][0]["context"]["namespace"] == "kuberl-system"
    with pytest.raises(ValueError, match="certificate and key, or a token"):
        kubeconfig_text("https://x", ca, "nobody")


def test_vllm_requirements_leave_out_torch_and_other_platforms():
    declared = [
        "regex",
        "transformers<5.20.0,>=5.16.1",
        'torch==2.13.0+cpu; platform_machine == "x86_64"',
        'torchvision; platform_machine != "riscv64"',
        "Torch-Audio",  # not the name of a skipped one: kept
        'intel-openmp==2024.2.1; platform_machine == "x86_64"',
        'zentorch==2.13.0.1; extra == "zen"',
        'xgrammar==0.2.8; platform_machine == "s390x"',
    ]
    import platform

    kept = requirements_without_torch(declared)
    assert "regex" in kept and "transformers<5.20.0,>=5.16.1" in kept and "Torch-Audio" in kept
    assert not any(r.startswith(("torch==", "torchvision", "zentorch")) for r in kept)
    assert ("intel-openmp==2024.2.1" in kept) == (platform.machine() == "x86_64")
    assert ("xgrammar==0.2.8" in kept) == (platform.machine() == "s390x")
    with pytest.raises(ValueError, match="cannot be parsed"):
        requirements_without_torch(["not a requirement ==="])


def test_the_vllm_install_route_runs_as_a_script_without_kuberl(tmp_path):
    """images/rollout/Dockerfile.cpu runs rollout/vllm_env.py before kuberl is installed: a copy
    of it alone, run where only packaging can be imported (no site packages, no kuberl), answers
    (here its usage; no install is started)."""
    import os
    import subprocess
    import sys

    import packaging

    from kuberl.rollout import vllm_env

    script = tmp_path / "vllm_env.py"
    shutil.copy(vllm_env.__file__, script)
    env = {**os.environ, "PYTHONPATH": str(Path(packaging.__file__).parent.parent)}

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-P", "-S", *args], capture_output=True, text=True, timeout=60,
                              cwd=tmp_path, env=env)

    if run("-c", "import kuberl").returncode == 0:
        pytest.skip("kuberl is importable beside packaging here (installed into the same folder)")
    res = run(str(script))
    assert res.returncode == 2 and "usage: python3 -P vllm_env.py VENV" in res.stderr, res.stderr


def test_the_vllm_servers_stop_grace_comes_from_the_environment_or_defaults_to_30_s():
    assert stop_grace_s({}) == STOP_GRACE_S == 30.0
    assert stop_grace_s({"KUBERL_VLLM_STOP_GRACE_S": "5"}) == 5.0
    for bad in ("soon", "-1"):
        with pytest.raises(ValueError, match="KUBERL_VLLM_STOP_GRACE_S"):
            stop_grace_s({"KUBERL_VLLM_STOP_GRACE_S": bad})


def test_pod_ranges_the_api_server_would_refuse_endpoints_from_are_refused():
    from kuberl.cluster.control_plane import POD_CIDR, check_pod_cidr
    from kuberl.cluster.errors import ClusterError

    check_pod_cidr(POD_CIDR)
    check_pod_cidr("198.18.0.0/16")
    for bad, why in (("127.64.0.0/16", "outside loopback"), ("169.254.0.0/16", "outside loopback"),
                     ("10.96.4.0/24", "overlaps the Service range"), ("fd00::/64", "IPv4"),
                     ("10.244.0.1/16", "not a network")):
        with pytest.raises(ClusterError, match=why):
            check_pod_cidr(bad)
