"""Dashboards as code: catalog contract, staleness of the committed JSON, upload to a fake Grafana."""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from kuberl.cli import main
from kuberl.dashboards import cli as dcli
from kuberl.dashboards.definitions import DASHBOARDS, all_expressions
from kuberl.dashboards.metrics_catalog import CATALOG, check_expression

ROOT = Path(__file__).resolve().parent.parent


# DESIGN.md's list is the contract with the dashboards; the catalog may add to it, but every
# addition is named here with its reason so that none slips in unreviewed.
DESIGN_METRICS = {
    "kuberl_tool_call_latency_seconds", "kuberl_tool_calls_total", "kuberl_sandbox_queue_depth",
    "kuberl_sandbox_workers_busy", "kuberl_rollout_kv_cache_utilization", "kuberl_rollout_requests_inflight",
    "kuberl_train_reward_mean", "kuberl_train_clip_ratio", "kuberl_train_response_clip_ratio",
    "kuberl_train_tool_error_ratio_positive", "kuberl_train_response_length_tokens", "kuberl_train_step",
    "kuberl_train_step_seconds",
}  # fmt: skip
EXTENSIONS = {
    "kuberl_sandbox_verify_calls_total": "answer verification (math-verify) outcomes, timeouts included",
    "kuberl_rollout_generated_tokens_total": "per-engine tokens/s on the rollout dashboard",
    "kuberl_autoscaler_desired_replicas": "what the operator's autoscaler decided",
    "kuberl_autoscaler_ready_replicas": "ready replicas the autoscaler sees",
    "kuberl_train_rollout_staleness": "asynchronous RL: rollouts by policy versions behind (asyncLevel)",
    "kuberl_train_rollouts_stale_total": "asynchronous RL: rollouts dropped as stale or out of step",
    "kuberl_train_engine_logprob_gap": "spot check: an engine serving other weights than pushed",
    "kuberl_rollout_requests_waiting": "the trainers' backlog the fleet autoscaler reads (issue 18)",
    "kuberl_train_length_penalty_mean": "thinking budgets: the length term of the reward (lengthReward)",
    "kuberl_train_length_gap_tokens": "thinking budgets: |l_target - l_y| per target length",
    "kuberl_train_length_adherence": "thinking budgets: rollouts within 10 % of their target",
    "kuberl_rollout_engine_version_faults_total": "answers from weights never pushed, and re-pushes",
    "kuberl_train_rollout_wait_ratio": "asynchronous RL: the trainer starved for rollouts (fleet autoscaler)",
    "kuberl_train_engine_idle_ratio": "asynchronous RL: engines waiting for weights (fleet autoscaler)",
    "kuberl_train_engines_in_service": "asynchronous RL: the engines the pipeline ratios were measured on",
    "kuberl_rollout_phase_workers": "rollout phases announced ahead: the SandboxPool's floor (issue 31)",
}


def test_catalog_matches_design_md():
    design = ROOT.parent / "shared" / "DESIGN.md"
    if design.exists():
        section = design.read_text().split("## Metrics", 1)[1]
        assert set(re.findall(r"kuberl_[a-z0-9_]+", section)) == DESIGN_METRICS
    assert set(CATALOG) - set(EXTENSIONS) == DESIGN_METRICS
    assert set(EXTENSIONS) <= set(CATALOG), set(EXTENSIONS) - set(CATALOG)
    assert CATALOG["kuberl_tool_call_latency_seconds"].type == "histogram"
    assert CATALOG["kuberl_tool_calls_total"].type == "counter"
    assert CATALOG["kuberl_train_clip_ratio"].labels == ("job", "side")
    assert all("job" in m.labels for m in CATALOG.values() if m.component == "trainer")


@pytest.mark.parametrize(("uid", "title", "expr"), all_expressions())
def test_every_expression_uses_only_catalogued_metrics(uid, title, expr):
    assert check_expression(expr) == []


def test_check_expression_rejects_unknown_metric_and_label():
    assert check_expression("rate(kuberl_tool_calls_totl[1m])")
    assert check_expression('kuberl_train_reward_mean{pool="x"}')
    assert check_expression("sum by (engine) (kuberl_train_step)")
    assert check_expression("up")
    assert (
        check_expression(
            "histogram_quantile(0.9, sum by (le) (rate(kuberl_tool_call_latency_seconds_bucket[1m])))"
        )
        == []
    )


def test_dashboards_have_the_panels_the_issue_asks_for():
    titles = {uid: [p.title.lower() for p in d.panels] for uid, d in DASHBOARDS.items()}
    want = {
        "kuberl-training": ["reward", "pass rate", "response length", "response clip", "clip fraction (low / high)",
                            "tool-error ratio in positive", "step time", "stage"],
        "kuberl-sandbox": ["p50 / p95 / p99", "throughput", "outcome mix", "queue depth", "busy workers", "replicas"],
        "kuberl-rollout": ["kv-cache utilization", "in-flight", "tokens/s", "replicas"],
    }  # fmt: skip
    for uid, words in want.items():
        for w in words:
            assert any(w in t for t in titles[uid]), (uid, w)
    sandbox_exprs = [q.expr for p in DASHBOARDS["kuberl-sandbox"].panels for q in p.queries]
    for q in ("0.5", "0.95", "0.99"):
        assert any(e.startswith(f"histogram_quantile({q}, sum by (le, outcome)") for e in sandbox_exprs)


def test_generated_json_is_grafana_11_and_has_variables():
    for uid, d in DASHBOARDS.items():
        doc = json.loads(d.to_json())
        assert doc["uid"] == uid
        assert doc["schemaVersion"] >= 39  # Grafana 11.x schema (10.1 would be 38)
        names = [v["name"] for v in doc["templating"]["list"]]
        assert names == ["datasource", d.variable[0]]
        assert all(p["datasource"]["uid"] == "${datasource}" for p in doc["panels"])
    training = json.loads(DASHBOARDS["kuberl-training"].to_json())
    job = training["templating"]["list"][1]
    assert job["query"] == "label_values(kuberl_train_step, job)"
    assert all('job=~"$job"' in t["expr"] for p in training["panels"] for t in p["targets"])
    # the tags that `upload --annotations` puts on run events are what the dashboard shows
    ann = training["annotations"]["list"][0]
    assert ann["target"]["tags"] == ["kuberl"] and ann["enable"] is True
    assert dcli.annotation_payloads([{"time": 1, "kind": "stage"}])[0]["tags"][0] == "kuberl"


def test_committed_json_is_fresh():
    assert dcli.stale_files() == [], "run `kuberl dashboards generate` and commit dashboards/generated/"
    assert main(["dashboards", "generate", "--check"]) == 0


def test_staleness_is_detected(tmp_path):
    dcli.write_generated(tmp_path)
    assert dcli.stale_files(tmp_path) == []
    p = tmp_path / "kuberl-sandbox.json"
    p.write_text(p.read_text().replace("Throughput", "Thruput"))
    (tmp_path / "old.json").write_text("{}")
    assert dcli.stale_files(tmp_path) == ["kuberl-sandbox.json", "old.json"]
    (tmp_path / "kuberl-rollout.json").unlink()
    assert "kuberl-rollout.json" in dcli.stale_files(tmp_path)


class FakeGrafana(BaseHTTPRequestHandler):
    """Answers like Grafana's documented HTTP API and records every request."""

    requests: list[tuple[str, str, dict | None, str | None]] = []
    folders: dict[str, dict] = {}

    def log_message(self, *args):  # quiet
        pass

    def _reply(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _record(self) -> dict | None:
        n = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(n)) if n else None
        self.requests.append((self.command, self.path, body, self.headers.get("Authorization")))
        return body

    def do_GET(self):
        self._record()
        m = re.fullmatch(r"/api/folders/([^/]+)", self.path)
        if m and m.group(1) in self.folders:
            return self._reply(200, self.folders[m.group(1)])
        return self._reply(404, {"message": "folder not found"})

    def do_POST(self):
        body = self._record()
        if self.headers.get("Authorization") != "Bearer s3cret":
            return self._reply(401, {"message": "invalid API key"})
        if self.path == "/api/folders":
            self.folders[body["uid"]] = {"uid": body["uid"], "title": body["title"], "id": 1}
            return self._reply(200, self.folders[body["uid"]])
        if self.path == "/api/dashboards/db":
            uid = body["dashboard"]["uid"]
            return self._reply(
                200, {"id": 1, "uid": uid, "status": "success", "version": 1, "url": f"/d/{uid}"}
            )
        if self.path == "/api/annotations":
            return self._reply(200, {"message": "Annotation added", "id": len(self.requests)})
        return self._reply(404, {"message": "not found"})


@pytest.fixture
def grafana():
    FakeGrafana.requests = []
    FakeGrafana.folders = {}
    srv = ThreadingHTTPServer(("127.0.0.1", 0), FakeGrafana)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def _events(tmp_path: Path) -> Path:
    p = tmp_path / "events.jsonl"
    lines = [
        {"time": 1700000000.5, "kind": "stage", "text": "stage sft started", "stage": "sft", "step": 0},
        {
            "time": 1700000100.0,
            "kind": "checkpoint",
            "text": "checkpoint step 10",
            "stage": "rl-1",
            "step": 10,
        },
        {"time": 1700000200.0, "kind": "done", "text": "finished", "stage": None, "step": None},
    ]
    p.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return p


def test_upload_pushes_folder_dashboards_and_annotations(grafana, tmp_path, capsys):
    ev = _events(tmp_path)
    rc = main(
        [
            "dashboards",
            "upload",
            "--url",
            grafana,
            "--token",
            "s3cret",
            "--folder",
            "RL runs",
            "--annotations",
            str(ev),
        ]
    )
    assert rc == 0, capsys.readouterr().err
    reqs = FakeGrafana.requests
    assert all(auth == "Bearer s3cret" for _, _, _, auth in reqs)
    assert [(m, p) for m, p, _, _ in reqs[:2]] == [("GET", "/api/folders/rl-runs"), ("POST", "/api/folders")]
    dash = [b for m, p, b, _ in reqs if p == "/api/dashboards/db"]
    assert sorted(b["dashboard"]["uid"] for b in dash) == sorted(DASHBOARDS)
    assert all(b["overwrite"] is True and b["folderUid"] == "rl-runs" for b in dash)
    assert dash[0]["dashboard"] == json.loads(
        (dcli.GENERATED / f"{dash[0]['dashboard']['uid']}.json").read_text()
    )
    ann = [b for m, p, b, _ in reqs if p == "/api/annotations"]
    assert [a["time"] for a in ann] == [1700000000500, 1700000100000, 1700000200000]
    assert ann[0]["tags"] == ["kuberl", "stage", "stage:sft", "step:0"]
    assert ann[1]["tags"] == ["kuberl", "checkpoint", "stage:rl-1", "step:10"]
    assert ann[2]["tags"] == ["kuberl", "done"] and ann[2]["text"] == "finished"
    assert all(a["dashboardUID"] == "kuberl-training" for a in ann)
    # second upload: the folder exists now, so it is not created again
    FakeGrafana.requests = []
    assert main(["dashboards", "upload", "--url", grafana, "--token", "s3cret"]) == 0
    assert [p for m, p, _, _ in FakeGrafana.requests if m == "POST"].count(
        "/api/folders"
    ) == 1  # "kuberl" folder is new
    FakeGrafana.requests = []
    assert main(["dashboards", "upload", "--url", grafana, "--token", "s3cret"]) == 0
    assert "/api/folders" not in [p for m, p, _, _ in FakeGrafana.requests if m == "POST"]


def test_upload_reports_auth_failure(grafana, capsys):
    FakeGrafana.folders = {"kuberl": {"uid": "kuberl", "title": "kuberl"}}
    assert main(["dashboards", "upload", "--url", grafana, "--token", "wrong"]) == 1
    assert "Grafana" in capsys.readouterr().err


def test_bad_events_file_is_a_clear_error(tmp_path, capsys):
    p = tmp_path / "events.jsonl"
    p.write_text('{"time": 1, "kind": "stage"}\nnot json\n')
    with pytest.raises(ValueError, match=r"events.jsonl:2: not JSON"):
        dcli.read_events(p)
    p.write_text('{"kind": "stage"}\n')
    assert (
        main(["dashboards", "upload", "--url", "http://127.0.0.1:9", "--token", "t", "--annotations", str(p)])
        == 2
    )
    assert "numeric 'time'" in capsys.readouterr().err
