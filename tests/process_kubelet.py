"""A kubelet stand-in for the engine pods of a local control plane: each pod kwok runs gets a
real local process listening on the pod's IP, and a pod that leaves gets the kubelet's
termination (the pod's own preStop hook, then SIGTERM).

kwok plays the kubelet for pod status only: it marks pods Running and Ready and gives them an IP
from the cluster's pod range, but runs nothing. With that range routed to this host (``ip route
add local CIDR dev lo`` in a network namespace of the test's own), whatever listens on a pod's IP
is what the pod's EndpointSlice entry reaches, so a trainer that discovers the fleet through the
API server talks to these processes exactly as it would to the pods' containers.

kwok deletes a pod as soon as it is marked for deletion, so the pod leaves its EndpointSlice at
once (a kubelet's pod would stay, marked terminating: the same drain for the trainer); the
process here then gets what the kubelet gives a terminating container: the preStop exec hook
(run with the container's POD_IP) within terminationGracePeriodSeconds, then SIGTERM.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class PodProcess:
    """One pod's stand-in process and what happened to it (monotonic times)."""

    name: str
    ip: str
    pod: dict[str, Any]
    handle: Any = None  # what ``start`` returned: has .stop()
    error: str | None = None
    started_at: float = field(default_factory=time.monotonic)
    serving_at: float | None = None
    leaving_at: float | None = None
    drained_s: float | None = None
    stopped_at: float | None = None
    leave: threading.Event = field(default_factory=threading.Event)


class ProcessKubelet:
    """Polls the pods matching ``selector`` in ``namespace`` and keeps one process per running pod.

    ``start(pod, ip, port)`` starts the pod's process and returns once it serves (a thread per pod
    calls it), returning a handle with ``stop()``; ``list_pods()`` returns the pods as the API
    server has them.
    """

    def __init__(self, list_pods: Callable[[], list[dict]], start: Callable[[dict, str, int], Any],
                 *, interval: float = 0.5):
        self.list_pods = list_pods
        self.start_process = start
        self.interval = interval
        self.pods: dict[str, PodProcess] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="process-kubelet", daemon=True)
        self._workers: list[threading.Thread] = []

    def __enter__(self) -> ProcessKubelet:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        for worker in self._workers:
            worker.join(timeout=330)  # pods leaving finish their drain; the others stop below
        for proc in self.pods.values():  # stop() again is harmless; a start that outlived its pod
            if proc.handle is not None:
                proc.handle.stop()
                proc.stopped_at = proc.stopped_at or time.monotonic()

    def serving(self) -> list[PodProcess]:
        with self._lock:
            return [p for p in self.pods.values() if p.serving_at is not None and p.leaving_at is None]

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                pods = self.list_pods()
            except Exception as err:  # the API server blinking: try again
                print(f"process-kubelet: listing pods failed: {err}", file=sys.stderr)
                pods = None
            if pods is not None:
                self._reconcile(pods)
            self._stop.wait(self.interval)

    def _reconcile(self, pods: list[dict]) -> None:
        present = {}
        for pod in pods:
            name = pod["metadata"]["name"]
            ip = (pod.get("status") or {}).get("podIP")
            deleting = pod["metadata"].get("deletionTimestamp") is not None
            if not deleting:
                present[name] = pod
            if ip and not deleting and name not in self.pods:
                proc = PodProcess(name, ip, pod)
                with self._lock:
                    self.pods[name] = proc
                self._spawn(self._run, proc)
        with self._lock:
            leaving = [p for n, p in self.pods.items() if n not in present and p.leaving_at is None]
            for proc in leaving:
                proc.leaving_at = time.monotonic()
                proc.leave.set()

    def _spawn(self, target: Callable[[PodProcess], None], proc: PodProcess) -> None:
        worker = threading.Thread(target=target, args=(proc,), name=f"pod-{proc.name}", daemon=True)
        self._workers.append(worker)
        worker.start()

    def _run(self, proc: PodProcess) -> None:
        """The pod's whole life on one thread, which outlives its process: processes started
        with a parent-death signal (``kuberl.util.lifetime``) get it when the thread that started
        them ends, not only the process."""
        (container,) = proc.pod["spec"]["containers"]
        port = next(p["containerPort"] for p in container["ports"] if p.get("name") == "http")
        try:
            proc.handle = self.start_process(proc.pod, proc.ip, port)
            proc.serving_at = time.monotonic()
        except Exception as err:
            proc.error = f"{type(err).__name__}: {err}"
            print(f"process-kubelet: {proc.name} did not start: {proc.error}", file=sys.stderr)
            return
        while not proc.leave.wait(1.0) and not self._stop.is_set():
            pass
        if proc.leave.is_set():
            self._terminate(proc)

    def _terminate(self, proc: PodProcess) -> None:
        """The kubelet's part: the preStop hook within the grace period, then SIGTERM."""
        (container,) = proc.pod["spec"]["containers"]
        grace = float(proc.pod["spec"].get("terminationGracePeriodSeconds", 30))
        hook = ((container.get("lifecycle") or {}).get("preStop") or {}).get("exec", {}).get("command")
        t0 = time.monotonic()
        if hook and proc.handle is not None:
            command = [sys.executable if hook[0] in ("python3", "python") else hook[0], *hook[1:]]
            try:
                subprocess.run(command, env={"POD_IP": proc.ip}, timeout=grace, check=False)
            except subprocess.TimeoutExpired:
                pass
        proc.drained_s = time.monotonic() - t0
        if proc.handle is not None:
            proc.handle.stop()
        proc.stopped_at = time.monotonic()
