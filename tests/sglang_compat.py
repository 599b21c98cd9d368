"""A stand-in SGLang server for tests: SGLang's native HTTP API over kuberl's LocalEngine.

SGLang itself cannot run here (no GPU), but the cluster path of the trainer (SGLangEngine,
fleet discovery, the KV-aware scheduler over several servers, weight pushes through
``/update_weights_from_disk``) should still be exercised against servers that really
generate with the policy and really reload weights. This server does both, with the wire
shapes ``kuberl.rollout.sglang_engine`` documents:

* ``POST /generate``: input_ids + sampling_params -> output_ids + meta_info
  (finish_reason {type}, output_token_logprobs [[logprob, id, null], ...]); a request whose
  input + max_new_tokens reaches the context length is refused with HTTP 400, as SGLang does.
* ``POST /generate`` with ``max_new_tokens: 0``, ``return_logprob`` and ``logprob_start_len``:
  ``input_token_logprobs`` of the prompt from that position (scoring, as SGLang answers it).
* ``GET /get_server_info``: max_total_num_tokens, context_length (SGLang >= 0.4 route).
* ``GET /get_model_info``: model_path.
* ``GET /metrics``: sglang:token_usage, sglang:num_running_reqs, sglang:num_queue_reqs.
* ``POST /update_weights_from_disk`` {model_path}: reloads the weights from that HF folder;
  {success: false} with HTTP 400 when it cannot.
* ``GET /health`` and ``GET /health_generate``: as SGLang >= 0.4.10 answers them
  (python/sglang/srt/entrypoints/http_server.py ``health_generate``): a one-token greedy
  generation of ``input_ids=[0]`` is started, then the handler polls once a second until it
  (or any other request) has produced output since the probe began, so an answer takes at
  least one second; 503 after ``SGLANG_HEALTH_CHECK_TIMEOUT`` seconds (default 20) without
  output. A Kubernetes probe with the default ``timeoutSeconds: 1`` never sees it succeed.

Run: ``python tests/sglang_compat.py --model DIR --port PORT [--max-total-tokens N]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path

import torch
from aiohttp import web

from kuberl.rollout.engine import GenerateRequest
from kuberl.rollout.local_engine import LocalEngine
from kuberl.trainer.hf import load_hf_policy


class CompatServer:
    def __init__(self, model_dir: str, max_total_tokens: int, seed: int = 0):
        torch.set_num_threads(1)
        self.model_path = model_dir
        self.policy = load_hf_policy(model_dir)
        self.engine = LocalEngine(
            self.policy, max_total_tokens=max_total_tokens, max_batch=256, name="compat", seed=seed
        )
        self.loads: list[str] = []  # model paths loaded through update_weights_from_disk
        self.generated = 0
        self.last_output = (
            0.0  # time.perf_counter() of the last generated output (SGLang's last_receive_tstamp)
        )
        self.health_timeout = float(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", "20"))

    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        sp = body.get("sampling_params", {})
        ids = body["input_ids"]
        max_new = int(sp.get("max_new_tokens", 128))
        if len(ids) + max_new >= self.engine.context_length:
            return web.json_response(
                {
                    "error": {
                        "message": f"Requested token count exceeds the model's maximum context length of "
                        f"{self.engine.context_length} tokens. You requested a total of {len(ids) + max_new} "
                        f"tokens: {len(ids)} tokens from the input messages and {max_new} tokens for the "
                        "completion. Please reduce the number of tokens in the input messages or the completion "
                        "to fit within the limit."
                    }
                },
                status=400,
            )
        start = int(body.get("logprob_start_len", -1))
        if body.get("return_logprob") and max_new == 0 and start >= 0:
            return await self._score(body, ids, start)
        out = await self.engine.generate(
            GenerateRequest(
                input_ids=ids,
                max_new_tokens=max_new,
                temperature=float(sp.get("temperature", 1.0)),
                top_p=float(sp.get("top_p", 1.0)),
                stop_token_ids=tuple(sp.get("stop_token_ids") or ()),
                rid=body.get("rid") or "r",
            )
        )
        self.generated += len(out.output_ids)
        self.last_output = time.perf_counter()
        finish = {"type": out.finish_reason}
        if out.finish_reason == "stop":
            finish["matched"] = out.output_ids[-1]
        elif out.finish_reason == "length":
            finish["length"] = len(out.output_ids)
        return web.json_response(
            {
                "text": "",
                "output_ids": out.output_ids,
                "meta_info": {
                    "id": body.get("rid"),
                    "finish_reason": finish,
                    "prompt_tokens": len(ids),
                    "completion_tokens": len(out.output_ids),
                    "output_token_logprobs": [
                        [lp, t, None] for lp, t in zip(out.output_logprobs, out.output_ids, strict=True)
                    ],
                },
            }
        )

    async def _score(self, body: dict, ids: list[int], start: int) -> web.Response:
        """Prompt log-probs from ``start`` on, the first entry None as SGLang gives it at
        position 0 (the client asks from one token before the span it wants)."""
        scored = await self.engine.score(ids, start + 1) if start + 1 < len(ids) else None
        lps = [None, *(scored.logprobs if scored else [])]
        meta = {
            "id": body.get("rid"),
            "finish_reason": {"type": "length", "length": 0},
            "prompt_tokens": len(ids),
            "completion_tokens": 0,
            "input_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids[start:], strict=True)],
            "output_token_logprobs": [],
        }
        if scored is not None and scored.weight_version is not None:
            meta["weight_version"] = str(scored.weight_version)
        return web.json_response({"text": "", "output_ids": [], "meta_info": meta})

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": self.model_path,
                "max_total_num_tokens": await self.engine.max_total_tokens(),
                "context_length": self.engine.context_length,
                "version": "kuberl-test-compat",
            }
        )

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": self.model_path, "is_generation": True})

    async def metrics(self, request: web.Request) -> web.Response:
        load = await self.engine.load_metrics()
        text = (
            "# TYPE sglang:token_usage gauge\n"
            f'sglang:token_usage{{model_name="policy"}} {load.kv_cache_utilization}\n'
            "# TYPE sglang:num_running_reqs gauge\n"
            f'sglang:num_running_reqs{{model_name="policy"}} {load.running}\n'
            "# TYPE sglang:num_queue_reqs gauge\n"
            f'sglang:num_queue_reqs{{model_name="policy"}} {load.queued}\n'
        )
        return web.Response(text=text, content_type="text/plain")

    async def update_weights(self, request: web.Request) -> web.Response:
        path = (await request.json()).get("model_path", "")
        try:
            fresh = await asyncio.to_thread(load_hf_policy, path)
            self.engine.set_weights(fresh.state_dict())
        except Exception as err:  # SGLang answers a failed load with success=false, HTTP 400
            return web.json_response(
                {"success": False, "message": f"Failed to load {path}: {err}"}, status=400
            )
        self.model_path = path
        self.loads.append(path)
        return web.json_response({"success": True, "message": "Succeeded to update model weights."})

    async def health(self, request: web.Request) -> web.Response:
        """SGLang's health_generate: start a one-token generation, then check once a second
        whether anything produced output since the probe began."""
        if not await self.engine.health():
            return web.Response(status=503)
        tic = time.perf_counter()

        async def one_token() -> None:
            await self.engine.generate(
                GenerateRequest(input_ids=[0], max_new_tokens=1, temperature=0.0, rid=f"HEALTH_CHECK_{tic}")
            )
            self.last_output = time.perf_counter()

        task = asyncio.create_task(one_token())
        try:
            while time.perf_counter() < tic + self.health_timeout:
                await asyncio.sleep(1)
                if self.last_output > tic:
                    return web.Response(status=200)
            return web.Response(status=503)
        finally:
            task.cancel()

    async def loads_log(self, request: web.Request) -> web.Response:
        """Test-only introspection: which weight folders were loaded, how many tokens generated."""
        return web.json_response({"loads": self.loads, "generated": self.generated})

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/generate", self.generate)
        app.router.add_get("/get_server_info", self.server_info)
        app.router.add_get("/get_model_info", self.model_info)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/update_weights_from_disk", self.update_weights)
        app.router.add_get("/health", self.health)
        app.router.add_get("/health_generate", self.health)
        app.router.add_get("/test/loads", self.loads_log)
        return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--max-total-tokens", type=int, default=1 << 16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ready-file", help="written (JSON) once the server listens")
    a = ap.parse_args()
    server = CompatServer(a.model, a.max_total_tokens, a.seed)

    async def on_start(app: web.Application) -> None:
        if a.ready_file:
            Path(a.ready_file).write_text(json.dumps({"port": a.port}))

    app = server.app()
    app.on_startup.append(on_start)
    web.run_app(app, host="127.0.0.1", port=a.port, print=None, handle_signals=True)


if __name__ == "__main__":
    main()
