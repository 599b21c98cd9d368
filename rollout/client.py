"""How the trainer reaches the rollout worker: one typed protocol, two forms.

:class:`RolloutClient` names every request the trainer side makes. :class:`InProcessClient`
calls a :class:`~kuberl.rollout.worker.RolloutWorker` in this process (``--no-ray``);
:class:`RayClient` runs the worker as a Ray actor and mirrors its metrics into this process's
exporter. The trainer and the orchestrator hold a ``RolloutClient`` and never know which.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Any, Protocol

import torch

from kuberl.rollout.loop import BatchRequest
from kuberl.rollout.mirror import RolloutMirror
from kuberl.rollout.scored import Scored
from kuberl.rollout.worker import RolloutWorker
from kuberl.util.lifetime import descendants, reap_on_exit


class RolloutClient(Protocol):
    """The rollout worker as the trainer sees it."""

    def submit(self, request: BatchRequest) -> int:
        """Start a batch; returns a ticket for :meth:`collect`."""
        ...

    def collect(self, ticket: int) -> list[list[Scored]]:
        """The scored groups of a submitted batch (waits for them)."""
        ...

    def discard(self, ticket: int) -> None:
        """Cancel a submitted batch that will not be trained on."""
        ...

    def generate(self, request: BatchRequest) -> list[list[Scored]]:
        """Submit a batch and wait for it."""
        ...

    def set_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """The local engine takes new weights as a state dict."""
        ...

    def load_weights(self, path: str, version: int) -> None:
        """Every fleet engine loads the published HF folder ``path``."""
        ...

    def score(self, seqs: list[list[int]], starts: list[int]) -> list[dict[str, Any]]:
        """The engines score sequences with the weights they serve now (the spot check)."""
        ...

    def step_stats(self) -> dict[str, float]:
        """Tool-call figures and peak KV-cache use since the last call."""
        ...

    def busy_seconds(self) -> float:
        """Wall time during which a rollout batch was generating, up to now."""
        ...

    def build_sft(self, problems: list, *, seed: int, error_fraction: float, style: str) -> list:
        """SFT traces whose tool outputs come from the sandbox."""
        ...

    def close(self) -> None: ...


class InProcessClient:
    """The rollout worker in this process."""

    def __init__(self, worker: RolloutWorker):
        self.worker = worker

    def submit(self, request: BatchRequest) -> int:
        return self.worker.submit_rollouts(request)

    def collect(self, ticket: int) -> list[list[Scored]]:
        return self.worker.collect_rollouts(ticket)

    def discard(self, ticket: int) -> None:
        self.worker.discard_rollouts(ticket)

    def generate(self, request: BatchRequest) -> list[list[Scored]]:
        return self.worker.rollouts(request)

    def set_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        self.worker.set_weights(state_dict, version)

    def load_weights(self, path: str, version: int) -> None:
        self.worker.load_weights(path, version)

    def score(self, seqs: list[list[int]], starts: list[int]) -> list[dict[str, Any]]:
        return self.worker.score_on_engines(seqs, starts)

    def step_stats(self) -> dict[str, float]:
        return self.worker.step_stats()

    def busy_seconds(self) -> float:
        return self.worker.busy_seconds()

    def build_sft(self, problems: list, *, seed: int, error_fraction: float, style: str) -> list:
        return self.worker.build_sft(problems, seed=seed, error_fraction=error_fraction, style=style)

    def close(self) -> None:
        self.worker.close()


def _signal_handlers() -> dict[signal.Signals, Any]:
    """This process's Python handlers of the signals that end a run (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    sigs = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    return {s: h for s in sigs if (h := signal.getsignal(s)) is not None}


class RayClient:
    """The rollout worker as a Ray actor, its metrics mirrored into this process's exporter.

    The actor's registry is never served, so a thread polls ``rollout_metrics`` every
    ``POLL_SECONDS`` (live KV use and in-flight rollouts, as a scrape would see them) and after
    every batch collected; the actor takes two concurrent calls so the poll is answered mid-step.
    """

    POLL_SECONDS = 1.0

    def __init__(self, worker_args: tuple, worker_kwargs: dict, use_gpu: bool):
        import ray

        # Ray's core worker installs handlers of its own for SIGTERM and friends (they log a
        # stack and end the process at once, skipping every `finally` of the run): the handlers
        # in force before ray.init are put back.
        handlers = _signal_handlers()
        before = set(descendants(os.getpid()))
        # a local cluster this client starts is its own, stopped in close(): a caller that runs
        # jobs in one process (a notebook, a test session) keeps no raylet and GCS per job
        self.owns_ray = False
        if not ray.is_initialized():
            if os.environ.get("RAY_ADDRESS"):
                ray.init(log_to_driver=False)
            else:
                ray.init(
                    num_cpus=2,
                    num_gpus=1 if use_gpu else 0,
                    include_dashboard=False,
                    log_to_driver=False,
                    configure_logging=False,
                )
                # the local cluster's processes (raylet, GCS, its agents) end with this one,
                # even when it is killed: its agents would otherwise outlive it
                reap_on_exit(set(descendants(os.getpid())) - before)
                self.owns_ray = True
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        self.ray = ray
        actor = ray.remote(num_cpus=1, num_gpus=0.5 if use_gpu else 0, max_concurrency=2)(RolloutWorker)
        self.handle = actor.remote(*worker_args, **worker_kwargs)
        self.mirror = RolloutMirror()
        self.poll_error: BaseException | None = None  # telemetry only: the next real call surfaces failures
        self._mirror_lock = threading.Lock()
        self._stop = threading.Event()
        self._poller = threading.Thread(target=self._poll, name="rollout-metrics", daemon=True)
        self._poller.start()

    def _get(self, ref: Any, timeout: float | None = None) -> Any:
        return self.ray.get(ref, timeout=timeout)

    def sync_metrics(self) -> None:
        snapshot = self._get(self.handle.rollout_metrics.remote(), timeout=60)
        with self._mirror_lock:
            self.mirror.apply(snapshot)

    def _poll(self) -> None:
        while not self._stop.wait(self.POLL_SECONDS):
            try:
                self.sync_metrics()
            except Exception as err:  # noqa: BLE001 - the actor may be starting or stopping
                self.poll_error = err

    def submit(self, request: BatchRequest) -> int:
        return self._get(self.handle.submit_rollouts.remote(request))

    def collect(self, ticket: int) -> list[list[Scored]]:
        groups = self._get(self.handle.collect_rollouts.remote(ticket))
        self.sync_metrics()
        return groups

    def discard(self, ticket: int) -> None:
        self._get(self.handle.discard_rollouts.remote(ticket))

    def generate(self, request: BatchRequest) -> list[list[Scored]]:
        groups = self._get(self.handle.rollouts.remote(request))
        self.sync_metrics()
        return groups

    def set_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        self._get(self.handle.set_weights.remote(state_dict, version))

    def load_weights(self, path: str, version: int) -> None:
        self._get(self.handle.load_weights.remote(path, version))

    def score(self, seqs: list[list[int]], starts: list[int]) -> list[dict[str, Any]]:
        return self._get(self.handle.score_on_engines.remote(seqs, starts))

    def step_stats(self) -> dict[str, float]:
        return self._get(self.handle.step_stats.remote())

    def busy_seconds(self) -> float:
        return self._get(self.handle.busy_seconds.remote())

    def build_sft(self, problems: list, *, seed: int, error_fraction: float, style: str) -> list:
        ref = self.handle.build_sft.remote(problems, seed=seed, error_fraction=error_fraction, style=style)
        return self._get(ref)

    def close(self) -> None:
        self._stop.set()
        self._poller.join(timeout=10)
        with contextlib.suppress(Exception):
            self.sync_metrics()
        with contextlib.suppress(Exception):
            self._get(self.handle.close.remote())
        self.ray.kill(self.handle)
        if self.owns_ray:
            self.ray.shutdown()
