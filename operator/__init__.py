"""kuberl.operator: turns AgenticRLJob, RolloutFleet and SandboxPool into running pods.

Four rooms, imported lazily (``render`` needs neither kopf nor a cluster); every import points
down: ``runtime`` -> ``decide`` / ``validate`` -> ``render`` -> ``kuberl.api``. ``decide`` and
``validate`` do not import each other, and nothing but ``runtime`` imports ``runtime``.

* ``render``   -- pure builders of the children: spec in, manifests out;
* ``validate`` -- what the API server and the webhook would refuse, checked before anything is
  applied (``kuberl validate``, the operator's pre-flight, the admission webhook);
* ``decide``   -- pure decisions on live state: autoscaling, phases and conditions, orphans;
* ``runtime``  -- the operator process and its I/O: the REST client and its cache, the
  reconcile pass, the loops, kopf wiring, leader election, /livez and /metrics.

The kmock API emulator and the schema checks the unit tests use live in tests/ (kube_emulator,
rbac_emulation, kube_schemas); end-to-end claims rest on the real control plane
(``kuberl cluster``, tests/test_k8s_*.py).
"""
