"""kuberl.operator.render: pure spec -> manifests, the children of each resource.

Imports only ``render``, the API models and the sandbox's token variable name.

* ``builders``  -- ``build_for``: every child of a resource (pools, fleets; the operator's own
  Deployment and RBAC); ``job_builder`` -- an AgenticRLJob's; ``keda`` -- KEDA ScaledObjects on
  the autoscaler's ``signals``; ``render_common`` -- the shared labels, ports and accelerator
  scheduling;
* ``engines``   -- what differs between SGLang and vLLM pods; ``isolation`` -- the
  NetworkPolicies of sandboxes and engines; ``rbac`` -- the operator's own RBAC;
  ``tracking_env`` -- a trainer pod's tracker environment;
* ``podtemplate`` -- merging a component's podTemplate override; ``sizing`` -- cpu/memory/shm/
  cache sizes of engine and trainer pods; ``trainer_runs`` -- checkpoint volume, restarts, the
  run's config hash; ``disruption`` -- PodDisruptionBudgets, topology spread and packing;
* ``signals``   -- the series autoscaling reads and its pipeline targets.
"""
