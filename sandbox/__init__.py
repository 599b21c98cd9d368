"""The code environment of rStar2-Agent (paper section 3.1): run model-written Python safely.

- ``worker``: a warm fork-server per core; its zygotes (``zygote``) preload and freeze numpy,
  sympy, scipy and math-verify (full) or the standard library only (light; ``routing`` picks one
  per call); every call is one fork into a contained child (setsid, rlimits, seccomp, slot uid,
  slot cgroup from ``cgroups``, writes confined by ``landlock``), with a wall deadline, a disk
  quota and a sweep of whatever it left behind.
- ``server``: the service (``kuberl sandbox serve``): bounded queue, batching dispatch,
  exactly-once answers by idempotency key (``idempotency``), 429 backpressure, replacement of
  lost workers; ``app``: its HTTP/JSON routes (/v1/*, /metrics, /readyz) and ``serve``.
- ``client``: the async client with retries; ``local``: start the service as a subprocess.
- ``types``: the four outcomes of the paper plus memory-limit and truncation flags.

The rest, by role: a call's path through a worker is ``calls`` (fork ahead, hand over, watch,
answer) and ``child`` (the forked side, up to the result), the child's interpreter hooks are
``forkhooks``; what contains it is ``slot`` (a worker's cgroup, uid, scratch space, view and
filter together), ``fsview`` (the filesystem it sees), ``seccomp`` (its syscall filter),
``landlock``, ``cgroups`` and ``procs`` (finding and killing what it left running), with
``kfiles`` for the small /proc and cgroupfs files; around the service, ``auth`` (the pool's
bearer token) and ``progress`` (a log line per window).

Exactly-once is a property of one service process. Behind a SandboxPool's Kubernetes Service
each connection may reach another pod: a retry after a lost response can then run the call a
second time on another pod. The caller still gets exactly one answer per call; only the work
is duplicated (tool calls have no side effects outside their pod).
"""
