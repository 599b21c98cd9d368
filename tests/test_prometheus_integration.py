"""Proof that the dashboards work: a real Prometheus scrapes a real local run, every panel has data.

A Debian ``prometheus`` binary (installed by .ci/run) scrapes, every second, the trainer's
metrics endpoint (``KUBERL_METRICS_PORT``; it also serves the rollout scheduler's gauges since
the rollout worker runs in-process) during a tiny quickstart-like ``run_job`` and the real
sandbox service (``kuberl sandbox serve``) driven with real tool calls. Then every PromQL
expression of every dashboard panel is evaluated through ``/api/v1/query`` and must return a
non-empty result. The same endpoints' exposition text must pass ``promtool check metrics``.

The operator (a ``kuberl operator`` process) reconciles a SandboxPool and a RolloutFleet in the
kmock Kubernetes API emulator meanwhile, so its autoscaler metrics are scraped too.

The run trains the tiny model with SFT, but its rollouts come from ``ScriptedArithEngine``
(``run_job(engine_factory=...)``): a tiny policy never calls the tool, so nothing would reach
the sandbox and no rollout would be correct. The script's tool calls run in the real sandbox
and its answers are checked by the real verifier, with a known tool-error ratio in positives.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import importlib.util
import json
import math
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from kuberl.dashboards.definitions import all_expressions
from kuberl.dashboards.metrics_catalog import CATALOG, metric_for_series
from kuberl.util.ports import free_port
from tests.prometheus_server import http_get, query, running_prometheus

ROOT = Path(__file__).resolve().parent.parent
JOB = "obs-e2e"
POOL = "obs-e2e"
FLEET = "obs-fleet"
NS = "obs"
HAVE_SANDBOX = importlib.util.find_spec("kuberl.sandbox.service.local") is not None
pytestmark = pytest.mark.skipif(
    shutil.which("prometheus") is None or shutil.which("promtool") is None,
    reason="Debian package `prometheus` (installed by .ci/run) is required",
)


def _job_manifest(tmp: Path) -> str:
    """examples/quickstart.yaml shrunk to seconds: tiny model, few SFT steps, 3 RL steps."""
    doc = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
    doc = copy.deepcopy(doc)
    doc["metadata"]["name"] = JOB
    spec = doc["spec"]
    spec["model"]["config"] = {"nLayer": 1, "nEmbd": 32, "nHead": 2}
    spec["algorithm"].update(groupSize=2, batchPrompts=2, warmupSteps=1, learningRate=0.001)
    spec["algorithm"]["lengthReward"] = {"targets": [32, 64]}  # the thinking-budget panel has data too
    spec["algorithm"]["asyncLevel"] = 1  # and the asynchronous pipeline's (its own, not another test's gauges)
    spec["rollout"]["maxResponseTokens"] = 160  # room for two tool calls, a traceback and the answer
    spec["stages"] = [
        {"name": "sft", "type": "sft", "steps": 3, "learningRate": 0.003, "batchSize": 4},
        {"name": "rl", "type": "rl", "steps": 3},
    ]
    spec["checkpoint"] = {"uri": "ck", "everySteps": 2, "keep": 1}
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


class _ToolTraffic:
    """Keeps real tool calls flowing to the sandbox (stdout, no_stdout and error outcomes)."""

    CODES = (
        "print(sum(range(10)))",
        "import math\nmath.factorial(12)",
        "1/0",
        "x = [i*i for i in range(50)]\nprint(x[-1])",
    )

    def __init__(self, url: str) -> None:
        self.url = url
        self.stop = threading.Event()
        self.calls = 0
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        from kuberl.sandbox.service.client import SandboxClient

        async def main() -> None:
            async with SandboxClient(self.url) as client:
                while not self.stop.is_set():
                    res = await client.execute_batch([(c, "") for c in self.CODES])
                    self.calls += len(res)
                    await client.verify("\\boxed{42}", "42")
                    await asyncio.sleep(0.2)

        try:
            asyncio.run(main())
        except BaseException as err:  # noqa: BLE001 - reported by the test
            self.error = err


def _post(url: str, body: dict) -> None:
    req = urllib.request.Request(  # noqa: S310 - loopback only
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(req, timeout=10):  # noqa: S310
        pass


# the operator subprocess's series only: this pytest process's own exporter (the trainer's) also
# serves the autoscaler gauges of in-process operator tests that ran before
OPERATOR_READY = 'kuberl_autoscaler_ready_replicas{job="kuberl-operator"} > 0'


@contextlib.contextmanager
def _operator_on_emulator(tmp: Path):
    """`kuberl operator` reconciling a SandboxPool and a RolloutFleet in ClusterEmulator (over
    HTTP, from a kubeconfig); yields the host:port of the operator's /metrics."""
    import os
    import sys

    import kmock
    from kube_emulator import ClusterEmulator, write_kubeconfig

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="emulator", daemon=True)
    thread.start()
    stack = contextlib.AsyncExitStack()

    async def start() -> str:
        emu = await stack.enter_async_context(ClusterEmulator(namespaces={NS}))
        srv = await stack.enter_async_context(kmock.Server(emu))
        return str(srv.url).rstrip("/")

    url = asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    kubeconfig = tmp / "kubeconfig"
    write_kubeconfig(kubeconfig, url, NS)
    port = free_port()
    env = {
        **os.environ,
        "KUBECONFIG": str(kubeconfig),
        "KUBERL_RECONCILE_INTERVAL": "0.5",
        "KUBERL_AUTOSCALE_INTERVAL": "0.5",
        "KUBERL_OPERATOR_METRICS_PORT": str(port),
        "KUBERL_HEALTH_PORT": "0",  # no probe endpoints: their fixed ports would collide
        "KUBERL_LIVENESS_PORT": "0",
    }
    env.pop("KUBERL_WEBHOOK_PORT", None)
    log = open(tmp / "operator.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", "kuberl", "operator", "-n", NS], env=env, stdout=log, stderr=subprocess.STDOUT
    )
    try:
        api = f"{url}/apis/kuberl.io/v1alpha1/namespaces/{NS}"
        meta = {"namespace": NS}
        _post(
            f"{api}/sandboxpools",
            {"apiVersion": "kuberl.io/v1alpha1", "kind": "SandboxPool", "metadata": {"name": POOL, **meta},
             "spec": {"replicas": 2}},
        )  # fmt: skip
        _post(
            f"{api}/rolloutfleets",
            {"apiVersion": "kuberl.io/v1alpha1", "kind": "RolloutFleet", "metadata": {"name": FLEET, **meta},
             "spec": {"replicas": 1, "model": {"uri": "m"}, "accelerator": {"profile": "cpu", "count": 1}}},
        )  # fmt: skip
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        asyncio.run_coroutine_threadsafe(stack.aclose(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def concrete(expr: str) -> str:
    """Substitute the dashboard variables the way Grafana would for this run."""
    return (
        expr.replace("$__rate_interval", "1m")
        .replace('"$job"', f'"{JOB}"')
        .replace('"$pool"', f'"{POOL}"')
        .replace('"$engine"', '".+"')
    )


@pytest.fixture(scope="module")
def scraped(tmp_path_factory):
    """Run the stack under Prometheus; yields (prometheus url, {target: metrics url})."""
    from trainer_fakes import ScriptedArithEngine

    from kuberl.api.job import AgenticRLJob
    from kuberl.api.loader import find_one, load_manifests
    from kuberl.trainer import metrics
    from kuberl.trainer.local import run_job

    tmp = tmp_path_factory.mktemp("prom")
    # one exporter per process: an earlier test in this process may have started it already
    train_port = metrics._SERVER_PORT or free_port()  # noqa: SLF001
    mp = pytest.MonkeyPatch()
    mp.setenv("KUBERL_METRICS_PORT", str(train_port))
    with contextlib.ExitStack() as stack:
        stack.callback(mp.undo)
        targets = {
            "kuberl-trainer": f"127.0.0.1:{train_port}",
            "kuberl-operator": stack.enter_context(_operator_on_emulator(tmp)),
        }
        executor_factory = None
        traffic = None
        if HAVE_SANDBOX:
            from kuberl.sandbox.service.local import running_sandbox

            sandbox_url = stack.enter_context(running_sandbox(workers=2, pool=POOL))
            mp.setenv("KUBERL_SANDBOX_URL", sandbox_url)
            targets["kuberl-sandbox"] = urllib.parse.urlparse(sandbox_url).netloc
        else:
            from trainer_fakes import FakeSandbox

            executor_factory = FakeSandbox
        prom = stack.enter_context(running_prometheus(tmp, targets))
        if HAVE_SANDBOX:
            traffic = _ToolTraffic(sandbox_url)
            traffic.thread.start()
            stack.callback(traffic.thread.join, 30)
            stack.callback(traffic.stop.set)
        # the operator's workloads become ready while the trainer runs, not after it: the
        # trainer's rates must still be inside the query window when the panels are evaluated
        deadline = time.time() + 60
        while len(query(prom, OPERATOR_READY)) < 2 and time.time() < deadline:
            time.sleep(0.5)
        assert len(query(prom, OPERATOR_READY)) == 2, (
            f"the operator did not report both workloads ready: {(tmp / 'operator.log').read_text()[-3000:]}"
        )
        job = find_one(load_manifests(_job_manifest(tmp)), AgenticRLJob)
        run_job(
            job,
            tmp / "run",
            use_ray=False,
            executor_factory=executor_factory,
            engine_factory=lambda model, tokenizer: ScriptedArithEngine(tokenizer),
            quiet=True,
        )
        # panels are evaluated just after the run ended (the scrape after it holds its last
        # values), however long the waits below and the tests take: a dashboard opened on the run
        run_end = time.time() + 2.0
        # the run is over but its gauges stay served; wait until Prometheus has them all twice
        deadline = time.time() + 60
        while time.time() < deadline:
            have = query(prom, f'count_over_time(kuberl_train_reward_mean{{job="{JOB}"}}[1m])')
            ready = query(prom, OPERATOR_READY)
            if have and float(have[0]["value"][1]) >= 3 and len(ready) == 2 and time.time() > run_end + 1:
                break
            time.sleep(0.5)
        else:
            raise AssertionError(
                f"no 3 scrapes of the run's gauges, or not 2 ready workloads, in 60 s: {have} {ready}"
            )
        if traffic is not None:
            assert traffic.error is None, traffic.error
            assert traffic.calls > 0
        yield prom, {name: f"http://{hp}/metrics" for name, hp in targets.items()}, tmp, run_end


@pytest.mark.parametrize(("uid", "title", "expr"), all_expressions(), ids=lambda x: str(x)[:60])
def test_every_panel_query_has_data(scraped, uid, title, expr):
    if uid == "kuberl-sandbox" and not HAVE_SANDBOX:
        pytest.skip("kuberl.sandbox.service.local (the sandbox component) is not in this checkout yet")
    prom, _, _, at = scraped
    result = query(prom, concrete(expr), at)
    assert result, f"{uid} / {title}: empty result for {concrete(expr)}"
    values = [float(r["value"][1]) for r in result]
    assert any(math.isfinite(v) for v in values), f"{uid} / {title}: only NaN/Inf for {concrete(expr)}"
    if "rate(" in expr or "histogram_quantile" in expr:
        assert any(v > 0 for v in values if math.isfinite(v)), f"{uid} / {title}: no traffic seen: {values}"


def test_tool_error_ratio_in_positives_arrives_through_prometheus(scraped):
    """The scripted policy's known ratio, computed by the trainer from real sandbox outcomes."""
    from trainer_fakes import ScriptedArithEngine

    prom, _, tmp, _ = scraped
    rl = [json.loads(x) for x in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rl if r.get("type") == "rl"]
    assert len(rl) == 3 and all(r["reward_mean"] == 0.5 for r in rl), rl  # 2 of every 4 verified correct
    want = ScriptedArithEngine.ERROR_RATIO_POSITIVE
    assert all(r["tool_error_ratio_positive"] == pytest.approx(want) for r in rl)
    got = query(prom, f'kuberl_train_tool_error_ratio_positive{{job="{JOB}"}}')
    assert [float(s["value"][1]) for s in got] == [pytest.approx(want)]
    tokens = query(prom, 'kuberl_rollout_generated_tokens_total{engine="scripted-0"}')
    assert tokens and float(tokens[0]["value"][1]) > 0


def test_scraped_series_are_catalogued_with_their_labels(scraped):
    prom, _, _, _ = scraped
    names = json.loads(http_get(f"{prom}/api/v1/label/__name__/values"))["data"]
    ours = [n for n in names if n.startswith("kuberl_")]
    assert ours
    for n in ours:
        spec = metric_for_series(n)
        assert spec is not None, f"{n} is exported but not in dashboards/metrics_catalog.py"
        for series in query(prom, n):
            extra = set(series["metric"]) - set(spec.labels) - {"__name__", "instance", "le"}
            assert extra <= ({"job"} if "job" not in spec.labels else set()), (n, series["metric"])
    # every catalogued metric of the components present is declared, with the catalogued type
    _, endpoints, _, _ = scraped
    declared: dict[str, str] = {}
    for url in endpoints.values():
        for line in http_get(url).decode().splitlines():
            if line.startswith("# TYPE kuberl_"):
                _, _, name, typ = line.split()
                declared[name] = typ
    for m in CATALOG.values():
        if m.component == "sandbox" and not HAVE_SANDBOX:
            continue
        # prometheus-client declares counters with or without `_total` depending on its version
        typ = declared.get(m.name) or declared.get(m.name.removesuffix("_total"))
        assert typ == m.type, f"{m.name}: declared {typ!r}, catalog {m.type}"


def test_promtool_check_metrics_is_clean(scraped):
    _, endpoints, _, _ = scraped
    for name, url in endpoints.items():
        text = http_get(url)
        assert b"kuberl_" in text, name
        res = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, timeout=60)
        problems = (res.stdout + res.stderr).decode()
        assert res.returncode == 0 and not problems.strip(), f"{name}: promtool check metrics:\n{problems}"
