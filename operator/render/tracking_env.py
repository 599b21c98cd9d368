"""Trainer-pod environment for ``spec.tracking``: the W&B API key from its Secret, and where the
trackers' local stores live.

The key never enters the job's ConfigMap (which anyone who can read the namespace's
ConfigMaps sees); the kubelet puts it into the trainer container from the Secret.
"""

from __future__ import annotations

from typing import Any

from kuberl.api.tracking import TrackingSpec


def tracking_env(tracking: TrackingSpec | None, kept_dir: str | None = None) -> list[dict[str, Any]]:
    """``WANDB_API_KEY`` from ``spec.tracking.wandb.apiKeySecret``, when one is named, and
    ``KUBERL_TRACKING_DIR`` on the checkpoint volume (``kept_dir``) when there is one: the run
    folder dies with the pod, so a restarted trainer would find neither the MLflow file store
    holding the run it resumes into nor the TensorBoard event files it continues."""
    if tracking is None:
        return []
    env = []
    if kept_dir is not None:
        env.append({"name": "KUBERL_TRACKING_DIR", "value": f"{kept_dir.rstrip('/')}/tracking"})
    ref = tracking.wandb.api_key_secret if tracking.wandb is not None else None
    if ref is not None:
        env.append({"name": "WANDB_API_KEY", "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}})
    return env
