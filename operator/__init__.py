"""kuberl.operator: turns AgenticRLJob, RolloutFleet and SandboxPool into running pods.

Modules (imported lazily; ``builders`` needs neither kopf nor a cluster):

* ``builders``  -- pure spec -> manifests (``build_for``; KEDA ScaledObject; the operator's own
  Deployment and RBAC);
* ``autoscale`` -- pure autoscaling decisions and /metrics parsing;
* ``status``    -- pure phase/condition rules; ``admission`` -- webhook rules;
* ``kube``      -- a small async REST client for the children;
* ``handlers``  -- kopf registry + resync loop; ``main`` -- ``kuberl operator``;
* ``schemas``   -- validation of built manifests; ``testing`` -- the kmock-based API emulator.
"""
