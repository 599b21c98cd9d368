"""`kuberl cluster up|down|status`: a local control plane of the real Kubernetes programs."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def _real_node(args: argparse.Namespace) -> bool:
    """--real-node / --no-real-node as given; by default, where the host has what it needs."""
    from kuberl.cluster.node_config import missing_prerequisites

    return args.real_node if args.real_node is not None else not missing_prerequisites()


def _cmd_up(args: argparse.Namespace) -> int:
    from kuberl.cluster.build import cache_root
    from kuberl.cluster.control_plane import up
    from kuberl.cluster.errors import ClusterError
    from kuberl.cluster.nodes import default_pools

    t0 = time.monotonic()
    real = _real_node(args)
    # The real node takes the CPU nodes' place: pods that would land on a simulated CPU node run there.
    cpu = args.cpu_nodes if args.cpu_nodes is not None else (0 if real else 4)
    print(f"starting the control plane{' and a real node' if real else ''} in {args.dir} (programs cached "
          f"under {cache_root()}; the first run builds them from their Go modules, several minutes) ...",
          file=sys.stderr)
    try:
        state = up(Path(args.dir), pools=default_pools(mi300x=args.mi300x_nodes, h100=args.h100_nodes, cpu=cpu),
                   timeout=args.timeout, pod_cidr=args.pod_cidr, real_node=real)
    except ClusterError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"control plane up at {state.server} ({time.monotonic() - t0:.0f} s)"
          + (", with the real node kuberl-node" if real else "")
          + f"; stop it with `kuberl cluster down --dir {args.dir}`", file=sys.stderr)
    print(f"export KUBECONFIG={state.kubeconfig}")
    return 0


def _cmd_build(args: argparse.Namespace) -> int:
    from kuberl.cluster.build import cache_root, ensure_binaries
    from kuberl.cluster.errors import ClusterError

    t0 = time.monotonic()
    try:
        paths = ensure_binaries()
        if _real_node(args):
            from kuberl.cluster.node import check_prerequisites, ensure_node_binaries

            check_prerequisites()
            paths.update(ensure_node_binaries())
    except ClusterError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"control-plane programs ready under {cache_root()} ({time.monotonic() - t0:.0f} s):", file=sys.stderr)
    for name, path in paths.items():
        print(f"{name}\t{path}")
    return 0


def _cmd_down(args: argparse.Namespace) -> int:
    from kuberl.cluster.control_plane import down

    stopped = down(Path(args.dir))
    print(f"stopped: {', '.join(stopped)}" if stopped else f"nothing was running in {args.dir}", file=sys.stderr)
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    from kuberl.cluster.control_plane import ClusterState, running

    folder = Path(args.dir).absolute()
    state = running(folder)
    if state is not None:
        print(f"running at {state.server}: " + ", ".join(f"{n} (pid {p})" for n, p in state.pids.items()))
        print(f"export KUBECONFIG={state.kubeconfig}")
        return 0
    print("not running" + (" (some programs ended: `kuberl cluster down` then `up`)"
                           if ClusterState.load(folder) else ""))
    return 1


def _real_node_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--real-node", action=argparse.BooleanOptionalAction, default=None,
        help="one real node, kuberl-node: containerd, runc, CNI, a kubelet and kube-proxy on this host, where "
             "pods run in containers (default: on where the host is root and has containerd, runc, "
             "containernetworking-plugins, iptables, conntrack and gcc)")


def add_command(sub: argparse._SubParsersAction, fmt: type[argparse.HelpFormatter]) -> None:
    c = sub.add_parser(
        "cluster",
        help="a local control plane: kube-apiserver, controllers, scheduler, etcd, kwok nodes",
        description="A single-node Kubernetes control plane on 127.0.0.1 made of the real programs "
        "(built once from their Go modules, needs Go), with kwok's simulated MI300X, H100 and CPU nodes: "
        "pods are scheduled and marked Running and Ready as kubelets would, no container runs.",
        formatter_class=fmt,
    )
    csub = c.add_subparsers(dest="cluster_command", metavar="SUBCOMMAND", required=True)
    u = csub.add_parser(
        "up",
        help="build (first time) and start; prints the KUBECONFIG line",
        description="Start the control plane in DIR and wait until its nodes are Ready; the programs are "
        "built from their Go modules the first time ($KUBERL_K8S_CACHE, default ~/.cache/kuberl/k8s). A cluster "
        "already running in DIR is left as it is; one stopped there restarts with its objects and ports.",
        formatter_class=fmt,
    )
    u.add_argument("--dir", required=True, help="the cluster's folder (certificates, etcd data, logs, kubeconfig)")
    u.add_argument("--mi300x-nodes", type=int, default=6, help="nodes with 8 amd.com/gpu each (default 6: the examples fit)")
    u.add_argument("--h100-nodes", type=int, default=2, help="nodes with 8 nvidia.com/gpu each (default 2)")
    u.add_argument("--cpu-nodes", type=int, default=None,
                   help="simulated CPU nodes, 96 cores and 250 pods each (default 4, or 0 beside a real node)")
    _real_node_flag(u)
    u.add_argument("--timeout", type=float, default=120.0, help="seconds each program has to get ready")
    u.add_argument("--pod-cidr", default="10.244.0.0/16",
                   help="the simulated pods' IP range (default 10.244.0.0/16); route it to this host "
                        "(`ip route add local CIDR dev lo`) to serve a pod's IP from a local process")
    u.set_defaults(func=_cmd_up)
    b = csub.add_parser(
        "build",
        help="build the programs into the cache without starting anything",
        description="Build etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubectl and kwok (and, "
        "for the real node, kubelet, kube-proxy and the pause image) from their Go modules at the pinned "
        "versions into $KUBERL_K8S_CACHE (default ~/.cache/kuberl/k8s), or do nothing where they are there; "
        "print each program's path.",
        formatter_class=fmt,
    )
    _real_node_flag(b)
    b.set_defaults(func=_cmd_build)
    d = csub.add_parser(
        "down",
        help="stop the cluster in DIR (its folder stays)",
        description="Stop every program of the cluster in DIR (SIGTERM, SIGKILL after 10 s). Its folder stays: "
        "`up` restarts it with the same objects.",
        formatter_class=fmt,
    )
    d.add_argument("--dir", required=True, help="the cluster's folder")
    d.set_defaults(func=_cmd_down)
    s = csub.add_parser(
        "status",
        help="whether the cluster in DIR runs",
        description="Print the API server's address, the programs' process ids and the KUBECONFIG line; exit 1 "
        "when it is not running.",
        formatter_class=fmt,
    )
    s.add_argument("--dir", required=True, help="the cluster's folder")
    s.set_defaults(func=_cmd_status)
