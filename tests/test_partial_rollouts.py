"""Partial rollouts (issue 41 item 2, ``algorithm.partialRollouts``): at a weight push the
generations in flight go on under the new weights from their tokens so far; every token
carries the version that sampled it, and the trainer's staleness bound and TIS read those."""

from __future__ import annotations

import asyncio
import copy
import math

import pytest
import torch
from aiohttp import web

from kuberl.rollout.engine import GenerateOutput, GenerateRequest
from kuberl.rollout.local_engine import LocalEngine
from kuberl.rollout.loop import Trajectory, rollout_one
from kuberl.rollout.scheduler import Scheduler
from kuberl.rollout.scored import Scored
from kuberl.rollout.vllm_engine import VLLMEngine, VLLMError, parse_generate_response
from kuberl.trainer.grpo import prepare_batch, rl_update
from kuberl.trainer.loss import LossConfig
from kuberl.trainer.model import GPT, GPTConfig
from tests.rollout_helpers import ByteTokenizer, FakeExecutor, single_torch_thread
from tests.test_rollout_vllm import StubVLLM, _folder

_one_thread = pytest.fixture(autouse=True, scope="module")(single_torch_thread)

TOK = ByteTokenizer()
PROMPT_IDS = [3, 17, 5, 29, 11, 40]


def _gpt(seed: int, vocab: int = 48, block: int = 96) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=vocab, block_size=block, n_layer=2, n_head=2, n_embd=32)).eval()


def _clean_logprobs(model: GPT, prompt: list[int], out: list[int]) -> list[float]:
    """log p(out[i] | prompt + out[:i]) by one full forward: what a clean sampler reports."""
    ids = torch.tensor([prompt + out])
    with torch.no_grad():
        lp = torch.log_softmax(model(ids)[0][0].float(), dim=-1)
    return [float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(out)]


async def _push_after(engine: LocalEngine, tokens: int, weights: dict, version: int) -> None:
    """Copy ``weights`` in once the engine has sampled ``tokens`` tokens (between decode steps)."""
    while engine.generated_tokens < tokens:
        await asyncio.sleep(0.001)
    engine.set_weights(weights, version)


def _request(n: int = 30) -> GenerateRequest:
    return GenerateRequest(list(PROMPT_IDS), max_new_tokens=n, temperature=1.0, seed=1234)


async def _split_generation(old: GPT, new: GPT, at: int) -> tuple[GenerateOutput, LocalEngine]:
    engine = LocalEngine(old, seed=0, partial_rollouts=True)
    engine.set_weights(old.state_dict(), 0)
    out, _ = await asyncio.gather(engine.generate(_request()), _push_after(engine, at, new.state_dict(), 1))
    return out, engine


def _split(out: GenerateOutput) -> int:
    assert out.token_versions is not None, "a partial-rollout engine labels every token"
    k = out.token_versions.count(0)
    assert 0 < k < len(out.output_ids), f"the push must land mid-generation: versions {out.token_versions}"
    assert out.token_versions == [0] * k + [1] * (len(out.output_ids) - k)
    return k


async def test_a_push_mid_generation_continues_under_the_new_weights_from_the_tokens_so_far():
    old, new = _gpt(0), _gpt(1)
    out, engine = await _split_generation(old, new, at=8)
    k = _split(out)
    assert len(out.output_ids) == 30 and out.finish_reason == "length"
    assert out.weight_version == 0  # the oldest token's, as the staleness bound counts
    assert engine.reprefills == 1, "the running row is prefilled again under the new weights"
    # token ids up to the split are the uninterrupted generation's (same seed, old weights)
    alone = await LocalEngine(old, seed=0).generate(_request())
    assert out.output_ids[:k] == alone.output_ids[:k]
    assert out.output_ids != alone.output_ids, "after the split the new weights sample"
    # every token's log-prob is its own version's clean forward (no KV cache of the old weights)
    ids = out.output_ids
    assert out.output_logprobs[:k] == pytest.approx(_clean_logprobs(old, PROMPT_IDS, ids)[:k], abs=1e-4)
    assert out.output_logprobs[k:] == pytest.approx(_clean_logprobs(new, PROMPT_IDS, ids)[k:], abs=1e-4)
    # and the tokens after it are what the new weights draw from there on with the same seed
    rest = await LocalEngine(new, seed=0).generate(
        GenerateRequest(PROMPT_IDS + ids[:k], max_new_tokens=30 - k, temperature=1.0, seed=1234, first_draw=k)
    )
    assert ids[k:] == rest.output_ids


async def test_without_partial_rollouts_a_generation_reports_the_version_it_started_with():
    old, new = _gpt(0), _gpt(1)
    engine = LocalEngine(old, seed=0)
    engine.set_weights(old.state_dict(), 0)
    out, _ = await asyncio.gather(engine.generate(_request()), _push_after(engine, 8, new.state_dict(), 1))
    assert out.token_versions is None and out.weight_version == 0 and engine.reprefills == 0


def _byte_gpt(seed: int) -> GPT:
    return _gpt(seed, vocab=ByteTokenizer.vocab_size, block=256)


async def _rollout(engine: LocalEngine, **kw) -> Trajectory:
    prompt = "<|im_start|>user\nWhat is 6*7?<|im_end|>\n<|im_start|>assistant\n"
    return await rollout_one(
        Scheduler([engine]), TOK, FakeExecutor(), prompt, max_turns=1, max_response_tokens=40, seed=99, **kw
    )


async def test_an_engine_restarted_mid_generation_continues_from_the_handed_off_tokens():
    model = _byte_gpt(3)
    uninterrupted = await _rollout(LocalEngine(model, seed=0, partial_rollouts=True))
    assert len(uninterrupted.response_ids) == 40, "the test needs a turn that runs to the budget"

    engine = LocalEngine(model, seed=0, partial_rollouts=True)
    requests: list[GenerateRequest] = []
    generate = engine.generate

    async def recording(req: GenerateRequest) -> GenerateOutput:
        requests.append(req)
        return await generate(req)

    engine.generate = recording  # type: ignore[method-assign]

    async def restart_after(tokens: int) -> None:
        while engine.generated_tokens < tokens:
            await asyncio.sleep(0.001)
        await engine.close()  # in-flight generations come back as "abort" with their tokens

    traj, _ = await asyncio.gather(_rollout(engine), restart_after(10))
    assert traj.resumed == 1 and traj.finish_reason != "abort"
    first, second = requests
    handed = len(second.input_ids) - len(first.input_ids)
    assert 0 < handed < 40 and second.first_draw == handed
    assert second.input_ids[len(first.input_ids) :] == traj.response_ids[:handed]
    assert second.max_new_tokens == 40 - handed
    # the same weights after the restart: the rollout is the uninterrupted one, token for token
    assert traj.response_ids == uninterrupted.response_ids
    assert traj.logprobs == pytest.approx(uninterrupted.logprobs, abs=1e-4)


async def test_a_rollout_split_across_two_versions_trains_with_its_per_token_logprobs_and_versions():
    old, new = _byte_gpt(3), _byte_gpt(4)
    engine = LocalEngine(old, seed=0, partial_rollouts=True)
    engine.set_weights(old.state_dict(), 0)
    split, _ = await asyncio.gather(_rollout(engine), _push_after(engine, 12, new.state_dict(), 1))
    k = split.token_versions.count(0)
    assert 0 < k < len(split.response_ids) and split.token_versions == [0] * k + [1] * (len(split.response_ids) - k)
    assert split.versions == [0] and split.min_version == 0
    whole = split.prompt_ids + split.response_ids
    clean_old = _clean_logprobs(old, split.prompt_ids, split.response_ids)
    clean_new = _clean_logprobs(new, split.prompt_ids, split.response_ids)
    assert split.logprobs[:k] == pytest.approx(clean_old[:k], abs=1e-4)
    assert split.logprobs[k:] == pytest.approx(clean_new[k:], abs=1e-4)

    fresh = copy.deepcopy(split)  # a rollout wholly of version 1, for the other side of the group
    fresh.token_versions, fresh.versions = [1] * len(fresh.response_ids), [1]
    groups = [[Scored(split, 1.0), Scored(fresh, 0.0)]]
    # the staleness bound counts the oldest token: at bound 0 the split rollout is too old
    strict = prepare_batch(groups, 2, roc=False, seed=0, filter_zero=False, version=1, max_staleness=0)
    assert strict.stats["rollouts_stale"] == 1.0 and len(strict.seqs) == 1
    batch = prepare_batch(groups, 2, roc=False, seed=0, filter_zero=False, version=1, max_staleness=1)
    assert batch.stats["staleness_max"] == 1.0 and len(batch.seqs) == 2
    row = batch.seqs.index(whole)
    assert batch.behavior_logprobs[row][len(split.prompt_ids) :] == split.logprobs

    # TIS weighs every token by min(pi_old / mu, C), pi_old the trained model (version 1) and mu
    # the log-prob the engine sampled that token with: the version-0 tokens of the split rollout
    # get their ratio, its version-1 tokens exactly 1 (same weights); the copy carries the same
    # per-token mu, so the same weights
    cap = 2.0
    weights = [min(math.exp(n - o), cap) for n, o in zip(clean_new[:k], clean_old[:k], strict=True)]
    n = len(split.response_ids)
    expect = 2 * (sum(weights) + (n - k)) / (2 * n)
    trained = copy.deepcopy(new).train()
    stats = rl_update(
        trained, torch.optim.SGD(trained.parameters(), lr=0.0), batch, LossConfig(), grad_clip=1e9,
        tis_cap=cap, on_policy=True,
    )  # fmt: skip
    assert stats["tis_mean"] == pytest.approx(expect, abs=1e-3)


def test_vllm_weight_version_spans_give_every_token_its_version():
    spans = [{"version": "4", "start": 2, "end": 5}, {"version": "3", "start": 0, "end": 2}]
    choice = {
        "token_ids": [7, 8, 9, 10, 11],
        "logprobs": {"content": [{"token_id": t, "logprob": -1.0} for t in (7, 8, 9, 10, 11)]},
        "finish_reason": "length",
        "weight_versions": spans,
    }
    out, labels = parse_generate_response({"choices": [choice]})
    assert labels == ["3", "4"] and out.token_versions == [3, 3, 4, 4, 4]
    gap = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 3, "end": 5}]
    assert parse_generate_response({"choices": [{**choice, "weight_versions": gap}]})[0].token_versions is None


class _QueryStub(StubVLLM):
    """StubVLLM recording each RL route with its query; ``reset_ok`` False answers the reset of
    the running requests' KV as vLLM does when blocks stay held."""

    def __init__(self, reset_ok: bool = True):
        super().__init__()
        self.reset_ok = reset_ok
        self.queries: list[str] = []

    async def rl(self, request: web.Request) -> web.Response:
        self.queries.append(request.path_qs)
        if request.path == "/reset_prefix_cache":
            return web.json_response({"success": self.reset_ok})
        return await super().rl(request)


@pytest.mark.parametrize("partial", [False, True])
async def test_a_vllm_push_keeps_the_generations_in_flight_only_with_partial_rollouts(serve, tmp_path, partial):
    stub = _QueryStub()
    engine = VLLMEngine(await serve(stub), retries=0, partial_rollouts=partial)
    try:
        await engine.update_weights_from_disk(_folder(tmp_path), version=3)
    finally:
        await engine.close()
    if partial:  # frozen at a token boundary; their KV recomputed under the new weights on resume
        pause, reset = "/pause?mode=keep", "/reset_prefix_cache?reset_running_requests=true"
    else:  # the generations in flight finish on the old weights first
        pause, reset = "/pause?mode=wait", "/reset_prefix_cache"
    assert stub.queries == [pause, "/collective_rpc", reset, "/update_weight_version", "/resume"]


async def test_a_vllm_push_that_cannot_drop_the_running_kv_says_so(serve, tmp_path):
    engine = VLLMEngine(await serve(_QueryStub(reset_ok=False)), retries=0, partial_rollouts=True)
    try:
        with pytest.raises(VLLMError, match="could not drop the KV cache of its running requests"):
            await engine.update_weights_from_disk(_folder(tmp_path), version=3)
    finally:
        await engine.close()


def test_kuberl_run_hands_partial_rollouts_to_its_engine_and_keeps_the_bound(tmp_path, monkeypatch):
    """algorithm.partialRollouts reaches the run's local engine; an asyncLevel 1 run trains on
    rollouts whose oldest token is at most one version old."""
    import builders
    from trainer_fakes import FakeSandbox

    import kuberl.rollout.local_engine as local_engine
    from kuberl.trainer.local import run_job
    from tests.test_trainer_pipeline import TINY

    engines: list[LocalEngine] = []

    class Recorded(LocalEngine):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            engines.append(self)

    monkeypatch.setattr(local_engine, "LocalEngine", Recorded)
    monkeypatch.setattr("kuberl.trainer.problems.EVAL_SIZE", 4)
    sft, rl = TINY["spec"]["stages"]
    job = builders.job(
        of=TINY,
        algorithm={**TINY["spec"]["algorithm"], "asyncLevel": 1, "partialRollouts": True},
        stages=[sft, {**rl, "steps": 3}],
        checkpoint={**TINY["spec"]["checkpoint"], "uri": str(tmp_path / "ck")},
    )
    res = run_job(job, tmp_path / "out", use_ray=False, executor_factory=FakeSandbox, quiet=True)
    steps = [h for h in res.history if h.type == "rl"]
    assert len(steps) == 3 and all(h.rollouts_stale == 0 for h in steps)
    assert all(h.staleness_max <= 1 for h in steps), [h.staleness_max for h in steps]
    assert engines and all(e.partial_rollouts for e in engines)
