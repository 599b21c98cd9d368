"""kuberl.operator.runtime: the operator process and its I/O; the one room that imports all others.

* ``kube``      -- a small async REST client for the children; ``cache`` -- its informer-like
  read cache;
* ``context``   -- the operator's configuration and its memory of the objects;
  ``handlers``  -- one reconcile pass over one object; ``loops`` -- the resync and autoscale
  loops over all of them; ``registry`` -- their kopf wiring; ``main`` -- ``kuberl operator``;
  ``leader`` -- leader election on a Lease; ``liveness`` -- the pod's /livez;
* ``pods``      -- ready pods, their /metrics and a trainer's progress; ``summary`` -- the
  periodic log line; ``metrics`` -- the operator's own Prometheus metrics.
"""
