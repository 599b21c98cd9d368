"""SGLangEngine against a loopback aiohttp server that serves SGLang's documented shapes."""

import asyncio
import time

import aiohttp
import pytest
from aiohttp import web

from kuberl.rollout.discovery import engines_from_urls, sync_engines
from kuberl.rollout.engine import GenerateRequest
from kuberl.rollout.loop import rollout_one
from kuberl.rollout.scheduler import NoEngineError, Scheduler
from kuberl.rollout.sglang_engine import (
    SGLangEngine,
    SGLangError,
    build_generate_payload,
    clamp_max_new_tokens,
    parse_context_length,
    parse_generate_response,
    parse_max_total_tokens,
    parse_metrics,
)
from tests.rollout_helpers import ByteTokenizer, FakeExecutor

METRICS_TEMPLATE = """\
# HELP sglang:token_usage The token usage
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="qwen",engine_type="unified",tp_rank="0"} {usage}
# HELP sglang:num_running_reqs The number of running requests
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="qwen",engine_type="unified",tp_rank="0"} 7.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="qwen",engine_type="unified",tp_rank="0"} 2.0
# HELP sglang:gen_throughput The generation throughput (token/s)
# TYPE sglang:gen_throughput gauge
sglang:gen_throughput{model_name="qwen"} 1234.5
"""


class FakeSGLang:
    """Echo model: continues the prompt with the prompt's tokens + 1 until a stop id or max.

    It enforces what SGLang's tokenizer manager enforces (HTTP 400 with SGLang's messages when
    input >= context_len or input + max_new_tokens >= context_len, and for a rid that is still
    running), answers a failed weight update with HTTP 400 ``{"success": false, "message"}``,
    and serves /get_server_info like current SGLang (``old_api``: only /server_info, with the
    capacity inside ``internal_states`` as older versions had it).
    """

    def __init__(
        self,
        old_api: bool = False,
        flaky: int = 0,
        context_len: int = 64,
        context_arg: int | None = None,
        capacity: int = 5000,
        delay: float = 0.0,
    ):
        self.old_api = old_api
        self.flaky = flaky
        self.context_len = context_len
        self.context_arg = context_arg
        self.capacity = capacity
        self.delay = delay
        self.weight_version: str | None = None  # echoed in meta_info when set (SGLang >= 0.5)
        self.updates: list[str] = []
        self.frozen = False  # the label stays, whatever is pushed
        self.requests: list[dict] = []
        self.rejected: list[str] = []
        self.live: set[str] = set()
        self.info_calls = 0
        self.model_path = "base"
        self.usage = 0.0  # sglang:token_usage: what other clients of the server hold

    def _error(self, message: str) -> web.Response:
        self.rejected.append(message)
        return web.json_response({"error": {"message": message}}, status=400)

    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(body)
        if self.flaky:
            self.flaky -= 1
            return web.Response(status=503, text="overloaded")
        rid, ids, sp = body.get("rid"), body["input_ids"], body["sampling_params"]
        if rid in self.live:
            return self._error(f"Duplicate request ID {rid} is still running")
        n, ctx, max_new = len(ids), self.context_len, sp.get("max_new_tokens")
        if n >= ctx:
            return self._error(
                f"The input ({n} tokens) is longer than the model's context length ({ctx} tokens)."
            )
        if max_new is not None and max_new + n >= ctx:
            return self._error(
                f"Requested token count exceeds the model's maximum context length of {ctx} tokens. "
                f"You requested a total of {max_new + n} tokens: {n} tokens from the input messages and "
                f"{max_new} tokens for the completion. Please reduce the number of tokens in the input "
                "messages or the completion to fit within the limit."
            )
        self.live.add(rid)
        try:
            await asyncio.sleep(self.delay)
        finally:
            self.live.discard(rid)
        out, finish = [], {"type": "length", "length": max_new}
        for tok in ids:
            if len(out) >= max_new:
                break
            out.append(tok + 1)
            if tok + 1 in sp.get("stop_token_ids", []):
                finish = {"type": "stop", "matched": tok + 1}
                break
        triples = [[-0.1 * (i + 1), t, None] for i, t in enumerate(out)]
        return web.json_response(
            {
                "text": "",
                "output_ids": out,
                "meta_info": {
                    "id": rid,
                    "finish_reason": finish,
                    "prompt_tokens": n,
                    "completion_tokens": len(out),
                    "output_token_logprobs": triples,
                    **({} if self.weight_version is None else {"weight_version": self.weight_version}),
                },
            }
        )

    async def get_server_info(self, request: web.Request) -> web.Response:
        if self.old_api:
            raise web.HTTPNotFound()
        self.info_calls += 1
        return web.json_response(
            {
                "model_path": self.model_path,
                "context_length": self.context_arg,  # the --context-length server arg
                "max_total_num_tokens": self.capacity,
                "max_req_input_len": self.capacity - 6,
                "internal_states": [{"last_gen_throughput": 0.0}],
                "version": "0.5.x",
            }
        )

    async def server_info(self, request: web.Request) -> web.Response:
        if not self.old_api:
            raise web.HTTPNotFound()
        self.info_calls += 1
        return web.json_response(
            {"context_length": None, "internal_states": [{"max_total_num_tokens": 4321}]}
        )

    async def models(self, request: web.Request) -> web.Response:
        card = {"id": "qwen", "object": "model", "owned_by": "sglang", "root": "qwen"}
        return web.json_response({"object": "list", "data": [{**card, "max_model_len": self.context_len}]})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            text=METRICS_TEMPLATE.replace("{usage}", repr(self.usage)), content_type="text/plain"
        )

    async def update(self, request: web.Request) -> web.Response:
        body = await request.json()
        if body["model_path"].startswith("/missing"):
            message = f"Failed to get weights iterator: {body['model_path']} (repo id or path) is invalid."
            return web.json_response(
                {"success": False, "message": message, "num_paused_requests": 0}, status=400
            )
        self.model_path = body["model_path"]
        self.updates.append(body["model_path"])
        if self.weight_version is not None and "weight_version" in body and not self.frozen:
            self.weight_version = body["weight_version"]
        if body["model_path"].endswith("-bigger"):  # a model whose KV budget differs
            self.capacity *= 2
        message = "Succeeded to update model weights."
        return web.json_response({"success": True, "message": message, "num_paused_requests": 0})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/generate", self.generate)
        app.router.add_get("/server_info", self.server_info)
        app.router.add_get("/get_server_info", self.get_server_info)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/update_weights_from_disk", self.update)
        app.router.add_get("/health", self.health)
        return app


async def test_generate_round_trip_and_scheduler_capacity(serve):
    fake = FakeSGLang()
    engine = SGLangEngine(await serve(fake), name="sgl-0")
    try:
        out = await engine.generate(
            GenerateRequest([1, 2, 3, 4], max_new_tokens=10, temperature=0.7, top_p=0.9, stop_token_ids=(4,))
        )
        assert out.output_ids == [2, 3, 4] and out.finish_reason == "stop"
        assert out.output_logprobs == pytest.approx([-0.1, -0.2, -0.3])
        sent = fake.requests[0]
        assert sent["input_ids"] == [1, 2, 3, 4] and sent["return_logprob"] is True
        assert sent["sampling_params"]["stop_token_ids"] == [4]
        assert sent["sampling_params"]["temperature"] == 0.7 and sent["sampling_params"]["top_p"] == 0.9
        out = await engine.generate(GenerateRequest([5, 6, 7], max_new_tokens=2))
        assert out.output_ids == [6, 7] and out.finish_reason == "length"
        assert await engine.max_total_tokens() == 5000
        assert await engine.health()
        fake.usage = 0.25  # another job on this server holds 1250 of the 5000 KV tokens
        load = await engine.load_metrics()
        assert (load.kv_cache_utilization, load.running, load.queued) == (0.25, 7, 2)
        sched = Scheduler([engine], policy="kv-aware")
        async with sched.session(100, 3650) as chosen:  # exactly what the other job left
            assert chosen is engine
        assert sched.snapshot()[0]["external"] == 1250
        with pytest.raises(ValueError, match="largest engine holds 5000"):
            async with sched.session(100, 5000):
                pass
        await sched.close()
    finally:
        await engine.close()


async def test_old_server_info_route_retries_and_weight_updates(serve):
    fake = FakeSGLang(old_api=True, flaky=2)
    engine = SGLangEngine(await serve(fake), backoff_s=0.01)
    try:
        assert await engine.max_total_tokens() == 4321
        assert await engine.context_length() == 64  # context_length null: /v1/models max_model_len
        out = await engine.generate(GenerateRequest([1], max_new_tokens=1, rid="r1"))  # two 503s, then OK
        assert out.output_ids == [2]
        assert [r["rid"] for r in fake.requests] == ["r1", "r1-retry1", "r1-retry2"], (
            "retries get a fresh rid"
        )
        await engine.update_weights_from_disk("/ckpt/step-10")
        assert fake.model_path == "/ckpt/step-10"
        with pytest.raises(
            SGLangError, match=r"failed: Failed to get weights iterator: /missing/step-11 \(repo"
        ):
            await engine.update_weights_from_disk("/missing/step-11")
        assert fake.model_path == "/ckpt/step-10"
    finally:
        await engine.close()


async def test_a_restarted_sglang_server_is_caught_by_its_weight_label_and_re_pushed(serve):
    """SGLang >= 0.5 labels every answer with the weights' version ("default" before any update):
    a restart's start-up weights are caught at the first answer, the last version re-pushed and
    the request run again."""
    from kuberl.rollout.http_engine import VersionMismatch

    fake = FakeSGLang()
    fake.weight_version = "default"
    engine = SGLangEngine(await serve(fake), retries=0)
    try:
        assert (await engine.generate(GenerateRequest([1, 2], max_new_tokens=2))).weight_version is None
        await engine.update_weights_from_disk("/ckpt/step-5", version=5)
        assert (await engine.generate(GenerateRequest([1, 2], max_new_tokens=2))).weight_version == 5
        fake.weight_version = "default"  # the restart
        out = await engine.generate(GenerateRequest([1, 2], max_new_tokens=2, rid="r9"))
        assert out.weight_version == 5 and (engine.version_mismatches, engine.repushes) == (1, 1)
        assert fake.updates == ["/ckpt/step-5", "/ckpt/step-5"]
        assert [r["rid"] for r in fake.requests[-2:]] == ["r9", "r9-again"]
        # a label no push of this client set (another trainer pushed to it): refused after a re-push
        fake.weight_version, fake.frozen = "7", True
        with pytest.raises(VersionMismatch, match="served weights '7' where version 5 .* again after re-pushing"):
            await engine.generate(GenerateRequest([1, 2], max_new_tokens=2))
        fake.frozen = False
        # an old server reports no label: the client's own stands (nothing to check it against)
        fake.weight_version = None
        assert (await engine.generate(GenerateRequest([1, 2], max_new_tokens=2))).weight_version == 5
    finally:
        await engine.close()


async def test_generate_is_clamped_to_the_context_length_sglang_enforces(serve):
    fake = FakeSGLang(context_len=64, context_arg=48)  # --context-length 48 wins over the model's 64
    url = await serve(fake)
    async with aiohttp.ClientSession() as http:  # the fake enforces SGLang's rule ...
        raw = build_generate_payload(GenerateRequest(list(range(1, 31)), max_new_tokens=4000))
        async with http.post(url + "/generate", json=raw) as resp:
            assert resp.status == 400
            assert "Requested token count exceeds" in (await resp.json())["error"]["message"]
    fake.rejected.clear()
    engine = SGLangEngine(url)
    try:  # ... and the engine never breaks it
        assert await engine.context_length() == 48
        out = await engine.generate(GenerateRequest(list(range(1, 31)), max_new_tokens=4000))
        assert fake.requests[-1]["sampling_params"]["max_new_tokens"] == 48 - 30 - 1
        assert len(out.output_ids) == 17 and out.finish_reason == "length"
        sent = len(fake.requests)
        for n in (47, 48, 60):  # no room for even one token: answered without a request
            out = await engine.generate(GenerateRequest(list(range(1, n + 1)), max_new_tokens=5))
            assert out.output_ids == [] and out.finish_reason == "length"
        assert len(fake.requests) == sent and fake.rejected == []
        assert clamp_max_new_tokens(10, 5, 48) == 5 and clamp_max_new_tokens(47, 5, 48) == 0
    finally:
        await engine.close()


async def test_a_multi_turn_rollout_never_sends_sglang_an_oversized_request(serve):
    tok = ByteTokenizer()
    fake = FakeSGLang(context_len=20)
    engine = SGLangEngine(await serve(fake))
    sched = Scheduler([engine])
    try:
        prompt = "abcdefghijkl"  # 12 tokens: 7 more fit under SGLang's limit of 20
        traj = await rollout_one(sched, tok, FakeExecutor(), prompt, max_turns=4, max_response_tokens=4000)
        assert fake.rejected == [] and traj.error is None
        assert traj.finish_reason == "length" and traj.truncated
        assert traj.response_ids == [t + 1 for t in tok.encode(prompt)[:7]]
    finally:
        await sched.close()
        await engine.close()


async def test_a_generate_that_timed_out_is_not_retried(serve):
    fake = FakeSGLang(delay=1.0)
    engine = SGLangEngine(await serve(fake), request_timeout=0.3, retries=3, backoff_s=0.01)
    try:
        await engine.max_total_tokens()
        with pytest.raises(SGLangError, match="timed out"):
            await engine.generate(GenerateRequest([1, 2], max_new_tokens=2))
        assert len(fake.requests) == 1, "the server may still be running it: no second copy"
    finally:
        await engine.close()


async def test_retries_stop_when_the_time_budget_is_spent(serve):
    fake = FakeSGLang(flaky=10**6)
    engine = SGLangEngine(await serve(fake), request_timeout=0.5, retries=100, backoff_s=0.05)
    try:
        await engine.max_total_tokens()
        start = time.monotonic()
        with pytest.raises(SGLangError, match="budget leaves no time to retry"):
            await engine.generate(GenerateRequest([1], max_new_tokens=1))
        assert time.monotonic() - start < 0.5 + 1.0  # the budget, plus scheduling slack on a busy box
        assert 2 <= len(fake.requests) < 10
    finally:
        await engine.close()


async def test_new_weights_refresh_the_schedulers_capacity(serve):
    fake = FakeSGLang(capacity=5000)
    engine = SGLangEngine(await serve(fake))
    sched = Scheduler([engine], policy="kv-aware")
    try:
        async with sched.session(100, 4000):
            pass
        assert sched.snapshot()[0]["capacity"] == 5000
        await engine.update_weights_from_disk("/ckpt/step-20-bigger")
        assert engine.capacity_version == 1
        async with sched.session(100, 9000) as chosen:  # fits only the new, doubled budget
            assert chosen is engine
        assert sched.snapshot()[0]["capacity"] == 10000 and fake.info_calls == 2
    finally:
        await sched.close()
        await engine.close()


async def test_unreachable_server_is_unhealthy_and_a_clear_error():
    engine = SGLangEngine("http://127.0.0.1:9", retries=1, backoff_s=0.01)
    try:
        assert not await engine.health()
        with pytest.raises(SGLangError, match="failed after 2 attempts"):
            await engine.max_total_tokens()
    finally:
        await engine.close()
    with pytest.raises(ValueError, match="http://"):
        SGLangEngine("127.0.0.1:30000")


def test_pure_parsers_reject_contract_violations():
    payload = build_generate_payload(GenerateRequest([1, 2], 5, stop_token_ids=(9,), rid="r1"))
    assert payload["rid"] == "r1" and payload["sampling_params"]["max_new_tokens"] == 5
    assert "sampling_seed" not in payload["sampling_params"]  # unseeded: the server's own RNG
    seeded = build_generate_payload(GenerateRequest([1, 2], 5, seed=1234))
    assert seeded["sampling_params"]["sampling_seed"] == 1234
    ok = {"output_ids": [3], "meta_info": {"finish_reason": {"type": "stop", "matched": 3},
                                            "output_token_logprobs": [[-1.5, 3, "x"]]}}  # fmt: skip
    assert parse_generate_response(ok).output_logprobs == [-1.5]
    trimmed = {"output_ids": [5], "meta_info": {"finish_reason": {"type": "stop", "matched": 9},
                                                 "output_token_logprobs": [[-1, 5, None], [-2, 9, None]]}}  # fmt: skip
    assert parse_generate_response(trimmed).output_ids == [5, 9]
    with pytest.raises(SGLangError, match="disagree"):
        parse_generate_response({**ok, "output_ids": [4]})
    with pytest.raises(SGLangError, match="return_logprob"):
        parse_generate_response({"output_ids": [3], "meta_info": {"finish_reason": {"type": "stop"}}})
    with pytest.raises(SGLangError, match="finish_reason"):
        parse_generate_response(
            {"meta_info": {"finish_reason": {"type": "eos"}, "output_token_logprobs": []}}
        )
    assert parse_max_total_tokens({"max_total_num_tokens": 10}) == 10
    with pytest.raises(SGLangError, match="max_total_num_tokens"):
        parse_max_total_tokens({"internal_states": []})
    with pytest.raises(SGLangError, match="enable-metrics"):
        parse_metrics("# nothing\n")
    assert parse_context_length({"context_length": 8192}) == 8192
    assert parse_context_length({"context_length": None}, {"data": [{"max_model_len": 32768}]}) == 32768
    assert parse_context_length({"context_length": None}, {"data": []}) is None


async def test_sync_engines_follows_the_discovered_urls(serve):
    a, b = await serve(FakeSGLang()), await serve(FakeSGLang())
    sched = Scheduler(engines_from_urls([a]), policy="kv-aware")
    assert await sync_engines(sched, [a, b], retries=0) == ([b], [])
    assert [e.base_url for e in sched.engines] == [a, b]
    async with sched.session(10, 100) as engine:
        assert engine.base_url == a  # equal free capacity: the first engine
        assert await sync_engines(sched, [b]) == ([], [a])
        assert len(sched.engines) == 2, "a busy engine is drained, not dropped"
    assert await sync_engines(sched, [b]) == ([], [])
    assert [e.base_url for e in sched.engines] == [b]
    async with sched.session(10, 100) as engine:
        assert engine.base_url == b
    await sched.close()
    for e in sched.engines:
        await e.close()


async def test_rollouts_fail_clearly_when_discovery_finds_no_engine(serve):
    url = await serve(FakeSGLang())
    sched = Scheduler(engines_from_urls([url]), policy="kv-aware", no_engine_timeout_s=0.1)
    async with sched.session(10, 100):
        pass
    assert await sync_engines(sched, []) == ([], [url])
    assert sched.engines == []
    with pytest.raises(NoEngineError, match="no inference engine in service"):
        async with sched.session(10, 100):
            pass
    assert await sync_engines(sched, [url]) == ([url], [])  # the fleet is back
    async with sched.session(10, 100) as engine:
        assert engine.base_url == url
    await sched.close()
    for e in sched.engines:
        await e.close()


def test_score_payload_and_input_token_logprobs_as_sglang_answers_them():
    from kuberl.rollout.sglang_engine import build_score_payload, parse_score_response

    ids = [7, 8, 9, 10, 11]
    body = build_score_payload(ids, 3, "score-1")
    assert body["logprob_start_len"] == 2 and body["sampling_params"]["max_new_tokens"] == 0
    answer = {"meta_info": {"input_token_logprobs": [[None, 9, None], [-0.5, 10, None], [-1.5, 11, None]]}}
    assert parse_score_response(answer, ids, 3) == [-0.5, -1.5]
    with pytest.raises(SGLangError, match="must hold 3 entries"):
        parse_score_response({"meta_info": {"input_token_logprobs": answer["meta_info"]["input_token_logprobs"][1:]}}, ids, 3)
    shifted = {"meta_info": {"input_token_logprobs": [[None, 8, None], [-0.5, 9, None], [-1.5, 10, None]]}}
    with pytest.raises(SGLangError, match="not aligned"):
        parse_score_response(shifted, ids, 3)
    hole = {"meta_info": {"input_token_logprobs": [[None, 9, None], [None, 10, None], [-1.5, 11, None]]}}
    with pytest.raises(SGLangError, match="null log-prob"):
        parse_score_response(hole, ids, 3)
