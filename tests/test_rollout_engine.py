"""LocalEngine: continuous batching must not change what is generated, and log-probs are exact."""

import asyncio
import math

import pytest
import torch

from kuberl.rollout.engine import GenerateOutput, GenerateRequest, derive_seed
from kuberl.rollout.local_engine import LocalEngine, sample_tokens, seeded_uniform
from kuberl.trainer.model import GPT, GPTConfig
from tests.rollout_helpers import single_torch_thread

_one_thread = pytest.fixture(autouse=True, scope="module")(single_torch_thread)


# the model fixture, its logits sharpened so that greedy decoding has no near-ties
pytestmark = pytest.mark.tiny_gpt(size=48, sharpen=20)


def _requests(n: int, seed: int, stop: tuple[int, ...] = ()) -> list[GenerateRequest]:
    g = torch.Generator().manual_seed(seed)
    reqs = []
    for _ in range(n):
        plen = int(torch.randint(1, 16, (1,), generator=g))
        reqs.append(
            GenerateRequest(
                input_ids=torch.randint(0, 48, (plen,), generator=g).tolist(),
                max_new_tokens=int(torch.randint(1, 30, (1,), generator=g)),
                temperature=0.0,
                stop_token_ids=stop,
            )
        )
    return reqs


def _reference_logprobs(model, req: GenerateRequest, out: GenerateOutput) -> list[float]:
    ids = torch.tensor([req.input_ids + out.output_ids])
    with torch.no_grad():
        lp = torch.log_softmax(model(ids)[0][0], dim=-1)
    n = len(req.input_ids)
    return [float(lp[n - 1 + i, t]) for i, t in enumerate(out.output_ids)]


def _greedy_reference(model, req: GenerateRequest, context: int) -> list[int]:
    ids = list(req.input_ids)
    out: list[int] = []
    with torch.no_grad():
        while len(out) < req.max_new_tokens and len(ids) < context:
            tok = int(model(torch.tensor([ids]))[0][0, -1].argmax())
            out.append(tok)
            ids.append(tok)
            if tok in req.stop_token_ids:
                break
    return out


async def test_batched_greedy_equals_sequential_and_logprobs_match_full_forward(model):
    # A stop token that greedy decoding actually emits, so "stop" and "length" both occur.
    probe = _requests(20, seed=1)
    first = [_greedy_reference(model, r, 48)[0] for r in probe]
    stop = (max(set(first), key=first.count),)
    reqs = _requests(20, seed=1, stop=stop)
    engine = LocalEngine(model, max_batch=6, seed=0)  # < 20: requests join a running batch
    batched = await asyncio.gather(*(engine.generate(r) for r in reqs))
    assert engine.prefills > 1, "later requests must join the running batch via prefill"
    assert engine.steps < sum(len(o.output_ids) for o in batched) / 2, "decode steps must be batched"
    for req, out in zip(reqs, batched, strict=True):
        assert out.output_ids == _greedy_reference(model, req, 48)
        alone = await engine.generate(req)
        assert alone.output_ids == out.output_ids
        assert out.output_logprobs == pytest.approx(_reference_logprobs(model, req, out), abs=1e-4)
        expect = "stop" if out.output_ids[-1] in stop else "length"
        assert out.finish_reason == expect
    assert {o.finish_reason for o in batched} == {"stop", "length"}


async def test_context_limit_and_max_total_tokens_admission(model):
    engine = LocalEngine(model, max_batch=64, max_total_tokens=60, seed=0)
    long = GenerateRequest(input_ids=list(range(40)), max_new_tokens=100, temperature=0.0)
    out = await engine.generate(long)
    assert len(out.output_ids) == 8 and out.finish_reason == "length"  # 40 + 8 = block_size 48
    full = await engine.generate(GenerateRequest(input_ids=[1] * 48, max_new_tokens=5))
    assert full == GenerateOutput([], [], "length")
    # 3 requests of 10 + 20 reserve 30 tokens each: only 2 fit in 60 at a time.
    reqs = [GenerateRequest(input_ids=[i + 1] * 10, max_new_tokens=20, temperature=0.0) for i in range(3)]
    before = engine.prefills
    outs = await asyncio.gather(*(engine.generate(r) for r in reqs))
    assert all(len(o.output_ids) == 20 for o in outs)
    assert engine.prefills - before == 2  # the third request waited for a second prefill
    load = await engine.load_metrics()
    assert load.running == 0 and load.queued == 0 and load.kv_cache_utilization == 0.0


async def test_rows_finished_at_the_context_limit_ride_along_safely(model):
    # One row stops at block_size=48 while four keep decoding for 30 more steps next to it.
    reqs = [GenerateRequest(list(range(1, 41)), max_new_tokens=100, temperature=0.0)]
    reqs += [GenerateRequest([i + 1, i + 2], max_new_tokens=40, temperature=0.0) for i in range(4)]
    for fast in (True, False):
        engine = LocalEngine(model, seed=0)
        assert engine.fast_decode, "GPT must get the in-place decode path"
        engine.fast_decode = fast
        outs = await asyncio.gather(*(engine.generate(r) for r in reqs))
        assert [len(o.output_ids) for o in outs] == [8, 40, 40, 40, 40]
        for req, out in zip(reqs, outs, strict=True):
            assert out.output_ids == _greedy_reference(model, req, 48)


async def test_sampling_is_seeded_and_set_weights_changes_outputs(model):
    req = GenerateRequest(input_ids=[1, 2, 3], max_new_tokens=20, temperature=1.0, top_p=0.9)
    a = await LocalEngine(model, seed=7).generate(req)
    b = await LocalEngine(model, seed=7).generate(req)
    assert a.output_ids == b.output_ids and len(a.output_ids) == 20
    reseeded = LocalEngine(model, seed=1)
    reseeded.reseed(7)
    assert (await reseeded.generate(req)).output_ids == a.output_ids
    engine = LocalEngine(model, seed=0)
    greedy = GenerateRequest(input_ids=[1, 2, 3], max_new_tokens=10, temperature=0.0)
    before = await engine.generate(greedy)
    other = GPT(model.config)
    engine.set_weights(other.state_dict())
    after = await engine.generate(greedy)
    assert after.output_ids == _greedy_reference(other.eval(), greedy, 48)
    assert after.output_logprobs == pytest.approx(_reference_logprobs(other, greedy, after), abs=1e-4)
    assert after.output_logprobs != pytest.approx(before.output_logprobs, abs=1e-3)
    # The engine serves its own copy: the caller's module is untouched.
    assert not torch.equal(model.wte.weight, other.wte.weight)


def test_top_p_keeps_the_nucleus_only():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]).repeat(2000, 1))
    g = torch.Generator().manual_seed(0)
    temps = torch.ones(2000)
    toks, lps = sample_tokens(logits, temps, torch.full((2000,), 0.7), g)
    assert set(toks.tolist()) == {0, 1}
    assert torch.allclose(lps, logits.gather(-1, toks[:, None]).squeeze(-1))
    toks, _ = sample_tokens(logits, torch.zeros(2000), torch.ones(2000), g)
    assert set(toks.tolist()) == {0}


async def test_bad_requests_are_clear_errors(model):
    engine = LocalEngine(model)
    with pytest.raises(ValueError, match="input_ids must not be empty"):
        await engine.generate(GenerateRequest(input_ids=[], max_new_tokens=3))
    with pytest.raises(ValueError, match="top_p"):
        await engine.generate(GenerateRequest(input_ids=[1], max_new_tokens=3, top_p=0.0))
    with pytest.raises(ValueError, match="max_batch"):
        LocalEngine(model, max_batch=0)


async def test_cancelled_caller_leaves_the_batch(model):
    engine = LocalEngine(model, seed=0)
    slow = asyncio.ensure_future(engine.generate(GenerateRequest([1, 2], max_new_tokens=40, temperature=0.0)))
    fast = engine.generate(GenerateRequest([3, 4], max_new_tokens=3, temperature=0.0))
    out = await fast
    slow.cancel()
    with pytest.raises(asyncio.CancelledError):
        await slow
    await asyncio.sleep(0.05)
    assert len(out.output_ids) == 3
    assert (await engine.load_metrics()).running == 0
    await engine.close()


async def test_a_failing_forward_fails_the_batch_and_the_engine_recovers(model):
    engine = LocalEngine(model, seed=0)
    good = GenerateRequest([1, 2], max_new_tokens=3, temperature=0.0)
    with pytest.raises(IndexError):
        await asyncio.gather(
            engine.generate(good), engine.generate(GenerateRequest([1000], max_new_tokens=3))
        )
    await asyncio.sleep(0)
    assert not await engine.health()
    out = await engine.generate(good)
    assert len(out.output_ids) == 3 and await engine.health()


async def test_seeded_sampling_does_not_depend_on_the_batch():
    """A seeded request samples the same tokens alone, in a big batch, or joining a running one."""
    torch.manual_seed(1)
    model = GPT(GPTConfig(vocab_size=48, block_size=48, n_layer=2, n_head=2, n_embd=32)).eval()  # not sharp
    g = torch.Generator().manual_seed(3)
    reqs = [
        GenerateRequest(
            torch.randint(0, 48, (int(torch.randint(1, 16, (1,), generator=g)),), generator=g).tolist(),
            max_new_tokens=int(torch.randint(5, 30, (1,), generator=g)),
            temperature=1.0,
            top_p=0.95 if i % 2 else 1.0,
            seed=1000 + i,
        )
        for i in range(24)
    ]

    async def run(order: list[int], max_batch: int) -> dict[int, GenerateOutput]:
        engine = LocalEngine(model, max_batch=max_batch, seed=order[0])  # engine seed is irrelevant
        outs = await asyncio.gather(*(engine.generate(reqs[i]) for i in order))
        return dict(zip(order, outs, strict=True))

    big = await run(list(range(24)), 64)
    joined = await run(list(reversed(range(24))), 5)
    for i in range(len(reqs)):
        alone = (await run([i], 1))[i]
        assert big[i].output_ids == joined[i].output_ids == alone.output_ids, i
        assert big[i].output_logprobs == pytest.approx(alone.output_logprobs, abs=1e-4)
    assert len({tuple(o.output_ids) for o in big.values()}) > 20  # seeds differ: samples differ
    again = await run(list(range(24)), 64)
    other_seed = GenerateRequest(reqs[0].input_ids, reqs[0].max_new_tokens, seed=reqs[0].seed + 1)
    assert again[0].output_ids == big[0].output_ids
    assert (await LocalEngine(model).generate(other_seed)).output_ids != big[0].output_ids


def test_inverse_cdf_sampling_follows_the_tempered_distribution():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05])).repeat(4000, 1)
    u = torch.tensor([seeded_uniform(12345, k) for k in range(4000)], dtype=torch.float64)
    assert 0.0 <= float(u.min()) and float(u.max()) < 1.0 and abs(float(u.mean()) - 0.5) < 0.02
    for temp, top_p in ((1.0, 1.0), (2.0, 1.0), (1.0, 0.7)):
        toks, lps = sample_tokens(logits, torch.full((4000,), temp), torch.full((4000,), top_p), uniforms=u)
        want = torch.softmax(logits[0] / temp, dim=-1)
        if top_p < 1.0:
            want = torch.tensor([0.5, 0.3, 0.0, 0.0]) / 0.8  # the nucleus {0, 1}, renormalized
        freq = torch.bincount(toks, minlength=4).double() / 4000
        assert torch.allclose(freq, want.double(), atol=0.025), (temp, top_p, freq, want)
        assert torch.allclose(lps, logits.gather(-1, toks[:, None]).squeeze(-1))  # raw-logit log-probs
    # a uniform of (almost) 1 still lands on a token with mass, never past the nucleus
    edge = torch.tensor([1.0 - 2.0**-53], dtype=torch.float64)
    toks, _ = sample_tokens(logits[:1], torch.ones(1), torch.full((1,), 0.7), uniforms=edge)
    assert toks.tolist() == [1]


def test_derive_seed_is_deterministic_and_separates_its_parts():
    seeds = {derive_seed(7, i, j) for i in range(20) for j in range(20)}
    assert len(seeds) == 400 and all(0 <= s < 2**63 for s in seeds)
    assert derive_seed(7, 1, 2) == derive_seed(7, 1, 2) != derive_seed(7, 2, 1)
    assert derive_seed(7, 1) != derive_seed(8, 1) and derive_seed(-1, 3) >= 0


async def test_generated_tokens_are_counted_per_engine(model):
    from prometheus_client import REGISTRY

    def exported() -> float:
        return (
            REGISTRY.get_sample_value("kuberl_rollout_generated_tokens_total", {"engine": "count-me"}) or 0.0
        )

    before = exported()
    engine = LocalEngine(model, name="count-me", seed=0)
    reqs = [GenerateRequest([1, 2, i + 3], max_new_tokens=5 + i, seed=i) for i in range(6)]
    outs = await asyncio.gather(*(engine.generate(r) for r in reqs))
    total = sum(len(o.output_ids) for o in outs)
    assert total > 0 and engine.generated_tokens == total
    assert exported() - before == total


async def test_seeded_rollout_groups_do_not_depend_on_batching():
    """rollout_group(seed=...) seeds rollout (i, j) and its turns: engine batch size is irrelevant."""
    from kuberl.rollout.loop import rollout_group
    from kuberl.rollout.scheduler import Scheduler
    from tests.rollout_helpers import ByteTokenizer, FakeExecutor

    tok = ByteTokenizer()
    torch.manual_seed(0)
    m = GPT(GPTConfig(vocab_size=tok.vocab_size, block_size=128, n_layer=1, n_head=2, n_embd=32)).eval()
    with torch.no_grad():  # end turns early, so rollouts have several turns of different lengths
        m.wte.weight[tok.eos_id] += 0.5 * m.wte.weight[tok.OFFSET + ord("a")]
    prompts = ["<|im_start|>user\\n12*34=?<|im_end|>\\n<|im_start|>assistant\\n", "a", "bc"]

    async def run(max_batch: int, seed: int):
        sched = Scheduler([LocalEngine(m, max_batch=max_batch, seed=max_batch)])
        groups = await rollout_group(
            sched, tok, FakeExecutor(), prompts, 3, seed=seed, max_turns=3, max_response_tokens=40
        )
        return [[(t.response_ids, t.logprobs) for t in g] for g in groups]

    wide, narrow = await run(64, seed=5), await run(2, seed=5)
    for gw, gn in zip(wide, narrow, strict=True):
        for (ids_w, lps_w), (ids_n, lps_n) in zip(gw, gn, strict=True):
            assert ids_w == ids_n
            assert lps_w == pytest.approx(lps_n, abs=1e-4)
    assert len({tuple(ids) for g in wide for ids, _ in g}) == 9  # every rollout has its own seed
    assert await run(64, seed=6) != wide


async def test_score_gives_the_sampling_logprobs_under_the_weights_served_now(model):
    """The asynchronous spot check's probe: an engine scores a sequence with the weights (and
    version) it serves at that moment."""
    eng = LocalEngine(model, max_batch=4)
    eng.set_weights(model.state_dict(), version=3)
    req = GenerateRequest(input_ids=[5, 9, 2], max_new_tokens=12, temperature=1.0, seed=11)
    out = await eng.generate(req)
    scored = await eng.score(req.input_ids + out.output_ids, start=len(req.input_ids))
    assert scored.weight_version == 3
    assert scored.logprobs == pytest.approx(out.output_logprobs, abs=1e-5)
    # Other weights: all zero, so every token is equally likely (log 1/48) whatever came before.
    eng.set_weights({k: torch.zeros_like(v) for k, v in model.state_dict().items()}, version=4)
    moved = await eng.score(req.input_ids + out.output_ids, start=len(req.input_ids))
    assert moved.weight_version == 4
    assert moved.logprobs == pytest.approx([-math.log(48)] * len(out.output_ids), abs=1e-5)
    for bad in (0, len(req.input_ids + out.output_ids)):
        with pytest.raises(ValueError, match="start must be in"):
            await eng.score(req.input_ids + out.output_ids, start=bad)
    await eng.close()
