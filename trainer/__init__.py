"""kuberl.trainer: GRPO-RoC (rStar2-Agent sections 2.2 and 4) and the local runner.

Pure parts: ``roc`` (Resample-on-Correct, eqs. 4-5), ``advantage`` (eq. 7 and the online
zero-advantage filter), ``loss`` (clip-higher PPO loss, INTELLECT-2 cap, token-mean).
Data and model side: ``tokenizer`` (builtin:arith-bpe), ``data`` (builtin:arith, jsonl, SFT
traces in rollout layout), ``model`` (tiny GPT), ``sft``, ``checkpoint`` (local/s3).
Policy side: ``policy`` (the builtin GPT or an HF causal LM, and its tokenizer), ``hf`` (HF
models), ``pretrained`` (``kuberl models prepare``), ``distributed`` (torchrun ranks, FSDP2).
Driver: ``stages`` (the ``Pipeline``: SFT -> RL stages, optimizer resets), its parts
``sft_stage``, ``rl_stage``, ``evaluation``, ``filtering`` (the difficulty filter),
``checkpointing`` and ``problems`` (pools, rollout requests), sharing ``stage_host``, and
``rl_step`` (one GRPO-RoC step, top to bottom); ``grpo`` (batch preparation and the
update), ``weight_sync`` (new weights into the engines), ``spot_check`` and ``mismatch`` (the
engines' log-probs against the trainer's), ``step_record`` (the typed record of a step, one
line of metrics.jsonl), ``metrics`` (prometheus + jsonl), ``local``
(``kuberl run``, Ray). The rollout side (worker, client, orchestrator) is ``kuberl.rollout``.
Watching a run: ``progress`` (log lines), ``tracking`` (W&B, MLflow, TensorBoard), ``report``
and ``svg`` (``kuberl report``).
"""
