"""The code environment of rStar2-Agent (paper section 3.1): run model-written Python safely.

Three rooms, and the types they share:

- ``service/``: the HTTP service (``kuberl sandbox serve``: queue, dispatch, idempotency, auth,
  metrics) and its client.
- ``process/``: the process tree: a warm fork-server per core, its zygotes, and each call's
  parent and forked child side; every call is one fork into a contained child with a wall
  deadline, a disk quota and a sweep of whatever it left behind.
- ``containment/``: what contains a call: the slot (uid, cgroup, scratch space), its view of
  the filesystem, Landlock, seccomp, cgroups, finding what it left running.
- ``types`` (the four outcomes of the paper plus memory-limit and truncation flags),
  ``config`` (``WorkerConfig``, which every room reads) and ``libc`` (the C library, loaded once).

Exactly-once is a property of one service process. Behind a SandboxPool's Kubernetes Service
each connection may reach another pod: a retry after a lost response can then run the call a
second time on another pod. The caller still gets exactly one answer per call; only the work
is duplicated (tool calls have no side effects outside their pod).
"""
