"""Agentic rollouts (paper sections 2.1 and 3.2).

* :mod:`.template` - the rStar2 prompt template and the tool-call wire format.
* :mod:`.engine` - the Engine interface (GenerateRequest -> GenerateOutput, KV capacity, load).
* :mod:`.local_engine` - in-process continuous-batching engine for the builtin GPT.
* :mod:`.sglang_engine` - HTTP client for SGLang servers; :mod:`.vllm_engine` for vLLM servers;
  :mod:`.http_engine` what both share (retries, error bodies, health); :mod:`.discovery` finds
  them and :mod:`.fleet` keeps a run's engines in step with its RolloutFleet.
* :mod:`.vllm_server` - a local vLLM server: ``kuberl vllm install`` (from PyPI alone) and start/stop.
* :mod:`.scheduler` - KV-cache-aware assignment of rollouts to engines.
* :mod:`.loop` - the multi-turn tool-calling loop producing Trajectories (a ``BatchRequest`` in).
* :mod:`.worker` - the rollout worker: engines, scheduler and sandbox client, scoring rollouts
  into :mod:`.scored` ``Scored`` groups, counting tool calls (:mod:`.tool_stats`);
  :mod:`.client` - how the trainer reaches it (``RolloutClient``: in-process or a Ray actor,
  whose metrics :mod:`.mirror` copies into the driver's registry);
  :mod:`.orchestrator` - which batch generates when (asynchronous RL, ``asyncLevel``) and the
  order of weight push and release; :mod:`.engines` - the HTTP client for a server kind.

Nothing here imports :mod:`kuberl.trainer`: the trainer hands in batch requests, weights and
the callables the worker builds its policy, tokenizer and SFT traces with, and takes scored
groups back.

Submodules are imported explicitly (``from kuberl.rollout.loop import rollout_one``) so that
importing the template does not pull in torch or aiohttp.
"""
