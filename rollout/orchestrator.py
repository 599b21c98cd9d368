"""The orchestrator: which rollout batch generates when, against which policy version.

Asynchronous RL (INTELLECT-2 section 2.1) with ``algorithm.asyncLevel`` k: step n's batch is
submitted at step n-k, once version n-k is on the engines and step n-k's own batch is in hand,
so a batch generates during every update and is at most k versions old when trained on. The
synchronous run is the same object with nothing ahead (k = 0): each step pushes its version,
then generates and collects its batch.

A turn is one engine request and finishes on the weights it started with, so a multi-turn
rollout that spans a push carries the version of each turn and counts as old as its oldest
turn (``grpo.prepare_batch`` drops what is older than k). With ``algorithm.partialRollouts``
the turns in flight go on under the new weights instead, each token labelled with the version
that sampled it, and the rollout counts as old as its oldest token. Batches submitted ahead are
not checkpointed: a resumed run generates them afresh.

Before each rollout phase (at the weight push before it) the orchestrator announces the sandbox
workers the phase asks for, and reports the phase done when its batch is in
(:mod:`kuberl.rollout.phases`), so that the SandboxPool has its pods before the burst.

Weights that engines load from a published folder (:class:`StagedWeightSync`) go out on a
thread of their own (:class:`BackgroundPush`) while the trainer waits for its batch and
updates; the batches ahead are submitted on that thread once the push is done, so the
staleness bound holds and the push leaves the trainer's critical path, as INTELLECT-2's
trainer hands its checkpoint off and keeps training.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol, runtime_checkable

from kuberl.rollout.client import RolloutClient
from kuberl.rollout.engine import ENGINE_FAULTS
from kuberl.rollout.loop import BatchRequest
from kuberl.rollout.phases import PhaseAnnouncer
from kuberl.rollout.scored import Scored


class WeightSync(Protocol):
    def sync(self, model: Any, version: int) -> None:
        """Bring the engines to ``version`` now (every FSDP rank calls it: the gather is collective)."""
        ...


@runtime_checkable
class StagedWeightSync(WeightSync, Protocol):
    def prepare(self, model: Any, version: int) -> Callable[[], None] | None:
        """Take ``version``'s weights now and return the push itself, to run on another thread
        (None where there is nothing to push: another rank, a version already out)."""
        ...


class BackgroundPush:
    """A weight push on a thread of its own, and what must wait for it.

    The batches ahead may only be submitted once the version is on the engines (the staleness
    bound) and once the trainer has the due batch (so they do not fill its tail): :meth:`release`
    hands over those submissions, which the thread runs after the push. :meth:`join` waits for
    all of it and raises what it raised; a push that failed submits nothing.
    """

    def __init__(self, push: Callable[[], None], name: str = "kuberl-push"):
        self._error: BaseException | None = None
        self._pushed = threading.Event()  # set when the push ended (done or failed)
        self._released = threading.Event()
        self._then: list[Callable[[], None]] = []

        def run() -> None:
            try:
                push()
            except BaseException as err:  # noqa: BLE001 - handed to whoever waits or joins
                self._error = err
                return
            finally:
                self._pushed.set()  # after _error: a waiter sees the failure
            try:
                self._released.wait()
                for fn in self._then:
                    fn()
            except BaseException as err:  # noqa: BLE001 - handed to whoever joins
                self._error = err

        self._thread = threading.Thread(target=run, name=name, daemon=True)
        self._thread.start()

    def wait_pushed(self) -> None:
        """Wait until the engines have the version; raises the push's exception."""
        self._pushed.wait()
        if self._error is not None:
            raise self._error

    def release(self, then: Iterable[Callable[[], None]] = ()) -> None:
        """Run ``then`` once the push is done (at once if it is)."""
        if not self._released.is_set():
            self._then = list(then)
            self._released.set()

    def join(self) -> float:
        """Seconds waited; re-raises the push's (or a submission's) exception. Not released by
        then (the step failed before its due batch arrived): nothing is submitted."""
        self.release()
        t = time.perf_counter()
        self._thread.join()
        if self._error is not None:
            raise self._error
        return time.perf_counter() - t


class Orchestrator:
    """The rollout batches of one RL stage, ``ahead`` (asyncLevel) steps ahead of the trainer.

    ``request(ahead)`` is the batch of the step ``ahead`` steps after the current one.
    ``client`` is None on FSDP ranks other than 0: they take part in the weights' gather only.
    Use it as a context manager: leaving early discards the batches nobody will train on.
    The step learns how old its rollouts may be from :attr:`max_staleness`, not from ``ahead``.
    """

    def __init__(
        self,
        client: RolloutClient | None,
        weights: WeightSync,
        request: Callable[[int], BatchRequest],
        *,
        ahead: int,
        phases: PhaseAnnouncer | None = None,
    ):
        self.client = client
        self.weights = weights
        self.request = request
        self.ahead = ahead
        self.phases = phases if client is not None else None  # rank 0 announces
        self.pending: dict[int, int] = {}  # global step -> ticket of its submitted batch
        self._background: BackgroundPush | None = None
        self._busy_mark = client.busy_seconds() if client is not None else None
        self._faults: dict[str, float] = {}  # engine faults counted before this step's rollouts

    @property
    def max_staleness(self) -> int:
        """How many policy versions older than its step an acquired rollout may be: a batch
        submitted ``ahead`` steps early samples on the version pushed then (0: every rollout is
        sampled by the step's own version)."""
        return self.ahead

    def __enter__(self) -> Orchestrator:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._background is not None:  # failed mid-step: settle the thread (that error comes first)
            with contextlib.suppress(Exception):
                self._background.join()
            self._background = None
        for ticket in self.pending.values():  # stopped early or failed: not trained on
            if self.client is not None:
                self.client.discard(ticket)
        self.pending.clear()

    def push(self, model: Any, version: int) -> float:
        """Version ``version`` toward the engines; returns the seconds waited for the push before.

        With batches ahead and weights pushed from a folder, the push runs beside the wait for
        the batch and the update; the stage's first step pushes in line, since its batch needs
        the version at once.
        """
        waited = self.join()
        if self.phases is not None:  # the push takes longer than a sandbox pod's start-up
            self.phases.announce()
        staged = isinstance(self.weights, StagedWeightSync)
        if self.ahead > 0 and staged and (version in self.pending or self.client is None):
            push = self.weights.prepare(model, version)
            if push is not None:
                self._background = BackgroundPush(push)
        else:
            self.weights.sync(model, version)
        return waited

    def acquire(self, step: int, steps_left: int) -> list[list[Scored]]:
        """Step ``step``'s scored batch (rank 0); then the batches of up to ``ahead`` later steps
        of the stage go out, on the push's thread if one runs."""
        assert self.client is not None, "only rank 0 acquires batches"
        if self.ahead == 0:
            # from here on: this step's figures alone (not an eval's); engine faults since the
            # last step (a push that waited for a restarted server) belong to this step
            dropped = self.client.step_stats() or {}
            self._faults = {key: dropped[key] for _, key, _ in ENGINE_FAULTS if key in dropped}
            if self.phases is not None:
                self.phases.started()
            groups = self.client.generate(self.request(0))
            if self.phases is not None:
                self.phases.done(s.traj for g in groups for s in g)
            return groups
        if step not in self.pending:  # the stage's first step: later ones were submitted ahead
            self._submit(step, self.request(0))
            if self.phases is not None:
                self.phases.started()
        groups = self.client.collect(self.pending.pop(step))
        if self.phases is not None:
            self.phases.done(s.traj for g in groups for s in g)
        aheads = range(1, min(self.ahead + 1, steps_left))
        later = [functools.partial(self._submit, step + a, self.request(a)) for a in aheads]
        if self._background is None:
            for submit in later:
                submit()
        else:
            self._background.release(later)
        return groups

    def _submit(self, step: int, request: BatchRequest) -> None:
        if step not in self.pending:
            self.pending[step] = self.client.submit(request)

    def score(self, seqs: list[list[int]], starts: list[int]) -> list[dict[str, Any]]:
        """The engines score ``seqs`` once this step's version has reached them."""
        if self._background is not None:
            self._background.wait_pushed()
        return self.client.score(seqs, starts)

    def figures(self) -> dict[str, float]:
        """Tool-call and KV-cache figures since the last step, and the engines' busy time during it
        (with batches ahead: the calls finished since the last step, later batches' too)."""
        if self.client is None:
            return {}
        out = dict(self.client.step_stats() or {})
        for key, value in self._faults.items():
            out[key] = out.get(key, 0.0) + value
        self._faults = {}
        busy = self.client.busy_seconds()
        if busy is not None and self._busy_mark is not None:
            out["engine_busy_seconds"] = busy - self._busy_mark
        self._busy_mark = busy
        return out

    def join(self) -> float:
        """Wait for the push before (and the submissions it runs); its errors raise here."""
        background, self._background = self._background, None
        return background.join() if background is not None else 0.0
