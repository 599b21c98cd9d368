"""SGLangEngine against a loopback aiohttp server that serves SGLang's documented shapes."""

import pytest
from aiohttp import web

from kuberl.rollout.discovery import engines_from_urls, sync_engines
from kuberl.rollout.engine import GenerateRequest
from kuberl.rollout.scheduler import Scheduler
from kuberl.rollout.sglang_engine import (
    SGLangEngine,
    SGLangError,
    build_generate_payload,
    parse_generate_response,
    parse_max_total_tokens,
    parse_metrics,
)

METRICS = """\
# HELP sglang:token_usage The token usage
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="qwen",engine_type="unified",tp_rank="0"} 0.25
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
    """Echo model: continues the prompt with the prompt's tokens + 1 until a stop id or max."""

    def __init__(self, old_api: bool = False, flaky: int = 0):
        self.old_api = old_api
        self.flaky = flaky
        self.requests: list[dict] = []
        self.model_path = "base"

    async def generate(self, request: web.Request) -> web.Response:
        if self.flaky:
            self.flaky -= 1
            return web.Response(status=503, text="overloaded")
        body = await request.json()
        self.requests.append(body)
        sp = body["sampling_params"]
        out, finish = [], {"type": "length", "length": sp["max_new_tokens"]}
        for tok in body["input_ids"]:
            if len(out) >= sp["max_new_tokens"]:
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
                    "id": body.get("rid"),
                    "finish_reason": finish,
                    "prompt_tokens": len(body["input_ids"]),
                    "completion_tokens": len(out),
                    "output_token_logprobs": triples,
                },
            }
        )

    async def server_info(self, request: web.Request) -> web.Response:
        if self.old_api:
            raise web.HTTPNotFound()
        return web.json_response(
            {"model_path": self.model_path, "max_total_num_tokens": 5000, "version": "x"}
        )

    async def get_server_info(self, request: web.Request) -> web.Response:
        return web.json_response({"internal_states": [{"max_total_num_tokens": 4321}]})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=METRICS, content_type="text/plain")

    async def update(self, request: web.Request) -> web.Response:
        body = await request.json()
        if body["model_path"].startswith("/missing"):
            return web.json_response({"success": False, "message": "no such checkpoint"})
        self.model_path = body["model_path"]
        return web.json_response({"success": True, "message": "Succeeded to update model weights."})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/generate", self.generate)
        app.router.add_get("/server_info", self.server_info)
        app.router.add_get("/get_server_info", self.get_server_info)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/update_weights_from_disk", self.update)
        app.router.add_get("/health", self.health)
        return app


@pytest.fixture
async def serve():
    runners = []

    async def start(fake: FakeSGLang) -> str:
        runner = web.AppRunner(fake.app())
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        port = runner.addresses[0][1]
        return f"http://127.0.0.1:{port}"

    yield start
    for r in runners:
        await r.cleanup()


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
        load = await engine.load_metrics()
        assert (load.kv_cache_utilization, load.running, load.queued) == (0.25, 7, 2)
        sched = Scheduler([engine], policy="kv-aware")
        async with sched.session(100, 4000) as chosen:
            assert chosen is engine
        with pytest.raises(ValueError, match="largest engine holds 5000"):
            async with sched.session(100, 5000):
                pass
    finally:
        await engine.close()


async def test_old_server_info_route_retries_and_weight_updates(serve):
    fake = FakeSGLang(old_api=True, flaky=2)
    engine = SGLangEngine(await serve(fake), backoff_s=0.01)
    try:
        assert await engine.max_total_tokens() == 4321
        out = await engine.generate(GenerateRequest([1], max_new_tokens=1))  # two 503s, then OK
        assert out.output_ids == [2]
        await engine.update_weights_from_disk("/ckpt/step-10")
        assert fake.model_path == "/ckpt/step-10"
        with pytest.raises(SGLangError, match="no such checkpoint"):
            await engine.update_weights_from_disk("/missing/step-11")
    finally:
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
    for e in sched.engines:
        await e.close()
