"""kuberl.operator.validate: what the API server and the webhook refuse, checked before applying.

Imports ``validate`` and ``render``, never ``decide`` or ``runtime``.

* ``apirules``  -- what the API server's own validation refuses in built-in objects (names,
  derived names, labels, quantities, Pod Security "restricted"); ``podrules`` -- the rest of a
  PodSpec's validation; ``canonical`` -- what the API server does to a built-in object before
  storing it;
* ``feasibility`` -- settings under which a run cannot learn or start (greedy decoding, idle
  GPUs, a job and its fleet that disagree), shared by the webhook and ``kuberl validate``;
* ``admission`` -- the webhook's rules; ``checks`` -- all of them over a resource's rendered
  children (``kuberl validate``, the operator's pre-flight);
* ``podwarnings`` -- what the API server warns about in the pods kuberl renders; ``advisories``
  -- those and the capacity warnings, printed by ``kuberl validate`` and returned by the webhook;
  ``kvcache`` -- the fleet's KV cache against the batch; ``models`` -- a model's size and KV
  shape from its name or its local config.json;
* ``server_dry_run`` -- ``kuberl validate --server``: the API server's own dry run (the one
  module here that talks to a cluster, through the kubernetes client it imports when called).
"""
