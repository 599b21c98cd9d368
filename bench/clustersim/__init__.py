"""Discrete-event simulation of whole RL steps at the paper's scale (bench/cluster_sim.py).

The simulation runs kuberl's own decision code on a virtual-time asyncio loop
(``rollout_sim.VirtualTimeLoop``): the KV-aware ``Scheduler``, the ``SandboxClient``'s
retries, the ``SandboxService``'s queue, batching and backpressure (through its real HTTP
handlers, without sockets), and the operator's autoscaling decisions
(``kuberl.operator.decide.autoscale``). Only the things that cost GPU or CPU time are models:
engines (``rollout_sim.SimEngine``), the execution of a tool call (a sleep of its
modelled duration), pod start-up, the update and the weight sync.

Modules: ``workload`` (seeded rollout plans), ``pods`` (sandbox pods and the Service that
routes to them), ``control`` (the autoscaler loop and pod/engine life cycle), ``step``
(one run of several RL steps and what it records; or, with ``ahead``, the fleet side of
asynchronous RL), ``asyncmodel`` (pure arithmetic of synchronous vs asynchronous steps,
bench/async_sim.py).
"""
