"""Agentic rollouts (paper sections 2.1 and 3.2).

* :mod:`.template` - the rStar2 prompt template and the tool-call wire format.
* :mod:`.engine` - the Engine interface (GenerateRequest -> GenerateOutput, KV capacity, load).
* :mod:`.local_engine` - in-process continuous-batching engine for the builtin GPT.
* :mod:`.sglang_engine` - HTTP client for SGLang servers; :mod:`.discovery` finds them.
* :mod:`.scheduler` - KV-cache-aware assignment of rollouts to engines.
* :mod:`.loop` - the multi-turn tool-calling loop producing Trajectories.

Submodules are imported explicitly (``from kuberl.rollout.loop import rollout_one``) so that
importing the template does not pull in torch or aiohttp.
"""
