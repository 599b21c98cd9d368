"""The `kuberl` command line.

Subcommands import their component lazily, so `kuberl validate` works without torch and
`kuberl --help` is instant.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from kuberl import __version__

if TYPE_CHECKING:
    from kuberl.api.sandbox_pool import SandboxLimits

REPO_ROOT = Path(__file__).resolve().parent.parent
Handler = Callable[[argparse.Namespace], int]


def _cmd_validate(args: argparse.Namespace) -> int:
    from kuberl.api.loader import ManifestError, load_manifests

    failed = 0
    for path in args.files:
        try:
            resources = load_manifests(path)
        except ManifestError as err:
            failed += 1
            print(f"INVALID {err}", file=sys.stderr)
            continue
        for r in resources:
            print(f"ok      {path}: {r.KIND}/{r.metadata.name}")
    return 1 if failed else 0


def _crd_targets(out: list[str] | None) -> list[Path]:
    """crds/ and the Helm chart's copy are written together, so the chart can never lag."""
    if out:
        return [Path(o) for o in out]
    chart = REPO_ROOT / "charts" / "kuberl" / "crds"
    return [REPO_ROOT / "crds"] + ([chart] if chart.parent.is_dir() else [])


def _cmd_crds(args: argparse.Namespace) -> int:
    from kuberl.api.crdgen import stale_crds, write_crds

    targets = _crd_targets(args.out)
    if args.check:
        rc = 0
        for target in targets:
            stale = stale_crds(target)
            if stale:
                print(f"stale CRDs in {target}: {', '.join(stale)}; run `kuberl crds`", file=sys.stderr)
                rc = 1
            else:
                print(f"CRDs in {target} are up to date")
        return rc
    for target in targets:
        for path in write_crds(target):
            print(f"wrote {path}")
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from kuberl.trainer.local import run_file

    return run_file(args.file, out_dir=args.out, ablation=args.algorithm, max_minutes=args.max_minutes)


def _cmd_render(args: argparse.Namespace) -> int:
    import yaml

    from kuberl.api.loader import load_manifests
    from kuberl.operator.builders import build_for

    docs = [m for r in load_manifests(args.file) for m in build_for(r, namespace=args.namespace)]
    sys.stdout.write(yaml.safe_dump_all(docs, sort_keys=False))
    return 0


def sandbox_limits(env_json: str | None, overrides: dict[str, float | int | None]) -> SandboxLimits:
    """Limits of one tool call: a SandboxPool pod gets them as ``KUBERL_SANDBOX_LIMITS`` (the
    pool's ``spec.limits`` as JSON, written by the operator); explicit flags win over it."""
    from pydantic import ValidationError

    from kuberl.api.sandbox_pool import SandboxLimits

    base: dict[str, object] = {}
    if env_json:
        try:
            base = json.loads(env_json)
        except json.JSONDecodeError as e:
            raise SystemExit(f"KUBERL_SANDBOX_LIMITS is not valid JSON: {e}") from None
        if not isinstance(base, dict):
            raise SystemExit("KUBERL_SANDBOX_LIMITS must be a JSON object like the pool's spec.limits")
    merged = {**base, **{k: v for k, v in overrides.items() if v is not None}}
    try:
        return SandboxLimits.model_validate(merged)
    except ValidationError as e:
        raise SystemExit(f"invalid sandbox limits: {e}") from None


def _cmd_sandbox_serve(args: argparse.Namespace) -> int:
    from kuberl.sandbox.server import serve

    limits = sandbox_limits(
        os.environ.get("KUBERL_SANDBOX_LIMITS"),
        {
            "timeoutSeconds": args.timeout_seconds,
            "memoryMB": args.memory_mb,
            "maxOutputBytes": args.max_output_bytes,
            "maxProcesses": args.max_processes,
        },
    )
    return serve(
        host=args.host,
        port=args.port,
        workers=args.workers,
        pool=args.pool,
        limits=limits,
        batch_size=args.batch_size,
        flush_ms=args.flush_ms,
        queue_limit=args.queue_limit,
        verify_timeout_seconds=args.verify_timeout_seconds,
        isolation=args.isolation,
    )


def _cmd_operator(args: argparse.Namespace) -> int:
    from kuberl.operator.main import run_operator

    return run_operator(
        namespaces=args.namespace,
        all_namespaces=args.all_namespaces,
        verbose=args.verbose,
        metrics_port=args.metrics_port,
    )


def _cmd_dashboards(args: argparse.Namespace) -> int:
    from kuberl.dashboards.cli import run as run_dashboards

    return run_dashboards(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kuberl",
        description=(
            "Kubernetes-native agentic RL for LLMs (rStar2-Agent GRPO-RoC). The same manifest runs on a "
            "cluster (`kubectl apply -f`) or locally (`kuberl run`)."
        ),
        epilog="Example: kuberl run examples/quickstart.yaml",
    )
    p.add_argument("--version", action="version", version=f"kuberl {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    v = sub.add_parser("validate", help="check manifests against the kuberl API, with field-level errors")
    v.add_argument("files", nargs="+", metavar="FILE")
    v.set_defaults(func=_cmd_validate)

    c = sub.add_parser("crds", help="generate CustomResourceDefinitions from the API models")
    c.add_argument(
        "--out",
        action="append",
        help="output folder, repeatable (default: crds/ and charts/kuberl/crds/)",
    )
    c.add_argument("--check", action="store_true", help="exit 1 if the folder is stale instead of writing")
    c.set_defaults(func=_cmd_crds)

    r = sub.add_parser("run", help="run an AgenticRLJob manifest locally (SFT then GRPO-RoC stages)")
    r.add_argument("file", metavar="FILE")
    r.add_argument("--out", default=None, help="run folder for checkpoints/metrics (default: runs/<job>)")
    r.add_argument(
        "--algorithm", choices=["grpo-roc", "grpo"], default=None, help="override algorithm.name (ablation)"
    )
    r.add_argument("--max-minutes", type=float, default=None, help="stop RL early after this wall time")
    r.set_defaults(func=_cmd_run)

    rd = sub.add_parser("render", help="print the Kubernetes objects the operator would create for FILE")
    rd.add_argument("file", metavar="FILE")
    rd.add_argument("--namespace", default="default")
    rd.set_defaults(func=_cmd_render)

    s = sub.add_parser("sandbox", help="the Python tool execution service")
    ssub = s.add_subparsers(dest="sandbox_command", metavar="SUBCOMMAND", required=True)
    serve = ssub.add_parser(
        "serve",
        help="serve the HTTP/JSON execution API",
        description="Serve the sandbox API. Per-call limits come from $KUBERL_SANDBOX_LIMITS "
        "(the SandboxPool's spec.limits as JSON, set by the operator); flags override it.",
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8080)
    serve.add_argument(
        "--workers", type=int, default=None, help="fork-server workers (default: one per core)"
    )
    serve.add_argument("--pool", default="local", help="pool name used as the metrics label")
    serve.add_argument(
        "--timeout-seconds",
        type=float,
        default=None,
        help="wall deadline of one call (default: env, else 10.0)",
    )
    serve.add_argument(
        "--memory-mb", type=int, default=None, help="memory limit of one call (default: env, else 1024)"
    )
    serve.add_argument(
        "--max-output-bytes",
        type=int,
        default=None,
        help="stdout beyond this is truncated (default: env, else 16384)",
    )
    serve.add_argument(
        "--max-processes", type=int, default=None, help="pids limit of one call (default: env, else 32)"
    )
    serve.add_argument("--batch-size", type=int, default=4, help="calls dispatched to a worker at once")
    serve.add_argument("--flush-ms", type=float, default=0.0, help="wait this long to fill a batch")
    serve.add_argument("--queue-limit", type=int, default=4096, help="queued calls before 429 backpressure")
    serve.add_argument("--verify-timeout-seconds", type=float, default=5.0, help="math-verify deadline")
    serve.add_argument(
        "--isolation",
        choices=["full", "basic"],
        default="full",
        help="full: per-call namespaces, uids and cgroups where permitted (root); basic: only what "
        "an unprivileged container allows (rlimits, setsid, seccomp, orphan sweep)",
    )
    serve.set_defaults(func=_cmd_sandbox_serve)

    o = sub.add_parser("operator", help="run the kopf operator that reconciles kuberl resources")
    o.add_argument("--namespace", "-n", action="append", default=[], help="watch this namespace (repeatable)")
    o.add_argument("--all-namespaces", "-A", action="store_true")
    o.add_argument("--verbose", action="store_true")
    o.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve the operator's /metrics here (default $KUBERL_OPERATOR_METRICS_PORT or 8080; 0: any free port)",
    )
    o.set_defaults(func=_cmd_operator)

    d = sub.add_parser("dashboards", help="generate or upload the Grafana dashboards")
    dsub = d.add_subparsers(dest="dashboards_command", metavar="SUBCOMMAND", required=True)
    gen = dsub.add_parser("generate", help="write dashboards/generated/*.json")
    gen.add_argument("--check", action="store_true", help="exit 1 if the committed JSON is stale")
    up = dsub.add_parser("upload", help="push dashboards (and run annotations) to Grafana")
    up.add_argument("--url", required=True)
    up.add_argument("--token", required=True)
    up.add_argument("--folder", default="kuberl")
    up.add_argument("--annotations", default=None, help="events.jsonl of a run to post as annotations")
    d.set_defaults(func=_cmd_dashboards)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler: Handler = args.func
    try:
        return handler(args)
    except KeyboardInterrupt:
        return 130
    except Exception as err:  # noqa: BLE001 - the CLI's last line of defence: one clear line, not a traceback
        from kuberl.api.loader import ManifestError

        if isinstance(err, (ManifestError, FileNotFoundError, ValueError)):
            print(f"error: {err}", file=sys.stderr)
            return 2
        raise
