"""The cluster path of a run: HF policies, weight sync through disk, the fleet's SGLang engines.

The SGLang servers here are tests/sglang_compat.py processes: SGLang's HTTP API over kuberl's
LocalEngine, generating with the tiny HF model and reloading weights from disk for real.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
import torch

from kuberl.api.job import AgenticRLJob
from kuberl.rollout.engine import GenerateRequest
from kuberl.rollout.fleet import FleetSource, FleetWatcher
from kuberl.rollout.local_engine import LocalEngine
from kuberl.trainer.checkpoint import CheckpointStore
from kuberl.trainer.hf import HFPolicy, load_hf_policy, policy_from_config, resolve_model_dir, write_hf_folder
from kuberl.trainer.local import run_job
from kuberl.trainer.weight_sync import DiskWeightSync, stale_versions, versions
from kuberl.util.ports import free_port

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from hf_fixtures import make_tiny_hf_model  # noqa: E402
from trainer_fakes import CoinVerifySandbox  # noqa: E402

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return make_tiny_hf_model(tmp_path_factory.mktemp("hf") / "tiny")


class Servers:
    """SGLang-compatible servers in subprocesses."""

    def __init__(self, model: Path, n: int, tmp: Path):
        self.procs: list[subprocess.Popen] = []
        self.urls: list[str] = []
        ready = []
        for i in range(n):
            port = free_port()
            flag = tmp / f"ready-{port}"
            self.procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        str(HERE / "sglang_compat.py"),
                        "--model",
                        str(model),
                        "--port",
                        str(port),
                        "--seed",
                        str(i),
                        "--ready-file",
                        str(flag),
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                )
            )
            self.urls.append(f"http://127.0.0.1:{port}")
            ready.append(flag)
        deadline = time.monotonic() + 120
        while not all(f.exists() for f in ready):
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"compat server died: {p.stderr.read().decode()[-2000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError("compat servers did not start")
            time.sleep(0.2)

    async def loads(self, url: str) -> dict:
        async with aiohttp.ClientSession() as s, s.get(url + "/test/loads") as r:
            return await r.json()

    def close(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            p.wait(timeout=20)


@pytest.fixture
def servers(tiny_model, tmp_path):
    made: list[Servers] = []

    def start(n: int) -> Servers:
        s = Servers(tiny_model, n, tmp_path)
        made.append(s)
        return s

    yield start
    for s in made:
        s.close()


# -- HFPolicy -----------------------------------------------------------------------------------


def test_hf_policy_follows_the_gpt_forward_contract(tiny_model):
    """Left padding and a (k, v) cache give the same logits as the plain HF forward."""
    policy = load_hf_policy(tiny_model).eval()
    ids = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = policy.hf(input_ids=ids[1:, 3:]).logits[0]  # row 1 without its first 3 tokens
        mask = torch.ones_like(ids)
        mask[1, :3] = 0
        full, _ = policy(ids, attention_mask=mask)
        head, past = policy(ids[:, :-1], attention_mask=mask[:, :-1])
        last, _ = policy(ids[:, -1:], past=past, attention_mask=mask)
    assert torch.allclose(full[1, 3:], ref, atol=1e-5)
    assert torch.allclose(last[:, -1], full[:, -1], atol=1e-5)
    # training and scoring forwards (right padding, pad_batch) build no KV cache, same logits
    right = torch.ones_like(ids)
    right[0, 6:] = 0
    with torch.no_grad():
        cached, present = policy(ids, attention_mask=right)
        plain, none = policy(ids, attention_mask=right, use_cache=False)
    assert none is None and len(present) == 2
    assert torch.allclose(plain[:, :6], cached[:, :6], atol=1e-6) and torch.allclose(plain[1], cached[1], atol=1e-6)
    # logits from a column on only (grpo.policy_logprobs): HF's logits_to_keep, the same numbers
    with torch.no_grad():
        tail, _ = policy(ids, attention_mask=right, use_cache=False, logits_from=4)
    assert tail.shape[1] == ids.shape[1] - 4 and torch.allclose(tail, plain[:, 4:], atol=1e-6)
    with pytest.raises(ValueError, match="logits_from needs use_cache=False"):
        policy(ids, attention_mask=right, logits_from=4)
    with pytest.raises(ValueError, match="attention_mask must be"):
        policy(ids, attention_mask=mask[:, :-1])


def test_hf_policy_hands_the_cache_over_under_the_name_transformers_takes(tiny_model):
    """transformers 5.25 renamed forward's ``past_key_values`` to ``cache`` (the old name warns and
    goes in 5.40): a cached forward uses whichever name the installed model's forward takes."""
    import inspect
    import warnings

    policy = load_hf_policy(tiny_model).eval()
    takes = inspect.signature(policy.hf.forward).parameters
    assert policy._cache_arg == ("cache" if "cache" in takes else "past_key_values")
    ids = torch.randint(0, 300, (1, 5), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*past_key_values.*deprecated")
        with torch.no_grad():
            _, past = policy(ids[:, :-1])
            step, present = policy(ids[:, -1:], past=past)
    assert len(present) == 2 and present[0][0].shape[2] == 5


def test_policy_from_config_rebuilds_hf_and_builtin(tiny_model):
    hf = load_hf_policy(tiny_model)
    again = policy_from_config(hf.config.to_dict())
    assert isinstance(again, HFPolicy)
    for (k, a), (_, b) in zip(hf.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(a, b), k
    gpt = policy_from_config({"vocab_size": 50, "n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 32})
    assert gpt.config.block_size == 32


def test_resolve_model_dir_errors_are_clear(tmp_path, tiny_model):
    assert resolve_model_dir(str(tiny_model), tmp_path) == tiny_model
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model_dir(str(tmp_path / "empty"), tmp_path)
    with pytest.raises(ValueError, match="no such directory"):
        resolve_model_dir("/nonexistent/model", tmp_path)


async def test_local_engine_serves_an_hf_policy(tiny_model):
    policy = load_hf_policy(tiny_model)
    engine = LocalEngine(policy, max_total_tokens=4096, max_batch=8, seed=0)
    try:
        outs = await asyncio.gather(
            *(
                engine.generate(GenerateRequest(input_ids=[5, 6, 7][: i + 1], max_new_tokens=6))
                for i in range(3)
            )
        )
        alone = await engine.generate(GenerateRequest(input_ids=[5, 6, 7], max_new_tokens=6, temperature=0))
        batched = await asyncio.gather(
            engine.generate(GenerateRequest(input_ids=[5, 6, 7], max_new_tokens=6, temperature=0)),
            engine.generate(GenerateRequest(input_ids=[9], max_new_tokens=3, temperature=0)),
        )
    finally:
        await engine.close()
    assert [len(o.output_ids) for o in outs] == [6, 6, 6]
    assert batched[0].output_ids == alone.output_ids  # padding does not change greedy output
    assert batched[0].output_logprobs == pytest.approx(alone.output_logprobs, abs=1e-4)


async def test_an_sglang_server_scores_a_sequence_as_it_sampled_it(servers):
    """The spot check's probe on SGLang's wire: /generate with max_new_tokens 0 and
    logprob_start_len gives the log-probs the server sampled with (HF policy, same weights)."""
    from kuberl.rollout.sglang_engine import SGLangEngine

    fleet = servers(1)
    engine = SGLangEngine(fleet.urls[0], name="sgl-0")
    try:
        prompt = [5, 6, 7, 8]
        out = await engine.generate(GenerateRequest(input_ids=prompt, max_new_tokens=8, seed=3))
        engine.weight_version = 2  # what a push would have set; the compat server reports none
        scored = await engine.score(prompt + out.output_ids, start=len(prompt))
    finally:
        await engine.close()
    assert scored.weight_version == 2
    assert scored.logprobs == pytest.approx(out.output_logprobs, abs=1e-4)


# -- weight sync --------------------------------------------------------------------------------


def _writer(fail: bool = False):
    def write(directory: Path) -> None:
        directory.mkdir(parents=True)
        (directory / "model.safetensors").write_text("w")
        if fail:
            raise OSError("disk full")

    return write


def test_publish_is_atomic_and_keeps_the_newest(tmp_path):
    sync = DiskWeightSync(tmp_path / "w", keep=2)
    for v in (1, 2, 3):
        assert sync.publish(_writer(), v).endswith(f"v{v:08d}")
    assert versions(tmp_path / "w") == [2, 3]
    with pytest.raises(OSError, match="disk full"):
        sync.publish(_writer(fail=True), 4)
    assert versions(tmp_path / "w") == [2, 3]  # the half-written v4 never became a version
    assert sync.current.endswith("v00000003")
    assert stale_versions([5, 1, 3], 1) == [1, 3]
    with pytest.raises(ValueError, match="at least one"):
        DiskWeightSync(tmp_path, keep=0)


def test_a_resumed_run_publishes_over_the_versions_its_killed_run_left(tmp_path):
    """Killed after publishing v48 and v49 but checkpointed at 40, the resumed run publishes 40
    again: that folder stays (it is the one its engines load next) and the later ones go; before,
    pruning kept the newest two, 48 and 49, and deleted v40 under the push that needed it."""
    sync = DiskWeightSync(tmp_path / "w", keep=2)
    for v in (39, 48, 49):
        sync.publish(_writer(), v)
    assert versions(tmp_path / "w") == [48, 49]
    assert sync.publish(_writer(), 40).endswith("v00000040")
    assert versions(tmp_path / "w") == [40]
    sync.publish(_writer(), 41)
    assert versions(tmp_path / "w") == [40, 41]
    assert stale_versions([38, 39, 40, 48], 2, current=40) == [38, 48]


async def test_push_names_every_failing_engine(tmp_path):
    class Target:
        def __init__(self, name, ok):
            self.name, self.ok, self.paths = name, ok, []

        async def update_weights_from_disk(self, path, version=None):
            self.paths.append(path)
            if not self.ok:
                raise RuntimeError("HTTP 400")

    sync = DiskWeightSync(tmp_path)
    with pytest.raises(RuntimeError, match="no weights published"):
        await sync.push([])
    sync.publish(_writer(), 7)
    good, bad = Target("a", True), Target("b", False)
    with pytest.raises(RuntimeError, match=r"failed on 1 engine\(s\): b: HTTP 400"):
        await sync.push([good, bad])
    assert good.paths == [sync.current]


# -- the fleet ------------------------------------------------------------------------------------


def test_fleet_source_from_env(tmp_path):
    assert FleetSource.from_env({}) is None
    s = FleetSource.from_env({"KUBERL_ROLLOUT_URLS": "http://a:1, http://b:2"})
    assert s.urls == ("http://a:1", "http://b:2") and s.fleet is None
    s = FleetSource.from_env({"KUBERL_ROLLOUT_FLEET": "qwen", "KUBERL_NAMESPACE": "rl"})
    assert (s.fleet, s.namespace) == ("qwen", "rl")
    with pytest.raises(ValueError, match="must start with http"):
        FleetSource.from_env({"KUBERL_ROLLOUT_URLS": "a:1"})


class _SliceAPI:
    """DiscoveryV1Api stand-in: one EndpointSlice per URL in ``ready`` (the servers differ by port)."""

    def __init__(self):
        self.ready: list[str] = []

    def list_namespaced_endpoint_slice(self, namespace, label_selector):
        assert (namespace, label_selector) == ("rl", "kubernetes.io/service-name=qwen")
        return {
            "items": [
                {
                    "addressType": "IPv4",
                    "ports": [{"name": "http", "port": int(url.rsplit(":", 1)[1])}],
                    "endpoints": [{"addresses": ["127.0.0.1"], "conditions": {"ready": True}}],
                }
                for url in self.ready
            ]
        }


async def test_fleet_watcher_prepares_joining_engines_and_drains_leaving_ones(servers, tiny_model, tmp_path):
    srv = servers(2)
    a, b = srv.urls
    api = _SliceAPI()
    api.ready = [a]
    sync = DiskWeightSync(tmp_path / "weights")
    policy = load_hf_policy(tiny_model)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.01)
    sync.publish(lambda d: write_hf_folder(policy.state_dict(), tiny_model, d), 1)

    watcher = FleetWatcher(FleetSource(fleet="qwen", namespace="rl"), interval=0, api=api)
    sched = await watcher.start(timeout=30)
    try:
        assert [e.base_url for e in watcher.engines] == [a]
        assert (await srv.loads(a))["loads"] == []  # serving the base model until told otherwise
        await watcher.load_weights(sync.current)
        assert (await srv.loads(a))["loads"] == [sync.current]
        api.ready = [a, b]
        assert await watcher.sync_once() == ([b], [])
        assert (await srv.loads(b))["loads"] == [sync.current]  # weights first, then rollouts
        async with sched.session(10, 10) as engine:
            out = await engine.generate(GenerateRequest(input_ids=[5, 6, 7], max_new_tokens=4))
        assert len(out.output_ids) == 4
        api.ready = [b]
        assert await watcher.sync_once() == ([], [a])
        assert [e.base_url for e in watcher.engines] == [b]
    finally:
        await watcher.close()


async def test_fleet_watcher_start_times_out_with_a_clear_message():
    watcher = FleetWatcher(FleetSource(urls=("http://127.0.0.1:9",)), interval=0.1)
    with pytest.raises(RuntimeError, match="no ready engine in sglang engines http://127.0.0.1:9"):
        await watcher.start(timeout=0.3)


def test_write_hf_folder_round_trips_a_trained_policy(tiny_model, tmp_path):
    policy = load_hf_policy(tiny_model)
    with torch.no_grad():
        policy.hf.model.embed_tokens.weight.mul_(1.5)  # tied to lm_head: must survive the export
    write_hf_folder(policy.state_dict(), tiny_model, tmp_path / "v1")
    assert (tmp_path / "v1" / "tokenizer.json").is_file()
    again = load_hf_policy(tmp_path / "v1")
    for (k, a), (_, b) in zip(policy.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(a, b), k


@pytest.fixture
def s3(monkeypatch):
    """A real S3 endpoint (moto server on loopback) with a bucket "models"."""
    boto3 = pytest.importorskip("boto3")
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    for k, v in {
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    client = boto3.client("s3", endpoint_url=f"http://{host}:{port}")
    client.create_bucket(Bucket="models")
    yield client
    server.stop()


def test_model_from_s3_prefix_is_downloaded_once(s3, tiny_model, tmp_path):
    for f in tiny_model.iterdir():
        s3.upload_file(str(f), "models", f"tiny/{f.name}")
    d = resolve_model_dir("s3://models/tiny", tmp_path / "cache")
    assert sorted(p.name for p in d.iterdir() if not p.name.startswith(".")) == sorted(
        p.name for p in tiny_model.iterdir()
    )
    s3.delete_object(Bucket="models", Key="tiny/config.json")
    assert resolve_model_dir("s3://models/tiny", tmp_path / "cache") == d  # cached: no second download
    assert isinstance(load_hf_policy(d), HFPolicy)
    with pytest.raises(ValueError, match="no objects under that prefix"):
        resolve_model_dir("s3://models/none", tmp_path / "cache")


def test_large_checkpoints_go_to_s3_in_parts(s3):
    from kuberl.trainer.checkpoint import CheckpointStore

    store = CheckpointStore("s3://models/ckpt", keep=1)
    big = {"w": torch.arange(3_000_000, dtype=torch.float32)}  # 12 MB > boto3's 8 MB multipart threshold
    store.save(big, 1)
    etag = s3.head_object(Bucket="models", Key="ckpt/ckpt-00000001.pt")["ETag"]
    assert "-" in etag  # an S3 multipart ETag is "<md5>-<parts>"; a single PUT stops at 5 GB
    assert torch.equal(store.load()["w"], big["w"])


def _hf_job(model: Path, **rollout) -> AgenticRLJob:
    return AgenticRLJob.model_validate(_hf_job_dict(model, **rollout))


def _hf_job_dict(model: Path, **rollout) -> dict:
    return {
        "apiVersion": "kuberl.io/v1alpha1",
        "kind": "AgenticRLJob",
        "metadata": {"name": "hf-fleet"},
        "spec": {
            "model": {"base": str(model)},
            "data": {"train": "builtin:arith"},
            "algorithm": {"groupSize": 2, "learningRate": 0.001, "warmupSteps": 1, "batchPrompts": 2},
            "rollout": {"maxTurns": 2, "maxResponseTokens": 32, "promptTemplate": "compact", **rollout},
            "stages": [
                {"name": "sft", "type": "sft", "steps": 3, "learningRate": 0.003, "batchSize": 4},
                {"name": "rl", "type": "rl", "steps": 2},
            ],
            "trainer": {"device": "cpu", "threads": 1},
            "checkpoint": {"uri": "ck", "everySteps": 50, "keep": 1},
        },
    }


async def _loads(srv: Servers) -> list[dict]:
    return [await srv.loads(u) for u in srv.urls]


def test_a_run_on_an_sglang_fleet_trains_an_hf_model_and_every_engine_follows(
    servers, tiny_model, tmp_path, monkeypatch
):
    """SFT then GRPO-RoC on an HF policy; rollouts on two SGLang-protocol servers that load every
    new version from the shared folder. The trainer recomputes the rollouts' log-probs with its own
    weights: a ~0 gap proves the engines sampled from exactly the weights being trained."""
    monkeypatch.setattr("kuberl.trainer.problems.EVAL_SIZE", 4)
    srv = servers(2)
    out = tmp_path / "run"
    result = run_job(
        _hf_job(tiny_model, engine="sglang"),
        out,
        use_ray=False,
        executor_factory=CoinVerifySandbox,
        engines=FleetSource(urls=tuple(srv.urls)),
        weights_path=str(tmp_path / "weights"),
        quiet=True,
    )
    rl = [h for h in result.history if h.type == "rl"]
    assert len(rl) == 2 and all(h.rollouts == 2 * 4 for h in rl)
    assert max(h.rollout_logprob_gap for h in rl) < 1e-3
    loads = asyncio.run(_loads(srv))
    shared = tmp_path / "weights" / "hf-fleet"
    # A version per weight change: after SFT (eval + first RL step), after each RL update.
    expected = [str(shared / f"v{v:08d}") for v in (3, 4, 5)]
    assert [x["loads"] for x in loads] == [expected, expected]
    assert all(x["generated"] > 0 for x in loads)  # the KV-aware scheduler used both engines
    final = load_hf_policy(expected[-1])
    ckpt = CheckpointStore(str(out / "checkpoints")).load()
    for k, v in final.state_dict().items():
        assert torch.equal(v, ckpt["model"][k]), k
    assert versions(shared) == [4, 5]  # the two newest stay on the shared volume


def test_a_local_run_trains_an_hf_model_on_the_local_engine(tiny_model, tmp_path, monkeypatch):
    """SFT from a jsonl of chat traces (what an HF model's SFT stage reads), then RL locally."""
    import json

    from kuberl.rollout import template

    monkeypatch.setattr("kuberl.trainer.problems.EVAL_SIZE", 4)
    monkeypatch.delenv("KUBERL_ROLLOUT_URLS", raising=False)
    monkeypatch.delenv("KUBERL_ROLLOUT_FLEET", raising=False)
    sft = tmp_path / "sft.jsonl"
    with sft.open("w") as f:
        for a, b in ((12, 34), (56, 78), (90, 12), (34, 56)):
            msgs = [
                {"role": "user", "content": f"{a}*{b}=?"},
                {"role": "assistant", "content": template.render_tool_call(f"print({a}*{b})")},
                {"role": "tool", "content": f"{a * b}\n"},
                {"role": "assistant", "content": f"<answer>\\boxed{{{a * b}}}</answer>"},
            ]
            f.write(json.dumps({"messages": msgs}) + "\n")
    job = _hf_job(tiny_model)
    job.spec.stages[0].data = str(sft)
    result = run_job(job, tmp_path / "run", use_ray=False, executor_factory=CoinVerifySandbox, quiet=True)
    sft = [h for h in result.history if h.type == "sft"]
    assert sft[-1].loss < sft[0].loss
    assert [h.type for h in result.history].count("rl") == 2


def test_problems_from_an_s3_jsonl(s3):
    from kuberl.trainer.data import load_problems

    s3.put_object(Bucket="models", Key="data/train.jsonl", Body=b'{"question": "1+1=?", "answer": "2"}\n\n'
                  b'{"question": "2*3=?", "answer": "6"}\n')  # fmt: skip
    probs = load_problems("s3://models/data/train.jsonl", 0, 0)
    assert [(p.question, p.answer) for p in probs] == [("1+1=?", "2"), ("2*3=?", "6")]
    with pytest.raises(ValueError, match="s3://models/data/none.jsonl: .*NoSuchKey"):
        load_problems("s3://models/data/none.jsonl", 0, 0)


# -- FSDP ranks -------------------------------------------------------------------------------------

DIST_JOB = {
    "apiVersion": "kuberl.io/v1alpha1",
    "kind": "AgenticRLJob",
    "metadata": {"name": "dist"},
    "spec": {
        "model": {"base": "builtin:tiny-gpt", "config": {"nLayer": 2, "nEmbd": 64, "nHead": 2}},
        "data": {"train": "builtin:arith"},
        "algorithm": {
            "groupSize": 2,
            "learningRate": 0.001,
            "warmupSteps": 1,
            "batchPrompts": 6,
            "miniBatches": 2,
        },
        "rollout": {"engine": "local", "maxTurns": 3, "maxResponseTokens": 48, "promptTemplate": "compact"},
        "stages": [
            {"name": "sft", "type": "sft", "steps": 60, "learningRate": 0.01, "batchSize": 7},
            {"name": "rl", "type": "rl", "steps": 2},
        ],
        "trainer": {"device": "cpu", "threads": 1},
        "checkpoint": {"uri": "ck", "everySteps": 61, "keep": 3},
    },
}


def _failure_text(proc: subprocess.CompletedProcess) -> str:
    """What a failed torchrun printed: every rank's error lines from the whole stderr (a rank's
    traceback may lie far above the launcher's summary), then the tail."""
    keys = ("Traceback", "Error", "error:", "terminate called", "Exception", "Assertion")
    lines = proc.stderr.splitlines()
    hits = sorted({j for i, line in enumerate(lines) if any(k in line for k in keys) for j in range(i, i + 6)})
    found = "\n".join(lines[j] for j in hits if j < len(lines))
    return f"{found[-6000:]}\n--- tail ---\n{proc.stderr[-3000:]}"


def _dist_run(tmp_path: Path, name: str, ranks: int, job: dict) -> tuple[dict, dict]:
    import yaml

    spec = tmp_path / f"{name}.yaml"
    spec.write_text(yaml.safe_dump(job))
    out = tmp_path / name
    launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}",
                f"--master-port={free_port()}"] if ranks > 1 else [sys.executable]  # fmt: skip
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [*launcher, str(HERE / "dist_run.py"), str(spec), str(out)], capture_output=True, text=True, env=env
    )
    assert proc.returncode == 0, _failure_text(proc)
    import json

    result = json.loads((out / "result.json").read_text())
    ckpt = CheckpointStore(str(out / "checkpoints")).load()
    return result, ckpt


@pytest.mark.timeout(600)
def test_fsdp_ranks_train_like_one_process_and_resume_in_either_layout(tmp_path):
    """Two gloo ranks (FSDP2) vs one process: the same losses, the same weights (up to the order of
    float sums), the same rollouts; a 2-rank checkpoint resumes in one process and vice versa."""
    one, ck1 = _dist_run(tmp_path, "one", 1, DIST_JOB)
    two, ck2 = _dist_run(tmp_path, "two", 2, DIST_JOB)
    h1, h2 = one["history"], two["history"]
    assert [h["type"] for h in h2] == ["sft"] * 60 + ["rl"] * 2
    # The same run up to float noise, which Adam amplifies where gradients are ~0 (the key bias):
    # losses agree to ~1e-4 for 30 steps, then drift apart by a few percent per step (measured:
    # <=3%; with PyPI's CUDA build of torch on a CPU, 0.2 % by step 40) while following the same
    # curve; weights by ~1% over 60 steps. The exact equivalence of one update is
    # test_fsdp_updates_equal_the_whole_batch_update.
    for a, b in zip(h1[:30], h2[:30], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=2e-3), (a["step"], a["loss"], b["loss"])
    for a, b in zip(h1[30:60], h2[30:60], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=6e-2), (a["step"], a["loss"], b["loss"])
    tail1, tail2 = (sum(h["loss"] for h in h[50:60]) / 10 for h in (h1, h2))
    assert tail1 == pytest.approx(tail2, rel=2e-2)
    for a, b in zip(h1[60:], h2[60:], strict=True):  # scripted rollouts: the same batches
        assert a["reward_mean"] == b["reward_mean"] and a["rollouts_kept"] == b["rollouts_kept"] > 0
        assert a["opt_steps"] == b["opt_steps"] == 2  # real 2-mini-batch updates on 2 ranks
    assert ck2["optimizer_format"] == ck1["optimizer_format"] == "by-name"
    sft1 = CheckpointStore(str(tmp_path / "one" / "checkpoints")).load("ckpt-00000060.pt")
    sft2 = CheckpointStore(str(tmp_path / "two" / "checkpoints")).load("ckpt-00000060.pt")
    # after 60 Adam steps the float noise has grown to ~1% of the weights (measured 1.2%; up to
    # 12% on a few small bias vectors, 0.054 at most in absolute terms)
    diff = sum(float((v - sft2["model"][k]).pow(2).sum()) for k, v in sft1["model"].items()) ** 0.5
    norm = sum(float(v.pow(2).sum()) for v in sft2["model"].values()) ** 0.5
    assert diff / norm < 0.04, diff / norm
    assert max(float((v - sft2["model"][k]).abs().max()) for k, v in sft1["model"].items()) < 0.15
    # Resume in the other layout from the mid-RL checkpoint (step 61): model and Adam moments.
    for src, ranks, name in ((tmp_path / "two", 1, "two-then-one"), (tmp_path / "one", 2, "one-then-two")):
        import shutil

        shutil.copytree(src / "checkpoints", tmp_path / name / "checkpoints")
        store = CheckpointStore(str(tmp_path / name / "checkpoints"))
        assert store.names() == ["ckpt-00000060.pt", "ckpt-00000061.pt", "ckpt-00000062.pt"]
        store.delete("ckpt-00000062.pt")
        res, _ = _dist_run(tmp_path, name, ranks, DIST_JOB)
        assert [h["step"] for h in res["history"]] == list(range(1, 63))
        events = (tmp_path / name / "events.jsonl").read_text()
        assert "resumed at global step 61" in events and "optimizer moments start afresh" not in events
        ref = (h2 if src.name == "two" else h1)[-1]
        assert res["history"][-1]["reward_mean"] == ref["reward_mean"]
        assert res["history"][-1]["opt_steps"] == 2


@pytest.mark.timeout(300)
def test_fsdp_updates_equal_the_whole_batch_update():
    """One SFT step and one 2-mini-batch GRPO update (clip-higher and grad clipping active) on 2
    FSDP ranks with uneven shares give the one-process weights and stats (SGD: no Adam noise)."""
    import json

    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}",
         str(HERE / "dist_grads.py")],
        capture_output=True, text=True, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, _failure_text(proc)
    out = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))
    assert out["sft"] < 1e-6 and out["rl"] < 1e-6, out
    got, want = out["rl_stats"]
    assert got["clip_low"] > 0 and got["opt_steps"] == want["opt_steps"] == 2
    for k in ("clip_low", "clip_high", "ratio_mean", "ratio_max", "loss", "grad_norm", "tokens"):
        assert got[k] == pytest.approx(want[k], rel=1e-5), k
    assert out["rl_on_policy"] < 1e-6, out
    got, want = out["rl_on_policy_stats"]
    assert want["rollout_logprob_gap"] > 0.1 and got["ratio_max"] == want["ratio_max"] == 1.0
    for k in ("rollout_logprob_gap", "loss", "grad_norm", "tokens"):
        assert got[k] == pytest.approx(want[k], rel=1e-5), k


def test_published_weights_take_the_models_serving_dtype(tiny_model, tmp_path):
    """The trainer keeps float32 masters; engines get the dtype of the model's config.json."""
    import json
    import shutil

    from safetensors.torch import load_file

    src = tmp_path / "bf16"
    shutil.copytree(tiny_model, src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["dtype"] = "bfloat16"
    (src / "config.json").write_text(json.dumps(cfg))
    policy = load_hf_policy(src)
    assert next(policy.parameters()).dtype == torch.float32
    write_hf_folder(policy.state_dict(), src, tmp_path / "v1")
    (weights,) = (tmp_path / "v1").glob("*.safetensors")
    assert {t.dtype for t in load_file(weights).values()} == {torch.bfloat16}


@pytest.mark.timeout(300)
def test_fsdp_ranks_other_than_0_receive_the_hf_weights_instead_of_reading_them(tiny_model):
    """Rank 1 builds the HF model on the meta device; rank 0 reads it and hands out the shards:
    weights, buffers (rotary inv_freq is in no state dict) and logits equal from_pretrained's."""
    import json

    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}",
         str(HERE / "dist_hf_load.py"), str(tiny_model)],
        capture_output=True, text=True, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, _failure_text(proc)
    out = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))
    assert out["ranks_built_on_meta"] == 1  # rank 1 never held the weights
    assert out["buffers"] > 0 and out["buffer_diff"] == 0.0
    assert out["same_keys"] and out["weights_diff"] == 0.0
    assert out["logits_diff"] < 1e-5, out


@pytest.mark.timeout(300)
def test_an_hf_run_on_two_ranks_trains_like_one_process(tiny_model, tmp_path):
    """The whole trainer path of an HF model on torchrun ranks (rank 1 starts from the meta
    device and gets rank 0's weights): the same SFT losses and RL batches as one process."""
    job = _hf_job_dict(tiny_model, maxResponseTokens=64, maxTurns=3)  # room for the scripted answers
    one, _ = _dist_run(tmp_path, "one", 1, job)
    two, _ = _dist_run(tmp_path, "two", 2, job)
    h1, h2 = one["history"], two["history"]
    assert [h["type"] for h in h2] == ["sft"] * 3 + ["rl"] * 2
    for a, b in zip(h1[:3], h2[:3], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4), (a["step"], a["loss"], b["loss"])
    for a, b in zip(h1[3:], h2[3:], strict=True):
        assert a["reward_mean"] == b["reward_mean"] and a["rollouts_kept"] == b["rollouts_kept"] > 0


@pytest.mark.timeout(120)
def test_an_error_on_one_rank_ends_every_rank_instead_of_hanging():
    """A barrier in close() would leave rank 0 waiting for rank 1, which waits in a broadcast
    for rank 0: the job would hang for gloo's 30-minute timeout instead of failing."""
    import time

    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}",
         str(HERE / "dist_fail.py")],
        capture_output=True, text=True, timeout=90, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode != 0 and "rank 0 fails" in proc.stderr
    assert time.monotonic() - t0 < 60
