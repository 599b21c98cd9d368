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
from kuberl.util.lifetime import stop_at_step_on_signals

if TYPE_CHECKING:
    from kuberl.api.sandbox_pool import SandboxLimits

REPO_ROOT = Path(__file__).resolve().parent.parent
Handler = Callable[[argparse.Namespace], int]
TRAIN_MODULES = frozenset({"torch", "tokenizers", "transformers", "ray"})
"""Top-level modules of the ``train`` extra; a run without them gets an install hint."""
GRAFANA_TOKEN_ENV = "GRAFANA_TOKEN"


class UsageError(Exception):
    """A command line that cannot work as given; main prints it and exits 2."""


def is_source_checkout(root: Path) -> bool:
    """Whether ``root`` is a kuberl source tree (its pyproject.toml names the kuberl project),
    as opposed to the site-packages folder a wheel was installed into."""
    import tomllib

    try:
        meta = tomllib.loads((root / "pyproject.toml").read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return False
    return meta.get("project", {}).get("name") == "kuberl"


def _cmd_validate(args: argparse.Namespace) -> int:
    from kuberl.api.loader import ManifestError, load_manifests
    from kuberl.operator.validate.checks import check_file

    failed = 0
    for path in args.files:
        try:
            resources = load_manifests(path)
        except ManifestError as err:
            failed += 1
            print(f"INVALID {err}", file=sys.stderr)
            continue
        # The children are rendered as the operator would and checked as the API server would.
        for v in check_file(resources):
            what = f"{path}: {v.resource.KIND}/{v.resource.metadata.name}"
            # --strict: warnings (and the notes that warn) refuse the file, for CI pipelines
            warned = v.warnings or any(n.startswith("warning:") for n in v.notes)
            if v.problems or (args.strict and warned):
                failed += 1
                print(f"INVALID {what}:\n  " + "\n  ".join(v.problems or ["--strict: its warnings count as errors"]), file=sys.stderr)
            else:
                print(f"ok      {what}")
            for note in v.notes:
                print(f"  {note}")
            for warning in v.warnings:  # as kubectl prints the API server's warnings
                print(f"Warning: {what}: {warning}", file=sys.stderr)
    if args.server:
        failed += _validate_on_server(args.files, args.namespace)
    return 1 if failed else 0


def _validate_on_server(files: list[str], namespace: str) -> int:
    """``--server``: each file's objects and their children as the API server judges them (dry run)."""
    from kuberl.api.loader import ManifestError, load_documents
    from kuberl.operator.validate.server_dry_run import ServerUnavailable, dynamic_client, server_problems

    try:
        client = dynamic_client()
    except ServerUnavailable as err:
        print(f"INVALID {err}", file=sys.stderr)
        return 1
    failed = 0
    for path in files:
        try:
            docs = load_documents(path)
        except ManifestError:
            continue  # already reported above
        problems = server_problems(client, docs, namespace)
        if problems:
            failed += 1
            print(f"INVALID {path} (API server dry run):\n  " + "\n  ".join(problems), file=sys.stderr)
        else:
            print(f"ok      {path}: the API server accepts it and every child the operator would make (dry run)")
    return failed


def crd_targets(out: list[str] | None, root: Path = REPO_ROOT) -> list[Path]:
    """crds/ and the Helm chart's copy are written together, so the chart can never lag.

    The default folders exist only in a source checkout; after a wheel install ``root`` is
    site-packages, and writing CRDs there would put them where nobody looks."""
    if out:
        return [Path(o) for o in out]
    if not is_source_checkout(root):
        raise UsageError(
            f"kuberl crds: {root} is not a kuberl source checkout, so there is no crds/ folder to "
            "write; pass --out DIR (repeatable)"
        )
    chart = root / "charts" / "kuberl" / "crds"
    return [root / "crds"] + ([chart] if chart.parent.is_dir() else [])


def _cmd_crds(args: argparse.Namespace) -> int:
    from kuberl.api.crdgen import stale_crds, write_crds

    targets = crd_targets(args.out)
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
    try:
        from kuberl.trainer.local import run_file

        # SIGTERM (suspend, preemption, eviction): the step ends, a checkpoint is written, the run
        # ends with 143; a second SIGTERM or SIGHUP stops it at once, as Ctrl-C does
        with stop_at_step_on_signals():
            return run_file(
                args.file,
                out_dir=args.out,
                ablation=args.algorithm,
                max_minutes=args.max_minutes,
                engines=args.engines,
                weights_dir=args.weights_dir,
            )
    except ImportError as err:
        # Only a missing training dependency gets the hint; any other ImportError is a bug to see.
        if (err.name or "").split(".")[0] not in TRAIN_MODULES:
            raise
        print(
            f"error: `kuberl run` trains locally and needs the train extra ({err.name} is not installed): "
            "pip install 'kuberl[train]'",
            file=sys.stderr,
        )
        return 2


def _cmd_report(args: argparse.Namespace) -> int:
    from kuberl.trainer.report import write_report

    path = write_report(args.run_dir, args.out)
    print(f"wrote {path}")
    return 0


def _cmd_render(args: argparse.Namespace) -> int:

    from kuberl.api import AgenticRLJob, RolloutFleet
    from kuberl.api.loader import dump_yaml_all, load_manifests
    from kuberl.operator.render.builders import build_for

    resources = load_manifests(args.file)
    # A job's referenced fleet, when the same file declares it, shapes its trainer pods.
    fleets = {r.metadata.name: r.spec for r in resources if isinstance(r, RolloutFleet)}

    def fleet_of(r):
        return fleets.get(r.spec.rollout.fleet_ref or "") if isinstance(r, AgenticRLJob) else None

    docs = [m for r in resources for m in build_for(r, namespace=args.namespace, fleet=fleet_of(r))]
    sys.stdout.write(dump_yaml_all(docs))
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
    from kuberl.sandbox.service.app import serve

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
        pin_workers=args.pin_workers,
        idle_timeout_s=args.idle_timeout,
        body_timeout_s=args.body_timeout,
        max_connections=args.max_connections,
    )


def _cmd_operator(args: argparse.Namespace) -> int:
    from kuberl.operator.runtime.main import run_operator

    return run_operator(
        namespaces=args.namespace,
        all_namespaces=args.all_namespaces,
        verbose=args.verbose,
        metrics_port=args.metrics_port,
    )


def _cmd_dashboards(args: argparse.Namespace) -> int:
    from kuberl.dashboards.cli import run as run_dashboards

    if args.dashboards_command == "upload":
        # A token on the command line ends up in shell history and `ps`; the environment does not.
        args.token = args.token or os.environ.get(GRAFANA_TOKEN_ENV)
        if not args.token:
            raise UsageError(f"kuberl dashboards upload: pass --token or set ${GRAFANA_TOKEN_ENV}")

    return run_dashboards(args)


class _ParagraphFormatter(argparse.HelpFormatter):
    """Wraps descriptions and epilogs like argparse does, but keeps their paragraphs and lines."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "\n".join(
            super(_ParagraphFormatter, self)._fill_text(line, width, indent) if line else ""
            for line in text.splitlines()
        )


def build_parser() -> argparse.ArgumentParser:
    fmt = _ParagraphFormatter
    p = argparse.ArgumentParser(
        prog="kuberl",
        description=(
            "Kubernetes-native agentic RL for LLMs (rStar2-Agent GRPO-RoC). The same manifest runs on a "
            "cluster (`kubectl apply -f`) or locally (`kuberl run`)."
        ),
        epilog="Example: kuberl run examples/quickstart.yaml\n"
        "Run `kuberl COMMAND --help` for a command's options.",
        formatter_class=fmt,
    )
    p.add_argument("--version", action="version", version=f"kuberl {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    v = sub.add_parser(
        "validate",
        help="check manifests against the kuberl API, with field-level errors",
        description="Check AgenticRLJob, RolloutFleet and SandboxPool manifests against the kuberl API "
        "models: types, ranges and the cross-field rules (replicas within autoscaling bounds, clip "
        "order, stage budgets vs the fleet's context length, ...). Every problem is reported with "
        "its file, object and field path.\n\n"
        "exit status: 0 every document is valid, 1 at least one file is invalid or unreadable, "
        "2 usage error.",
        epilog="Example: kuberl validate examples/*.yaml",
        formatter_class=fmt,
    )
    v.add_argument(
        "files",
        nargs="+",
        metavar="FILE",
        help="YAML manifest; a file may hold several documents separated by ---, each is checked",
    )
    v.add_argument(
        "--server",
        action="store_true",
        help="also ask the API server of the current kubeconfig context: a dry-run apply (nothing is stored) "
        "of each object and of every child the operator would make of it",
    )
    v.add_argument(
        "--strict",
        action="store_true",
        help="treat warnings (printed as 'Warning: FILE: OBJECT: ...' on stderr) as errors: exit 1",
    )
    v.add_argument(
        "--namespace",
        "-n",
        default="default",
        help="namespace for objects that name none, with --server (default: default)",
    )
    v.set_defaults(func=_cmd_validate)

    c = sub.add_parser(
        "crds",
        help="generate CustomResourceDefinitions from the API models",
        description="Write apiextensions.k8s.io/v1 CRDs (structural schemas, CEL rules, status and "
        "scale subresources, printer columns) generated from the pydantic models. In a source "
        "checkout the default targets are crds/ and the Helm chart's charts/kuberl/crds/; an "
        "installed kuberl needs --out.",
        formatter_class=fmt,
    )
    c.add_argument(
        "--out",
        action="append",
        metavar="DIR",
        help="output folder, repeatable (default in a source checkout: crds/ and charts/kuberl/crds/)",
    )
    c.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 if a folder holds missing, outdated or orphaned CRD files",
    )
    c.set_defaults(func=_cmd_crds)

    r = sub.add_parser(
        "run",
        help="run an AgenticRLJob manifest locally (SFT then GRPO-RoC stages)",
        description="Train the job's model: the stages in order (SFT, then RL with rollouts on an "
        "in-process engine, or on SGLang engines with --engines or inside a trainer pod, and tool calls "
        "in a local sandbox service unless $KUBERL_SANDBOX_URL names one). The model is the builtin "
        "tiny GPT or a Hugging Face causal LM (folder, s3:// prefix or Hub id). Needs the train extra: "
        "pip install 'kuberl[train]'. A run whose checkpoint folder already holds checkpoints is resumed.",
        epilog="Example: kuberl run examples/quickstart.yaml --max-minutes 5",
        formatter_class=fmt,
    )
    r.add_argument("file", metavar="FILE", help="manifest holding an AgenticRLJob (the first one is run)")
    r.add_argument("--out", default=None, help="run folder for checkpoints/metrics (default: runs/<job>)")
    r.add_argument(
        "--algorithm", choices=["grpo-roc", "grpo"], default=None, help="override algorithm.name (ablation)"
    )
    r.add_argument(
        "--max-minutes",
        type=float,
        default=None,
        metavar="M",
        help="stop the run (SFT or RL, whichever stage it is in) after M minutes of wall time; the "
        "same command resumes from the last checkpoint",
    )
    r.add_argument(
        "--engines",
        default=None,
        metavar="URLS",
        help="roll out on these SGLang servers (comma-separated http://host:port) instead of the local "
        "engine; in a trainer pod the operator names the fleet instead ($KUBERL_ROLLOUT_FLEET)",
    )
    r.add_argument(
        "--weights-dir",
        default=None,
        metavar="DIR",
        help="folder the --engines can read, where each new policy version is written for their "
        "update_weights_from_disk (default $KUBERL_WEIGHTS_DIR; the operator mounts the fleet's weightSync)",
    )
    r.set_defaults(func=_cmd_run)

    rp = sub.add_parser(
        "report",
        help="write a run's curves as one self-contained HTML page",
        description="Write RUN_DIR/report.html (or --out): reward, held-out accuracy, tool-error ratio in "
        "positives, clip ratios, response length and truncation, tool-call latency and outcomes, rollout "
        "tokens/s, KV-cache use and step time over the global step, with the stage boundaries - the "
        "training dashboard's panels from the run folder's metrics.jsonl and events.jsonl, for people "
        "without Grafana. The page loads nothing from the network. `kuberl run` writes it at the end "
        "of every run; run this during a run for the curves so far.",
        epilog="Example: kuberl report runs/quickstart",
        formatter_class=fmt,
    )
    rp.add_argument(
        "run_dir", metavar="RUN_DIR", help="run folder of `kuberl run` (its --out; default runs/<job>)"
    )
    rp.add_argument("--out", default=None, metavar="FILE", help="write here instead of RUN_DIR/report.html")
    rp.set_defaults(func=_cmd_report)

    rd = sub.add_parser(
        "render",
        help="print the Kubernetes objects the operator would create for FILE",
        description="Print, as YAML, the objects the operator creates for each resource in FILE "
        "(Deployments or LeaderWorkerSets, Services, NetworkPolicies, the trainer Job, RBAC, KEDA "
        "ScaledObjects), without a cluster; owner references are added by the operator.",
        formatter_class=fmt,
    )
    rd.add_argument("file", metavar="FILE", help="manifest with kuberl resources (several documents allowed)")
    rd.add_argument(
        "--namespace",
        default="default",
        help="namespace for resources whose metadata has none (default: default)",
    )
    rd.set_defaults(func=_cmd_render)

    s = sub.add_parser(
        "sandbox",
        help="the Python tool execution service",
        description="The sandbox service that executes model-written Python for tool calls.",
        formatter_class=fmt,
    )
    ssub = s.add_subparsers(dest="sandbox_command", metavar="SUBCOMMAND", required=True)
    serve = ssub.add_parser(
        "serve",
        help="serve the HTTP/JSON execution API",
        description="Serve the sandbox API. Per-call limits come from $KUBERL_SANDBOX_LIMITS "
        "(the SandboxPool's spec.limits as JSON, set by the operator); flags override it.",
        formatter_class=fmt,
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8080, help="port to listen on (default: 8080)")
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
    serve.add_argument(
        "--no-pin-workers",
        dest="pin_workers",
        action="store_false",
        help="let workers run on any CPU (default: one CPU each where the service may use no more "
        "CPUs than it has workers, e.g. one worker per core)",
    )
    serve.add_argument(
        "--idle-timeout", type=float, default=15.0,
        help="seconds a connection may stay without a complete request head (new or kept alive)",
    )  # fmt: skip
    serve.add_argument(
        "--body-timeout", type=float, default=10.0,
        help="seconds a request's body may take to arrive (else 408 and the connection closed)",
    )  # fmt: skip
    serve.add_argument(
        "--max-connections", type=int, default=4096,
        help="open connections beyond which new ones are closed as they arrive",
    )  # fmt: skip
    serve.set_defaults(func=_cmd_sandbox_serve)

    o = sub.add_parser(
        "operator",
        help="run the kopf operator that reconciles kuberl resources",
        description="Run the operator: reconciles AgenticRLJobs, RolloutFleets and SandboxPools into "
        "the objects `kuberl render` prints and autoscales fleets and pools; with "
        "$KUBERL_WEBHOOK_PORT set it also serves the admission webhooks. Uses the in-cluster service "
        "account, or the current kubeconfig context outside a cluster. Without --namespace or "
        "--all-namespaces it watches $KUBERL_NAMESPACE, else 'default'.",
        formatter_class=fmt,
    )
    o.add_argument("--namespace", "-n", action="append", default=[], help="watch this namespace (repeatable)")
    o.add_argument(
        "--all-namespaces",
        "-A",
        action="store_true",
        help="watch every namespace (needs cluster-wide RBAC, as the Helm chart grants)",
    )
    o.add_argument(
        "--verbose", action="store_true", help="log at DEBUG level (kopf logs every handler run and API call)"
    )
    o.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve the operator's /metrics here (default $KUBERL_OPERATOR_METRICS_PORT or 8080; 0: any free port)",
    )
    o.set_defaults(func=_cmd_operator)

    d = sub.add_parser(
        "dashboards",
        help="generate or upload the Grafana dashboards",
        description="The Grafana dashboards (training, rollout, sandbox), generated from Python "
        "definitions over the metrics catalog.",
        formatter_class=fmt,
    )
    dsub = d.add_subparsers(dest="dashboards_command", metavar="SUBCOMMAND", required=True)
    gen = dsub.add_parser(
        "generate",
        help="write dashboards/generated/*.json",
        description="Write the dashboards' JSON (and the Helm chart's copy in a source checkout).",
        formatter_class=fmt,
    )
    gen.add_argument("--check", action="store_true", help="exit 1 if the committed JSON is stale")
    up = dsub.add_parser(
        "upload",
        help="push dashboards (and run annotations) to Grafana",
        description="Create or update the dashboards in a Grafana folder through its HTTP API, and "
        "optionally post a run's events as annotations.",
        epilog=f"Example: {GRAFANA_TOKEN_ENV}=... kuberl dashboards upload --url http://grafana:3000",
        formatter_class=fmt,
    )
    up.add_argument("--url", required=True, help="Grafana base URL, e.g. http://grafana:3000")
    up.add_argument(
        "--token",
        default=None,
        help=f"Grafana service-account token (default: ${GRAFANA_TOKEN_ENV}; the environment keeps it "
        "out of shell history)",
    )
    up.add_argument(
        "--folder", default="kuberl", help="Grafana folder title to upload into (default: kuberl)"
    )
    up.add_argument("--annotations", default=None, help="events.jsonl of a run to post as annotations")
    d.set_defaults(func=_cmd_dashboards)

    from kuberl.cli_cluster import add_command as add_cluster
    from kuberl.cli_engines import add_commands
    from kuberl.cli_images import add_command as add_images
    from kuberl.cli_status import add_command as add_status

    add_commands(sub, fmt)
    add_status(sub, fmt)
    add_cluster(sub, fmt)
    add_images(sub, fmt)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler: Handler = args.func
    try:
        return handler(args)
    except KeyboardInterrupt:
        return 130
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # noqa: BLE001 - the CLI's last line of defence: one clear line, not a traceback
        from kuberl.api.loader import ManifestError

        if isinstance(err, (ManifestError, FileNotFoundError, ValueError)):
            print(f"error: {err}", file=sys.stderr)
            return 2
        raise
