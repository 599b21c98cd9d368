"""The policy a run trains and the tokenizer it speaks: the builtin tiny GPT or an HF causal LM.

``model.base: builtin:tiny-gpt`` is the quickstart's ~1M-parameter GPT over the locally trained
``builtin:arith-bpe`` tokenizer. Anything else is a Hugging Face causal LM (a folder, an
``s3://`` prefix or a Hub id, see :mod:`kuberl.trainer.hf`) with the tokenizer of its folder
unless ``model.tokenizer`` names another. A resumed run always takes the tokenizer stored in
its checkpoint: the embeddings are indexed by that vocabulary.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from torch import nn

from kuberl.api.job import AgenticRLJob
from kuberl.api.loader import ManifestError
from kuberl.trainer.model import GPT, GPTConfig
from kuberl.trainer.tokenizer import BUILTIN as BUILTIN_TOKENIZER
from kuberl.trainer.tokenizer import BPETokenizer, load_tokenizer

BUILTIN_MODEL = "builtin:tiny-gpt"
TINY_DEFAULTS = {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 256}


def is_builtin(job: AgenticRLJob) -> bool:
    return job.spec.model.base == BUILTIN_MODEL


def model_cache_dir(out: Path) -> Path:
    """Where downloaded models go: $HF_HOME (the operator mounts a cache volume there) or the run folder."""
    return Path(os.environ.get("HF_HOME") or out / "models")


def model_dir(job: AgenticRLJob, out: Path) -> Path:
    """The local folder of an HF policy (downloaded first when needed)."""
    from kuberl.trainer.hf import resolve_model_dir

    try:
        return resolve_model_dir(job.spec.model.base, model_cache_dir(out))
    except ValueError as err:
        raise ManifestError(f"spec.model.base: {err}") from err


def build_tokenizer(job: AgenticRLJob, out: Path, saved: str | None = None) -> BPETokenizer:
    if saved is not None:
        return BPETokenizer.from_str(saved)
    source = job.spec.model.tokenizer
    if source is None:
        source = BUILTIN_TOKENIZER if is_builtin(job) else str(model_dir(job, out))
    try:
        return load_tokenizer(source, out, seed=job.spec.data.seed)
    except ValueError as err:
        raise ManifestError(f"spec.model.tokenizer: {err}") from err


def build_policy(job: AgenticRLJob, tok: BPETokenizer, out: Path) -> nn.Module:
    if not is_builtin(job):
        from kuberl.trainer.hf import load_hf_policy

        if job.spec.model.config:
            raise ManifestError(
                "spec.model.config overrides the builtin model only; an HF model has its config.json"
            )
        policy = load_hf_policy(model_dir(job, out))
        vocab = policy.hf.get_input_embeddings().num_embeddings
        if tok.vocab_size > vocab:
            raise ManifestError(
                f"the tokenizer has {tok.vocab_size} tokens but the model embeds only {vocab}; "
                "spec.model.tokenizer must be the model's own"
            )
        return policy
    cfg = dict(TINY_DEFAULTS)
    for k, v in job.spec.model.config.items():  # camelCase from the manifest; validated below
        cfg["".join("_" + c.lower() if c.isupper() else c for c in k)] = v
    cfg["vocab_size"] = tok.vocab_size
    try:
        return GPT(GPTConfig.from_dict(cfg))
    except ValueError as err:
        raise ManifestError(f"spec.model.config: {err}") from err


def same_architecture(saved: dict[str, Any] | None, current: dict[str, Any]) -> bool:
    """Whether a checkpoint's ``model_config`` fits the model the job builds.

    For an HF policy the folder may differ between runs (a cache path), so only the shape
    (block size) is compared there; the state dict load itself checks every tensor.
    """
    if saved is None:
        return True
    if "hf" in saved or "hf" in current:
        return ("hf" in saved) == ("hf" in current) and saved.get("block_size") == current.get("block_size")
    return saved == current


def check_chat_template(model: Path, style: str) -> None:
    """Refuse a model whose own chat template writes turns differently from the rollout loop.

    Rollouts and SFT traces are rendered by ``rollout.template`` in ChatML (``<|im_start|>role
    ... <|im_end|>``, tool results in a user turn, as rStar2-Agent's fig. 3); a pretrained chat
    model learns fastest when that is its own format. The model's template renders a
    user/assistant/tool exchange and the result must contain what the loop writes, so a model
    with another format (or none) stops before the run with a message that says so.
    """
    from transformers import AutoTokenizer

    from kuberl.rollout import template

    tok = AutoTokenizer.from_pretrained(str(model))
    if not getattr(tok, "chat_template", None):
        raise ManifestError(
            f"model folder {model} has no chat template (tokenizer_config.json chat_template or "
            "chat_template.jinja): kuberl writes prompts and tool turns in the model's chat format, so it "
            "needs one; add the model's template (`kuberl models prepare` writes it)"
        )
    q, a, t = "QUESTION", "ANSWER", "<tool_response>TOOL</tool_response>"
    messages = [{"role": "user", "content": q}, {"role": "assistant", "content": a}, {"role": "user", "content": t}]
    try:
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as err:  # a template that fails on plain messages is as unusable as none
        raise ManifestError(f"model folder {model}: its chat template fails on a plain conversation: {err}") from err
    turn = a + template.IM_END + template.render_tool_responses(["TOOL"])
    wanted = [turn] + ([template.render_prompt(q, "compact")] if style == "compact" else [])
    missing = [w for w in wanted if w not in text]
    if missing:
        raise ManifestError(
            f"model folder {model}: its chat template is not ChatML as the rollout loop writes it "
            f"(expected {missing[0]!r} in {text!r}); kuberl's tool-call format needs a ChatML chat model "
            "(SmolLM2, Qwen) or SFT on that format first"
        )
