"""The sandbox's HTTP service (``kuberl sandbox serve``) and its callers.

- ``server``: the service core: a bounded queue, batching dispatch to the workers, 429
  backpressure, replacement of lost workers.
- ``app``: its HTTP/JSON routes (/v1/*, /metrics, /readyz) and ``serve``.
- ``idempotency``: exactly-once answers by idempotency key.
- ``auth``: the pool's bearer token; ``progress``: a log line per window.
- ``client``: the async client with retries; ``local``: the service as a subprocess.
"""
