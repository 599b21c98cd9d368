"""Trainer-pod environment for ``spec.tracking``: the W&B API key from its Secret.

The key never enters the job's ConfigMap (which anyone who can read the namespace's
ConfigMaps sees); the kubelet puts it into the trainer container from the Secret.
"""

from __future__ import annotations

from typing import Any

from kuberl.api.tracking import TrackingSpec


def tracking_env(tracking: TrackingSpec | None) -> list[dict[str, Any]]:
    """``WANDB_API_KEY`` from ``spec.tracking.wandb.apiKeySecret``, when one is named."""
    wandb = tracking.wandb if tracking is not None else None
    if wandb is None or wandb.api_key_secret is None:
        return []
    ref = wandb.api_key_secret
    return [{"name": "WANDB_API_KEY", "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}]
