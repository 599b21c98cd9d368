"""trainer.precision: the trainer's forwards and backwards in float32, or in bf16 autocast over
float32 weights, gradients and optimizer state."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from trainer_fakes import FakeSandbox

from kuberl.api.job import AgenticRLJob
from kuberl.api.loader import ManifestError, find_one, load_manifests, parse_resource
from kuberl.trainer.grpo import rl_update
from kuberl.trainer.local import run_job
from kuberl.trainer.loss import LossConfig
from kuberl.trainer.model import GPT, GPTConfig
from kuberl.trainer.precision import compute_in
from tests.test_grpo_micro_batches import _batch
from tests.test_trainer_pipeline import TINY, _write


def test_bf16_runs_the_matmuls_in_bf16_and_float32_leaves_them_alone():
    layer = torch.nn.Linear(8, 4)
    x = torch.randn(2, 8)
    with compute_in("float32", "cpu"):
        assert layer(x).dtype == torch.float32
    with compute_in("bf16", torch.device("cpu")):
        assert layer(x).dtype == torch.bfloat16
    assert layer(x).dtype == torch.float32  # only inside the context
    with pytest.raises(
        ValueError, match=r"trainer.precision must be one of \('float32', 'bf16'\), got 'fp16'"
    ):
        compute_in("fp16", "cpu")


def test_the_manifest_takes_the_two_precisions_and_names_the_field_for_others():
    doc = json.loads(json.dumps(TINY))
    assert parse_resource(doc).spec.trainer.precision == "float32"  # the default
    doc["spec"]["trainer"]["precision"] = "bf16"
    assert parse_resource(doc).spec.trainer.precision == "bf16"
    doc["spec"]["trainer"]["precision"] = "fp16"
    with pytest.raises(
        ManifestError,
        match=r"spec.trainer.precision: unknown trainer precision 'fp16'; expected one of float32, bf16",
    ):
        parse_resource(doc)


def _grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def test_a_bf16_update_follows_the_float32_one_and_keeps_float32_weights():
    """The same on-policy update in both precisions: the gradient points the same way (bf16
    rounds the activations, so the numbers differ a little, and must), the loss agrees to
    bf16's resolution, and weights, gradients and AdamW's moments stay float32."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=64, n_layer=2, n_head=2, n_embd=64))
    batch = _batch(64, 3)
    out = {}
    for precision in ("float32", "bf16"):
        m, b = copy.deepcopy(model), copy.deepcopy(batch)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        with compute_in(precision, "cpu"):
            st = rl_update(m, opt, b, LossConfig(), grad_clip=1e9, on_policy=True)
        out[precision] = (st, _grads(m), m, opt, b.old_logprobs)
    (st32, g32, _, _, old32), (st16, g16, m16, opt16, old16) = out["float32"], out["bf16"]
    assert all(p.dtype == torch.float32 for p in m16.parameters())
    assert all(p.grad.dtype == torch.float32 for p in m16.parameters())
    assert all(v.dtype == torch.float32 for s in opt16.state.values() for v in s.values() if v.dim())
    cos = float(torch.nn.functional.cosine_similarity(g32, g16, dim=0))
    assert cos > 0.99, cos
    assert not torch.equal(g32, g16)  # bf16 really computed something else
    assert st16["loss"] == pytest.approx(st32["loss"], rel=0.05, abs=1e-3)
    # pi_old, taken from the update's forward, is bf16-rounded log-probs close to float32's
    gap = max(
        abs(a - c) for r32, r16 in zip(old32, old16, strict=True) for a, c in zip(r32, r16, strict=True)
    )
    assert 0 < gap < 0.1, gap
    assert st16["tokens"] == st32["tokens"]


def test_a_run_with_bf16_trains_sft_and_rl_under_autocast(tmp_path, monkeypatch):
    """Every training forward and backward of a run (SFT steps, the RL update) runs under bf16
    autocast when the manifest asks for it, and none does by default."""
    import kuberl.trainer.rl_step as rl_step_mod
    import kuberl.trainer.sft_stage as sft_stage_mod

    seen: list[tuple[str, bool]] = []
    real_sft, real_update = sft_stage_mod.sft_loss, rl_step_mod.rl_update

    def sft_loss(*args, **kwargs):
        seen.append(
            ("sft", torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16)
        )
        return real_sft(*args, **kwargs)

    def rl_update(*args, **kwargs):
        seen.append(
            ("rl", torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16)
        )
        return real_update(*args, **kwargs)

    monkeypatch.setattr(sft_stage_mod, "sft_loss", sft_loss)
    monkeypatch.setattr(rl_step_mod, "rl_update", rl_update)
    monkeypatch.setattr("kuberl.trainer.problems.EVAL_SIZE", 4)
    monkeypatch.setenv("KUBERL_METRICS_PORT", "0")
    for precision, want in (("bf16", True), (None, False)):
        doc = json.loads(json.dumps(TINY))
        if precision:
            doc["spec"]["trainer"]["precision"] = precision
        seen.clear()
        job = find_one(load_manifests(_write(tmp_path, doc)), AgenticRLJob)
        res = run_job(
            job, tmp_path / f"out-{precision}", use_ray=False, executor_factory=FakeSandbox, quiet=True
        )
        rl = [h for h in res.history if h.type == "rl"]
        assert len(rl) == 2 and all(h.loss == h.loss for h in rl)  # trained, no NaN
        assert [k for k, _ in seen] == ["sft"] * 4 + ["rl"] * 2, seen
        assert all(on == want for _, on in seen), (precision, seen)


def test_bf16_on_a_cpu_without_native_bf16_matmuls_is_warned_about(tmp_path):
    """An AVX2-only CPU runs some bf16 matmuls through PyTorch's reference GEMM (minutes for one
    update that float32 does in seconds): the run says so and names the setting to change."""
    from kuberl.trainer.precision import bf16_warning, cpu_flags

    avx2 = frozenset({"fpu", "sse2", "avx2", "avx512f"})
    warning = bf16_warning("bf16", "cpu", avx2)
    assert warning is not None and "trainer.precision: float32" in warning and "avx512_bf16" in warning
    for native in ("avx512_bf16", "amx_bf16"):
        assert bf16_warning("bf16", "cpu", avx2 | {native}) is None
    assert bf16_warning("float32", "cpu", avx2) is None
    assert bf16_warning("bf16", "cuda", avx2) is None  # accelerators run bf16 natively
    assert bf16_warning("bf16", "cpu", frozenset()) is None  # flags unknown: no guess

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: EPYC\nflags\t\t: fpu avx2 avx512_bf16\n\nprocessor\t: 1\n")
    assert cpu_flags(info) == {"fpu", "avx2", "avx512_bf16"}
    assert cpu_flags(tmp_path / "missing") == frozenset()
