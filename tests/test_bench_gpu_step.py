"""bench/gpu_step.py, the one-GPU RL update and generation script, run on the CPU at its tiny size:
its figures must follow from what it timed, and the full size must be Qwen2.5-1.5B's shape."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "bench"

spec = importlib.util.spec_from_file_location("bench_gpu_step", BENCH / "gpu_step.py")
gpu_step = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = gpu_step  # dataclasses look their module up there
spec.loader.exec_module(gpu_step)


def test_tiny_run_reports_figures_consistent_with_its_timings():
    out = subprocess.run(
        [sys.executable, str(BENCH / "gpu_step.py"), "--size", "tiny", "--device", "cpu", "--rows", "6",
         "--len", "32", "--steps", "2", "--gen-rows", "3", "--gen-tokens", "10"],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    rec = json.loads(out.stdout.strip().splitlines()[-1])
    assert rec["device"] == "cpu" and rec["size"] == "tiny"
    assert rec["update_tokens_per_s"] == pytest.approx(6 * 32 / rec["update_step_s"], rel=1e-3)
    # no stop token: every request runs to its budget
    assert rec["gen_tokens"] == 3 * 10
    assert rec["gen_tokens_per_s"] == pytest.approx(rec["gen_tokens"] / rec["gen_s"], rel=1e-3)
    assert rec["update_mfu"] is None  # no peak is known for a CPU unless given
    params = rec["params_b"] * 1e9
    flops = gpu_step.update_flops(round(params), 2, 64, 6, 32)
    assert rec["update_tflops"] == pytest.approx(flops / rec["update_step_s"] / 1e12, rel=0.05, abs=2e-3)


def test_the_update_trains_the_policy():
    """The timed update is a real optimizer step: the weights move and stay finite."""
    from kuberl.trainer.grpo import StepBatch, rl_update
    from kuberl.trainer.loss import LossConfig

    policy, cfg = gpu_step.build_policy("tiny", "cpu")
    before = [p.detach().clone() for p in policy.parameters()]
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    seqs = torch.randint(0, cfg.vocab_size, (4, 16), generator=torch.Generator().manual_seed(1)).tolist()
    batch = StepBatch(seqs, [[0] * 4 + [1] * 12] * 4, [[-1.0] * 16] * 4, [1.0, -1.0, 1.0, -1.0])
    rl_update(policy, opt, batch, LossConfig(), grad_clip=1.0, on_policy=True)
    moved = sum(not torch.equal(a, b) for a, b in zip(before, policy.parameters(), strict=True))
    assert moved == len(before)
    assert all(torch.isfinite(p).all() for p in policy.parameters())


def test_full_size_is_qwen2_5_1_5b_shape():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**gpu_step.SIZES["qwen2.5-1.5b"], tie_word_embeddings=True)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    params = sum(p.numel() for p in model.parameters())
    # Qwen2.5-1.5B: 1.54B parameters with its q/k/v biases (~0.3M), 1.31B without the embedding
    assert 1.53e9 < params < 1.55e9
    assert cfg.num_attention_heads // cfg.num_key_value_heads == 6


@pytest.mark.parametrize(
    ("name", "override", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", None, 989.4),
        ("NVIDIA H100 PCIe", None, 756.0),
        ("NVIDIA H200", None, 989.4),
        ("AMD Instinct MI300X", None, 1307.4),
        ("Some Future Chip", None, None),
        ("NVIDIA H100 80GB HBM3", 500.0, 500.0),
    ],
)
def test_peak_by_device_name(name, override, peak):
    assert gpu_step.peak_tflops(name, override) == peak


def test_flops_count_weights_and_causal_attention():
    # 6 N per token for the weights plus 6 L d T per token for attention over T tokens
    assert gpu_step.update_flops(1000, 2, 8, 3, 10) == 6 * 1000 * 30 + 6 * 2 * 8 * 10 * 30


def test_bad_sizes_are_refused_with_the_flag_named():
    out = subprocess.run(
        [sys.executable, str(BENCH / "gpu_step.py"), "--size", "tiny", "--rows", "0"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2 and "--rows must be >= 1, got 0" in out.stderr
