"""What keeps a training run going across pod failures and spec edits (pure).

* ``checkpoint_claim``: the job's own PersistentVolumeClaim for checkpoints (a relative
  ``checkpoint.uri``). It is owned by the AgenticRLJob, not by the trainer Job, so replacing or
  restarting the trainer keeps it; it is deliberately not in ``CHILD_KINDS`` either, so switching
  ``checkpoint.uri`` to s3:// never prunes the checkpoints already written.
* ``POD_FAILURE_POLICY``: an evicted or preempted pod (condition DisruptionTarget), or a trainer
  that stopped on SIGTERM with a checkpoint (exit 143: the Job suspended), is replaced without
  counting as a failure; any other failure fails the trainer Job, which the operator then
  restarts as a whole (``restart_decision``), since a distributed step cannot survive a lost rank.
* ``run_document``: the part of the job document that defines the run. The trainer pod
  template's config hash covers only this, so a label or annotation on the AgenticRLJob, or
  suspend/resume, does not replace a running trainer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kuberl.api import AgenticRLJob

NEVER_PRUNED = frozenset({("v1", "PersistentVolumeClaim")})
"""Children the operator creates but never deletes (the garbage collector does, with the job)."""
CHECKPOINT_VOLUME = "checkpoints"
CHECKPOINT_DIR = "/var/run/kuberl/checkpoints"
"""Where ``kuberl run --out /var/run/kuberl`` keeps a relative checkpoint.uri (trainer/local.py)."""

SIGTERM_EXIT = 143
"""``kuberl run`` stopped by SIGTERM at a step boundary, its checkpoint written (trainer/local.py)."""
POD_FAILURE_POLICY: dict[str, Any] = {
    "rules": [
        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        # The Job controller counts the pods it deletes on suspension as failed once they exit
        # non-zero; a trainer that stopped on SIGTERM has checkpointed and is no failure.
        {"action": "Ignore", "onExitCodes": {"containerName": "trainer", "operator": "In", "values": [SIGTERM_EXIT]}},
    ]
}


def checkpoint_claim_name(job_name: str) -> str:
    return f"{job_name}-checkpoints"


def checkpoint_claim(job: AgenticRLJob, namespace: str, labels: dict[str, str]) -> dict[str, Any] | None:
    """The checkpoint PVC (None when checkpoints go to s3:// or an absolute path).

    ReadWriteOnce for one trainer pod; several pods on several nodes all write to it, which
    needs ReadWriteMany (the StorageClass must offer it, e.g. CephFS, EFS, Filestore).
    """
    ckpt = job.spec.checkpoint
    if not ckpt.on_volume:
        return None
    spec: dict[str, Any] = {
        "accessModes": ["ReadWriteOnce" if job.spec.trainer.replicas == 1 else "ReadWriteMany"],
        "resources": {"requests": {"storage": str(ckpt.volume_size)}},
    }
    if ckpt.storage_class_name:
        spec["storageClassName"] = ckpt.storage_class_name
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {
            "name": checkpoint_claim_name(job.metadata.name),
            "namespace": namespace,
            "labels": dict(labels),
        },
        "spec": spec,
    }


def checkpoint_volume(job: AgenticRLJob) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """(volume, volumeMount) of the checkpoint PVC in the trainer pods."""
    if not job.spec.checkpoint.on_volume:
        return None
    return (
        {"name": CHECKPOINT_VOLUME, "persistentVolumeClaim": {"claimName": checkpoint_claim_name(job.metadata.name)}},
        {"name": CHECKPOINT_VOLUME, "mountPath": CHECKPOINT_DIR},
    )


def run_document(doc: dict[str, Any]) -> dict[str, Any]:
    """The resolved job document without what does not change the run (metadata beyond the
    name and namespace, suspend): the input of the trainer's config hash."""
    spec = {k: v for k, v in (doc.get("spec") or {}).items() if k != "suspend"}
    # How often to retry and how big the volume is do not change what is trained.
    if isinstance(spec.get("trainer"), dict):
        spec["trainer"] = {k: v for k, v in spec["trainer"].items() if k != "maxRestarts"}
    if isinstance(spec.get("checkpoint"), dict):
        spec["checkpoint"] = {
            k: v for k, v in spec["checkpoint"].items() if k not in ("volumeSize", "storageClassName")
        }
    return {"metadata": {k: doc.get("metadata", {}).get(k) for k in ("name", "namespace")}, "spec": spec}


@dataclass(frozen=True)
class RestartDecision:
    restart: bool
    restarts: int  # after this decision
    message: str


def restart_decision(failed_message: str, restarts: int, max_restarts: int) -> RestartDecision:
    """Whether a failed trainer is restarted (resuming from its last checkpoint) or the job fails."""
    if restarts < max_restarts:
        return RestartDecision(
            True,
            restarts + 1,
            f"trainer failed ({failed_message}); restart {restarts + 1} of {max_restarts}, resuming from "
            "the last checkpoint",
        )
    return RestartDecision(
        False, restarts, f"{failed_message}; no restarts left ({restarts} of trainer.maxRestarts {max_restarts})"
    )
