"""The operator as a pod on the real node: ``ghcr.io/kuberl/kuberl:0.1.0`` (built by kuberl's image
builder, loaded into the node's containerd) installed from the Helm chart (rendered as ``helm
install`` renders it, applied with kubectl) under the chart's ServiceAccount, with
``admission.enabled=true``. The real API server calls its webhook through the chart's Service
(ClusterIP, kube-proxy on the host, the pod's IP over the node's bridge) with the chart's
self-signed CA as the caBundle: every ``examples/invalid/`` manifest the CRDs let through is
refused at ``kubectl apply`` with ``kuberl validate``'s words. The operator pod reconciles a
SandboxPool into 3 serving sandbox pods, and deleting one of them under load loses no call and
runs none twice (the pods' own counters and the deleted pod's last line add up to the calls made).
Needs what the real node needs and buildah + debootstrap (the images are built the first time).
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from k8s_fixtures import OPERATOR_NAMESPACE, wait_for
from node_fixtures import RealNode, load_images, metric_sum, restricted_namespace, start
from operator_pod import (
    POOL,
    chart_objects,
    install_operator,
    operator_logs,
    pool_access,
    pool_manifest,
    serving,
)
from test_api import SCHEMA_ADMITS

from kuberl.api.loader import load_documents
from kuberl.cluster.pki import NODE_NAME
from kuberl.sandbox.service.client import SandboxClient

pytestmark = pytest.mark.node

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def node(tmp_path_factory) -> Iterator[RealNode]:
    yield from start(tmp_path_factory.mktemp("operatornode"))


@pytest.fixture(scope="module")
def operator_pod(node: RealNode) -> dict:
    load_images(node, ["sandbox", "operator"], REPO)
    return install_operator(node)


def test_the_operator_runs_as_a_pod_from_its_image_under_the_charts_service_account(node: RealNode,
                                                                                     operator_pod: dict):
    spec, status = operator_pod["spec"], operator_pod["status"]["containerStatuses"][0]
    assert spec["nodeName"] == NODE_NAME
    assert status["image"].endswith("ghcr.io/kuberl/kuberl:0.1.0") and status["restartCount"] == 0
    sa = next(o for o in chart_objects() if o["kind"] == "ServiceAccount")
    assert spec["serviceAccountName"] == sa["metadata"]["name"]
    # the webhook configuration is the chart's, trusting the chart's CA, pointing at its Service
    hook = node.kube.json("get", "validatingwebhookconfiguration")["items"][0]["webhooks"][0]
    assert hook["clientConfig"]["service"]["namespace"] == OPERATOR_NAMESPACE and hook["clientConfig"]["caBundle"]


def _ordered(path: Path) -> str:
    """The file's documents, what they reference first (kubectl applies in order; a job refused
    for a missing fleet says nothing of the fleet's fit)."""
    docs = load_documents(path)
    return yaml.safe_dump_all(sorted(docs, key=lambda d: d.get("kind") == "AgenticRLJob"))


@pytest.mark.parametrize("name", SCHEMA_ADMITS)
def test_kubectl_apply_of_what_the_crds_let_through_is_refused_by_the_webhook(node: RealNode, operator_pod: dict,
                                                                              name: str):
    path = REPO / "examples" / "invalid" / name
    expected = re.search(r"^# expect: (.+)$", path.read_text(), re.M).group(1).strip()
    ns = "invalid-" + re.sub(r"[^a-z0-9]+", "-", name.removesuffix(".yaml"))[:40].strip("-")
    node.kube.run("create", "namespace", ns)
    refused = node.kube.run("apply", "-n", ns, "-f", "-", input=_ordered(path), check=False)
    said = refused.stderr.replace(f"{ns}/", "")  # the webhook names a live fleet namespace/name
    assert refused.returncode != 0, refused.stdout
    assert 'admission webhook "validate-' in said and "denied the request" in said, said
    assert expected in said, f"kuberl validate says {expected!r}; the API server said:\n{said}"


@pytest.fixture(scope="module")
def pool(node: RealNode, operator_pod: dict) -> str:
    ns = restricted_namespace(node.kube, "sbx")
    node.kube.apply([pool_manifest(ns, 3)])
    wait_for(lambda: len(serving(node, ns)) == 3, 300,
             lambda: node.kube.run("get", "pods", "-n", ns, "-o", "wide", check=False).stdout + operator_logs(node))
    return ns


def test_the_operator_pod_reconciles_a_sandbox_pool_into_serving_pods(node: RealNode, pool: str):
    pods = serving(node, pool)
    assert len(pods) == 3 and {p["spec"]["nodeName"] for p in pods} == {NODE_NAME}
    owner = node.kube.json("get", "deployment", POOL, "-n", pool)["metadata"]["ownerReferences"][0]
    assert owner["kind"] == "SandboxPool" and owner["name"] == POOL
    # the operator (in its pod) wrote the pool's status
    wait_for(lambda: (node.kube.json("get", "sandboxpool", POOL, "-n", pool).get("status") or {})
             .get("readyReplicas") == 3, 60, "the pool's status.readyReplicas reaching 3")


CALLS, CONCURRENCY, DELETE_AFTER = 150, 6, 40
CALL = "import os, time; time.sleep(0.5); print({i}, os.uname().nodename)"
STOPPED = re.compile(r"kuberl sandbox stopped: (\d+) calls answered, (\d+) cut off mid-run")


def answered_by(pod: dict) -> float:
    """The pod's count of tool calls answered (its /metrics, read from the host at its IP)."""
    with urllib.request.urlopen(f"http://{pod['status']['podIP']}:8080/metrics", timeout=10) as resp:
        return metric_sum(resp.read().decode(), "kuberl_tool_calls_total")


def test_a_pod_deleted_under_load_loses_no_call_and_runs_none_twice(node: RealNode, pool: str):
    token, ip, port = pool_access(node, pool)
    url = f"http://{ip}:{port}"
    pods = serving(node, pool)
    before = {p["metadata"]["name"]: answered_by(p) for p in pods}
    # every pod's log to its last line (the count a pod prints as it stops), followed from before
    # the delete: the victim is chosen under load, as the pod that answered most calls so far (the
    # client's kept-alive connections stick to the pods kube-proxy gave them, so a pod fixed in
    # advance got none of them in about 1 run of 11)
    follows = {
        name: subprocess.Popen([node.kube.binary, f"--kubeconfig={node.kube.kubeconfig}", "logs", "-f", name,
                                "-n", pool], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for name in before
    }
    results: dict[int, tuple[str, str]] = {}
    deleted_at: list[float] = []
    victims: list[str] = []

    async def load() -> None:
        todo = iter(range(CALLS))
        async with SandboxClient(url, token=token, request_timeout=120) as client:
            async def worker() -> None:
                for i in todo:
                    answer = await client.execute(CALL.format(i=i))
                    results[i] = (answer.outcome, answer.output)
                    if len(results) == DELETE_AFTER and not deleted_at:
                        deleted_at.append(time.monotonic())
                        so_far = Counter(out.split()[-1] for outcome, out in results.values() if outcome == "stdout")
                        victims.append(so_far.most_common(1)[0][0])
                        await asyncio.to_thread(
                            node.kube.run, "delete", "pod", victims[0], "-n", pool, "--wait=false"
                        )

            await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))

    t0 = time.monotonic()
    asyncio.run(load())
    took = time.monotonic() - t0
    victim = victims[0]
    for name, proc in follows.items():
        if name != victim:
            proc.kill()
            proc.communicate()
    last, _ = follows[victim].communicate(timeout=120)
    # every call answered once, with its own output
    assert sorted(results) == list(range(CALLS))
    failed = {i: r for i, r in results.items() if r[0] != "stdout"}
    assert not failed, f"{len(failed)} calls did not run to the end: {dict(list(failed.items())[:5])}"
    hosts: dict[str, int] = {}
    for i, (_, out) in results.items():
        number, host = out.split()
        assert int(number) == i, (i, out)
        hosts[host] = hosts.get(host, 0) + 1
    assert hosts.get(victim, 0) > 0, hosts  # the load reached the deleted pod
    found = STOPPED.search(last)
    assert found, f"the deleted pod's log ends without its count:\n{last[-1500:]}"
    victim_answered, cut_off = int(found.group(1)), int(found.group(2))
    assert cut_off == 0, last[-1500:]
    # no call ran twice: what every pod answered during the load adds up to the calls made
    wait_for(lambda: len(serving(node, pool)) == 3, 240, "the Deployment's replacement pod serving")
    after = {p["metadata"]["name"]: answered_by(p) for p in serving(node, pool)}
    ran = sum(after[n] - before.get(n, 0.0) for n in after) + victim_answered - before[victim]
    print(f"{CALLS} calls in {took:.1f} s with {victim} deleted after {DELETE_AFTER}: by pod {hosts}; "
          f"the deleted pod answered {victim_answered - before[victim]:.0f} during the load, cut off {cut_off}")
    assert ran == CALLS, (before, after, victim_answered)
