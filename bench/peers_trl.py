"""TRL's side of ``bench/peers.py``: GRPOTrainer on the same model, prompts, tool, reward and settings.

Run by peers.py in its own subprocess (so that its peak RSS is its own), with the settings
peers.py derived from the kuberl manifest (``peers.trl_settings``) in a JSON file:

    python bench/peers_trl.py SETTINGS.json OUT_DIR

The tool is kuberl's sandbox, reached through TRL's own tool-calling path (``tools=``: TRL
parses ``<tool_call>`` JSON with its Qwen response template, calls the function, appends the
result rendered by the chat template and generates again). The chat template given to the
tokenizer renders exactly kuberl's ``compact`` prompt format, so the SFT'd model sees the same
text on both sides. The reward is the sandbox's math-verify on the final ``<answer>``, as in
kuberl. Writes ``steps.jsonl`` (one record per RL step: seconds split into generation, tool
calls, reward and update; rollouts, trained tokens, reward mean) and ``summary.json`` (peak
RSS, the final model's folder). With ``save_policies`` the policy after every step is saved to
``policies/step-NNNN`` (the save's seconds are kept off the step's clock); with
``stop_after`` the run stops after that many steps of its ``max_steps`` schedule; without
``kuberl_optimizer`` TRL keeps its own optimizer and schedule.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import sys
import time
from pathlib import Path

# The same chat layout as kuberl.rollout.template (compact): no system prompt, tool results as a
# user turn of <tool_response> blocks, tool calls as <tool_call>{json}</tool_call>. Messages are
# joined by "\n", so the rendered prefix of an assistant turn ends at its <|im_end|> (the EOS),
# which is what TRL's _get_tool_suffix_ids slices at.
COMPACT_CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'tool' -%}"
    "{%- if loop.first or loop.previtem.role != 'tool' -%}{{ '\\n<|im_start|>user\\n' }}{%- endif -%}"
    "{{ '<tool_response>' + m.content + '</tool_response>' }}"
    "{%- if loop.last or loop.nextitem.role != 'tool' -%}{{ '<|im_end|>' }}{%- endif -%}"
    "{%- else -%}"
    "{%- if not loop.first -%}{{ '\\n' }}{%- endif -%}"
    "{{ '<|im_start|>' + m.role + '\\n' }}{{ m.content or '' }}"
    "{%- if m.tool_calls -%}{%- for tc in m.tool_calls -%}"
    "{{ '<tool_call>' + ({'name': tc.function.name, 'arguments': tc.function.arguments} | tojson) + '</tool_call>' }}"
    "{%- endfor -%}{%- endif -%}"
    "{{ '<|im_end|>' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '\\n<|im_start|>assistant\\n' }}{%- endif -%}"
)


class Clock:
    """Seconds spent in tool calls and reward calls (TRL runs both inline in the step)."""

    def __init__(self) -> None:
        self.tool_s = 0.0
        self.tool_calls = 0
        self.reward_s = 0.0


def make_tool(sandbox_url: str, clock: Clock):
    from kuberl.sandbox.service.client import SandboxClient

    clients: dict[int, SandboxClient] = {}  # one per event loop (TRL's daemon loop)

    async def execute_python_code_with_standard_io(code: str, input: str = "") -> str:
        """Execute Python code with standard input and capture standard output.

        Args:
            code: A string containing Python code to be executed; it can read standard input with input().
            input: A string that will be provided as standard input to the code when it calls input().

        Returns:
            The output produced by the code through standard output, or the error message if it failed.
        """
        t = time.perf_counter()
        loop = id(asyncio.get_running_loop())
        if loop not in clients:
            clients[loop] = SandboxClient(sandbox_url)
        result = await clients[loop].execute(code, input)
        clock.tool_s += time.perf_counter() - t
        clock.tool_calls += 1
        return result.to_tool_response()

    return execute_python_code_with_standard_io


def completion_answer(completion) -> str | None:
    """The final <answer> of one completion as kuberl extracts it: from the model's own turns only."""
    from kuberl.rollout import template

    if isinstance(completion, str):
        turns = [completion]
    else:
        turns = [m.get("content") or "" for m in completion if m.get("role") == "assistant"]
    answer = None
    for text in turns:
        if "<answer>" in text:
            answer = template.extract_answer(text)
    return answer


def make_reward(sandbox_url: str, clock: Clock, eos_id: int):
    from kuberl.sandbox.service.client import SandboxClient

    clients: dict[int, SandboxClient] = {}

    async def arith_correct(prompts, completions, answer, completion_ids=None, **_) -> list[float]:
        """1 when math-verify (the sandbox's /v1/verify_batch) accepts the final answer, as kuberl."""
        t = time.perf_counter()
        loop = id(asyncio.get_running_loop())
        if loop not in clients:
            clients[loop] = SandboxClient(sandbox_url)
        pairs, where = [], []
        for i, c in enumerate(completions):
            pred = completion_answer(c)
            truncated = completion_ids is not None and (
                not completion_ids[i] or completion_ids[i][-1] != eos_id
            )
            if pred is not None and not truncated:
                pairs.append((pred, answer[i]))
                where.append(i)
        ok = await clients[loop].verify_batch(pairs) if pairs else []
        out = [0.0] * len(completions)
        for i, good in zip(where, ok, strict=True):
            out[i] = 1.0 if good else 0.0
        clock.reward_s += time.perf_counter() - t
        return out

    return arith_correct


def main(argv: list[str]) -> int:
    settings = json.loads(Path(argv[0]).read_text())
    out = Path(argv[1])
    out.mkdir(parents=True, exist_ok=True)
    import torch

    torch.set_num_threads(settings["threads"])
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen3_template

    from kuberl.trainer import data as data_mod

    tok = AutoTokenizer.from_pretrained(settings["model"])
    tok.chat_template = COMPACT_CHAT_TEMPLATE
    tok.response_template = qwen3_template  # parses <tool_call>{json}</tool_call> as kuberl's template does
    model = AutoModelForCausalLM.from_pretrained(settings["model"], dtype=torch.float32)
    probs = data_mod.load_problems(settings["data"], settings["pool_size"], settings["pool_seed"])
    ds = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": p.question}], "answer": p.answer} for p in probs]
    )
    clock = Clock()
    tool = make_tool(settings["sandbox_url"], clock)
    reward = make_reward(settings["sandbox_url"], clock, tok.eos_token_id)
    optimizers = (None, None)  # TRL's own: AdamW (0.9, 0.999) and a linear decay over max_steps
    if settings.get("kuberl_optimizer", True):
        warm = settings["warmup_steps"]
        opt = torch.optim.AdamW(
            model.parameters(), lr=settings["learning_rate"], betas=(0.9, 0.99), weight_decay=0.0
        )
        # kuberl's schedule: step s runs at lr * min(1, (s + 1) / warmup) (HF's warmup starts at 0)
        optimizers = (opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm) if warm > 0 else 1.0))
    stop_after = settings.get("stop_after")  # steps to run of a max_steps schedule (None: all)
    policies = out / "policies" if settings.get("save_policies") else None
    cfg = GRPOConfig(output_dir=str(out / "trl"), **settings["grpo_config"])
    steps: list[dict] = []

    class Timed(GRPOTrainer):
        """Splits each step's wall time: generation (incl. tools and reward; the first micro-batch's
        training_step generates the whole step's batch) vs the update."""

        def _generate_and_score_completions(self, inputs):
            t = time.perf_counter()
            tool0, calls0, rew0 = clock.tool_s, clock.tool_calls, clock.reward_s
            res = super()._generate_and_score_completions(inputs)
            gen = time.perf_counter() - t
            mask = res["completion_mask"]
            if "tool_mask" in res:
                mask = mask * res["tool_mask"]
            self._pending = {
                "generate_and_score_seconds": gen,
                "tool_seconds": clock.tool_s - tool0,
                "tool_calls": clock.tool_calls - calls0,
                "reward_seconds": clock.reward_s - rew0,
                "rollouts": int(mask.shape[0]),
                "rows": int(mask.shape[0]),  # every row is in TRL's loss, tied groups' too
                "tokens": float(mask.sum()),
                "response_length": float(res["completion_mask"].sum()) / max(1, mask.shape[0]),
            }
            return res

        _train_s = 0.0  # this optimizer step's training_step seconds (every accumulated micro-batch)

        def training_step(self, model, inputs, num_items_in_batch):
            t = time.perf_counter()
            loss = super().training_step(model, inputs, num_items_in_batch)
            self._step_end = time.perf_counter()
            self._train_s += self._step_end - t
            return loss

    trainer = Timed(
        model=model,
        reward_funcs=[reward],
        args=cfg,
        train_dataset=ds,
        processing_class=tok,
        tools=[tool],
        optimizers=optimizers,
    )

    class Record:
        last = time.perf_counter()

    from transformers import TrainerCallback

    class StepLog(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            now = time.perf_counter()
            p = dict(trainer._pending)
            train_s, t1 = trainer._train_s, trainer._step_end
            trainer._train_s = 0.0
            step_s = now - Record.last
            Record.last = now
            gen = p.pop("generate_and_score_seconds")
            # optimizer step and zero_grad happen after training_step returns: part of the update
            rec = {
                "step": state.global_step,
                "step_seconds": step_s,
                "generation_seconds": gen - p["tool_seconds"] - p["reward_seconds"],
                "update_seconds": (train_s - gen) + (now - t1),
                **p,
            }
            steps.append(rec)
            if policies is not None:
                # the policy after this step, for the evaluator; the save is kept off the clock
                trainer.model.save_pretrained(str(policies / f"step-{state.global_step:04d}"))
                rec["save_seconds"] = time.perf_counter() - now
                Record.last = time.perf_counter()
            if stop_after is not None and state.global_step >= stop_after:
                control.should_training_stop = True

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and steps and "reward" in logs:
                steps[-1]["reward_mean"] = logs["reward"]
                with (out / "steps.jsonl").open("a") as f:
                    f.write(json.dumps(steps[-1]) + "\n")

    trainer.add_callback(StepLog())
    (out / "steps.jsonl").write_text("")
    t0 = time.perf_counter()
    Record.last = t0
    trainer.train()
    wall = time.perf_counter() - t0
    final = out / "final-model"
    trainer.save_model(str(final))
    tok.save_pretrained(str(final))
    summary = {
        "train_seconds": wall,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "final_model": str(final),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    raise SystemExit(main(sys.argv[1:]))
