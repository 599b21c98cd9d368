"""The code environment of rStar2-Agent (paper section 3.1): run model-written Python safely.

- ``worker``: a warm fork-server per core (numpy, sympy, scipy, math-verify preloaded and
  frozen); every call is one fork into a contained child (setsid, rlimits, seccomp, slot uid,
  slot cgroup from ``cgroups``), with a wall deadline and a sweep of whatever it left behind.
- ``server``: the HTTP/JSON service (``kuberl sandbox serve``): bounded queue, batching
  dispatch, exactly-once answers by idempotency id, 429 backpressure, /metrics, /readyz.
- ``client``: the async client with retries; ``local``: start the service as a subprocess.
- ``types``: the four outcomes of the paper plus memory-limit and truncation flags.
"""
