"""``AgenticRLJob.spec.tracking``: the experiment trackers RL users already use.

Like verl's ``trainer.logger``, a run can log to Weights & Biases, MLflow and TensorBoard at
once; each present section turns its tracker on. The metric names are the Prometheus series
names of DESIGN.md (``kuberl_train_reward_mean``, ...), so a curve has one name everywhere.
The trackers are an optional extra (``pip install 'kuberl[tracking]'``); a job that names one
whose package is missing fails at start with the extra to install.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from kuberl.api.common import CONFIG_KEY_PATTERN, SUBDOMAIN_PATTERN, KubeModel


class SecretKeyRef(KubeModel):
    """A key of a Secret in the job's namespace (rendered as the container's ``secretKeyRef``)."""

    name: str = Field(min_length=1, max_length=253, pattern=SUBDOMAIN_PATTERN, description="Secret name.")
    key: str = Field(
        "api-key", min_length=1, max_length=253, pattern=CONFIG_KEY_PATTERN, description="Key within the Secret."
    )

    @field_validator("key")
    @classmethod
    def _not_a_path(cls, key: str) -> str:
        if key == "." or key.startswith(".."):
            raise ValueError(f"Secret key {key!r} may not be '.' nor start with '..'")
        return key


class WandbSpec(KubeModel):
    project: str = Field(min_length=1, max_length=128, description="W&B project.")
    entity: str | None = Field(None, description="W&B team or user; default: the API key's default entity.")
    mode: Literal["online", "offline"] = Field(
        "online",
        description="offline writes the run under the run folder (wandb/) for a later `wandb sync`; "
        "$WANDB_MODE overrides it.",
    )
    api_key_secret: SecretKeyRef | None = Field(
        None,
        description="Secret holding the API key, given to the trainer pods as WANDB_API_KEY (online mode).",
    )
    tags: list[str] = Field(default_factory=list, max_length=64)


class MlflowSpec(KubeModel):
    tracking_uri: str | None = Field(
        None,
        description="http(s):// tracking server or file: store; default: a file store in the run folder "
        "(mlruns/), which dies with a trainer pod, so name a server on a cluster.",
    )
    experiment: str | None = Field(None, description="Experiment name; default: the job's name.")


class TensorBoardSpec(KubeModel):
    log_dir: str | None = Field(
        None, description="Event-file folder; default: tensorboard/ in the run folder."
    )


class TrackingSpec(KubeModel):
    wandb: WandbSpec | None = None
    mlflow: MlflowSpec | None = None
    tensorboard: TensorBoardSpec | None = None

    def enabled(self) -> list[str]:
        """The trackers this spec turns on, in a fixed order."""
        return [n for n in ("wandb", "mlflow", "tensorboard") if getattr(self, n) is not None]
