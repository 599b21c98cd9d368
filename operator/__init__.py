"""kuberl.operator: turns AgenticRLJob, RolloutFleet and SandboxPool into running pods.

Modules (imported lazily; ``builders`` needs neither kopf nor a cluster):

* ``builders``  -- pure spec -> manifests (``build_for``; pools, fleets; the operator's own
  Deployment and RBAC); ``job_builder`` -- an AgenticRLJob's; ``keda`` -- KEDA ScaledObjects on
  the autoscaler's signals; ``render_common`` -- their shared labels, ports and accelerator
  scheduling;
* ``autoscale`` -- pure autoscaling decisions and /metrics parsing;
* ``status``    -- pure phase/condition rules; ``admission`` -- webhook rules;
* ``kube``      -- a small async REST client for the children; ``cache`` -- its informer-like
  read cache; ``canonical`` -- what the API server does to a built-in object before storing it;
* ``context``   -- the operator's configuration and its memory of the objects;
  ``handlers``  -- one reconcile pass over one object; ``loops`` -- the resync and autoscale
  loops over all of them; ``registry`` -- their kopf wiring; ``main`` -- ``kuberl operator``;
  ``leader`` -- leader election on a Lease; ``liveness`` -- the pod's /livez;
* ``pods``      -- ready pods, their /metrics and a trainer's progress; ``children`` -- rules
  on children that need the live state (orphans, inline replicas); ``summary`` -- the periodic
  log line; ``metrics`` -- the operator's own Prometheus metrics;
* ``engines``   -- what differs between SGLang and vLLM pods; ``isolation`` -- the
  NetworkPolicies of sandboxes and engines; ``rbac`` -- the operator's own RBAC;
  ``tracking_env`` -- a trainer pod's tracker environment;
* ``server_dry_run`` -- ``kuberl validate --server``: the API server's own dry run;
* ``apirules``  -- what the API server's own validation refuses in built-in objects (names,
  derived names, labels, quantities, Pod Security "restricted"; ``podrules``: the rest of a
  PodSpec's validation); ``checks`` -- those rules over a
  resource's rendered children (`kuberl validate`, the operator's pre-flight);
* ``conditions`` -- refused children and pods as status conditions and events;
* ``podtemplate`` -- merging a component's podTemplate override; ``sizing`` -- cpu/memory/shm/
  cache sizes of engine and trainer pods; ``trainer_runs`` -- checkpoint volume, restarts, the
  run's config hash; ``disruption`` -- PodDisruptionBudgets, topology spread and packing.

The kmock API emulator and the schema checks the unit tests use live in tests/ (kube_emulator,
rbac_emulation, kube_schemas); end-to-end claims rest on the real control plane
(``kuberl cluster``, tests/test_k8s_*.py).
"""
