"""kuberl.operator.validate: what the API server and the webhook refuse, checked before applying.

Imports ``validate`` and ``render``, never ``decide`` or ``runtime``.

* ``apirules``  -- what the API server's own validation refuses in built-in objects (names,
  derived names, labels, quantities, Pod Security "restricted"); ``podrules`` -- the rest of a
  PodSpec's validation; ``canonical`` -- what the API server does to a built-in object before
  storing it;
* ``admission`` -- the webhook's rules; ``checks`` -- all of them over a resource's rendered
  children (``kuberl validate``, the operator's pre-flight);
* ``server_dry_run`` -- ``kuberl validate --server``: the API server's own dry run (the one
  module here that talks to a cluster, through the kubernetes client it imports when called).
"""
