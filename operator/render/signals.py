"""The series autoscaling reads and its pipeline targets.

The operator's own timer (``autoscale``) and the KEDA ScaledObjects that replace it (``keda``)
scale on the same signals; both read their names and targets here.
"""

SANDBOX_QUEUE = "kuberl_sandbox_queue_depth"
SANDBOX_BUSY = "kuberl_sandbox_workers_busy"
TRAINER_WAITING = "kuberl_rollout_requests_waiting"
TRAINER_INFLIGHT = "kuberl_rollout_requests_inflight"
TRAINER_PHASE_WORKERS = "kuberl_rollout_phase_workers"
TRAINER_ROLLOUT_WAIT = "kuberl_train_rollout_wait_ratio"
TRAINER_ENGINE_IDLE = "kuberl_train_engine_idle_ratio"
TRAINER_ENGINES_SERVED = "kuberl_train_engines_in_service"
PIPELINE_WAIT_TARGET = 0.15  # a trainer may wait this much of its step for rollouts
PIPELINE_IDLE_TARGET = 0.3  # engines may idle this much of a step, waiting for weights
