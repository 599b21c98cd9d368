"""An in-process inference engine with continuous batching over a KV cache.

It serves ``kuberl.trainer.model.GPT`` (or any module with the same forward contract:
``logits, present = model(input_ids, past=None, attention_mask=None)`` with left padding) and
is the embedded default of ``kuberl run`` and the engine of the tests.

Why continuous batching: an RL step issues hundreds of concurrent ``generate`` calls (every
rollout of a group, every turn). A tiny model on CPU is dominated by per-forward overhead, so
one batched decode step over all running sequences is the unit of work. Requests arriving while
a batch is running are prefilled together and merged into the running batch (left padding, one
shared KV cache); finished rows leave the batch at once, and leading all-padding columns are
trimmed so the cache never grows with the batch's history.

Log-probs: sampling uses ``softmax(logits / temperature)`` (with top-p filtering), but the
reported ``output_logprobs`` are ``log_softmax(logits)`` of the raw logits at the sampled token,
i.e. the log-probs of the policy itself (temperature 1.0), which is what the trainer recomputes.

Sampling is per request, not per batch: every request has a 64-bit key (from its
``GenerateRequest.seed``, else drawn from the engine's generator when it arrives) and its k-th
token is the inverse-CDF draw of the uniform SplitMix64(key, k). So which rows share a decode
step - which depends on arrival order, tool latency and admission - never changes what a
seeded request samples, while the step stays one batched tensor operation.
"""

from __future__ import annotations

import asyncio
import copy
import random
import threading
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from kuberl.rollout.engine import (
    GENERATED_TOKENS,
    Engine,
    EngineLoad,
    GenerateOutput,
    GenerateRequest,
    ScoreOutput,
    check_score_args,
    mix64,
)

KV = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class _Seq:
    req: GenerateRequest
    future: asyncio.Future
    limit: int  # max new tokens after clamping to the context length
    key: int  # sampling key: token k is drawn from the uniform seeded_uniform(key, k)
    out_ids: list[int] = field(default_factory=list)
    out_lps: list[float] = field(default_factory=list)
    out_versions: list[int | None] = field(default_factory=list)  # the weights that sampled each token
    finish: str | None = None
    reported: bool = False  # handed back to the caller; the row may still sit in the batch
    version: int | None = None  # the engine's weight version when the request was accepted

    @property
    def reserved(self) -> int:
        return len(self.req.input_ids) + self.limit

    @property
    def context(self) -> list[int]:
        """What a prefill reads: the prompt and every token sampled so far."""
        return self.req.input_ids + self.out_ids

    @property
    def used(self) -> int:
        return len(self.req.input_ids) + len(self.out_ids)


def seeded_uniform(key: int, k: int) -> float:
    """The k-th output of SplitMix64 started at ``key``: a uniform in [0, 1) with 53 bits."""
    return (mix64((key + k * 0x9E3779B97F4A7C15) & ((1 << 64) - 1)) >> 11) * 2.0**-53


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    generator: torch.Generator | None = None,
    uniforms: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; return (tokens [B], log_softmax(logits) at the tokens [B]).

    ``temperature`` and ``top_p`` are per-row [B] tensors; rows with temperature <= 0 are greedy.
    Nucleus filtering keeps the smallest prefix of the sorted distribution whose mass reaches
    ``top_p`` (the most likely token is always kept). Each sampled row takes the first token
    whose cumulative probability exceeds its uniform: ``uniforms`` [B] in [0, 1) when given
    (per-request draws), else fresh ones from ``generator``.
    """
    logits = logits.float()
    logprobs = torch.log_softmax(logits, dim=-1)
    greedy = temperature <= 0
    tokens = logits.argmax(dim=-1)
    if not bool(greedy.all()):
        idx = (~greedy).nonzero(as_tuple=True)[0]
        scaled = logits[idx] / temperature[idx, None]
        probs = torch.softmax(scaled, dim=-1)
        p = top_p[idx]
        if bool((p < 1.0).any()):
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            before = sorted_probs.cumsum(dim=-1) - sorted_probs
            sorted_probs = sorted_probs.masked_fill(before >= p[:, None], 0.0)
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        if uniforms is None:
            u = torch.rand(len(idx), generator=generator, dtype=torch.float64)
        else:
            u = uniforms.to(dtype=torch.float64, device="cpu")[idx.cpu()]
        cdf = probs.double().cumsum(dim=-1)
        x = u.to(cdf.device)[:, None] * cdf[:, -1:]  # < total mass, so a token with mass > 0 is hit
        picked = torch.searchsorted(cdf, x, right=True).squeeze(-1).clamp(max=probs.shape[-1] - 1)
        tokens = tokens.clone()
        tokens[idx] = picked
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


def _pad_left(past: KV, mask: torch.Tensor, width: int) -> tuple[KV, torch.Tensor]:
    """Left-pad a KV cache and its mask to ``width`` columns (zeros, mask 0)."""
    extra = width - mask.shape[1]
    if extra <= 0:
        return past, mask
    padded = []
    for k, v in past:
        z = k.new_zeros(k.shape[0], k.shape[1], extra, k.shape[3])
        padded.append((torch.cat([z, k], dim=2), torch.cat([z, v], dim=2)))
    return padded, torch.cat([mask.new_zeros(mask.shape[0], extra), mask], dim=1)


_HEADROOM = 32  # KV columns allocated ahead, so most decode steps write in place


def _with_headroom(k: torch.Tensor, v: torch.Tensor, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy a compact (K, V) into buffers with ``capacity`` columns (extra columns unused)."""
    B, H, T, D = k.shape
    kb, vb = k.new_empty(B, H, capacity, D), v.new_empty(B, H, capacity, D)
    kb[:, :, :T], vb[:, :, :T] = k, v
    return kb, vb


def _gpt_decode_step(model: nn.Module, tokens: torch.Tensor, past: KV, used: int, mask: torch.Tensor):
    """One decode step of ``kuberl.trainer.model.GPT`` writing K/V into preallocated buffers.

    The model's own forward concatenates the whole cache on every step (most of a decode
    step's time at batch 256); this computes the same thing with in-place writes. Only used
    after :func:`_fast_decode_ok` has checked it against the model's forward.
    """
    B = tokens.shape[0]
    positions = (mask.sum(dim=1) - 1).clamp(min=0)  # as GPT.forward: cumsum(mask) - 1
    x = model.wte(tokens[:, None]) + model.wpe(positions[:, None])
    attn_mask = mask.bool()[:, None, None, :]
    C = x.shape[-1]
    for block, (kb, vb) in zip(model.blocks, past, strict=True):
        attn = block.attn
        H = attn.n_head
        q, k, v = attn.qkv(block.ln1(x)).split(C, dim=2)
        q = q.view(B, 1, H, C // H).transpose(1, 2)
        kb[:, :, used] = k.view(B, H, C // H)
        vb[:, :, used] = v.view(B, H, C // H)
        y = F.scaled_dot_product_attention(q, kb[:, :, : used + 1], vb[:, :, : used + 1], attn_mask=attn_mask)
        x = x + attn.proj(y.transpose(1, 2).reshape(B, 1, C))
        x = x + block.mlp(block.ln2(x))
    return model.lm_head(model.ln_f(x))[:, -1]


@torch.inference_mode()
def _fast_decode_ok(model: nn.Module) -> bool:
    """True when ``model`` is GPT-shaped and the fast decode step reproduces its forward."""
    try:
        vocab = model.wte.num_embeddings
        ids = torch.randint(0, vocab, (2, 6), generator=torch.Generator().manual_seed(0))
        ids = ids.to(model.wte.weight.device)
        mask = torch.ones_like(ids)
        mask[1, :2] = 0  # a left-padded row
        ref = model(ids, attention_mask=mask)[0][:, -1]
        _, past = model(ids[:, :-1], attention_mask=mask[:, :-1])
        bufs = [_with_headroom(k, v, 8) for k, v in past]
        got = _gpt_decode_step(model, ids[:, -1], bufs, 5, mask)
        return bool(torch.allclose(got, ref, atol=1e-4, rtol=1e-4))
    except (AttributeError, TypeError, ValueError, RuntimeError, IndexError):
        return False


class LocalEngine(Engine):
    """Continuous-batching engine over an in-process causal LM (see module docstring).

    The engine serves a private copy of ``model`` (in eval mode), so the trainer's module is
    never put into eval mode or read mid-step; ``set_weights`` copies new weights in between
    decode steps. ``max_total_tokens`` is the KV budget reported to the scheduler and also the
    admission limit: a request is admitted when its prompt + clamped max_new_tokens fit next to
    the running requests' reservations (or when nothing is running). ``context_length`` defaults
    to ``model.config.block_size``; a request stops with finish_reason "length" when prompt +
    output reaches it.

    ``partial_rollouts``: a weight copy makes every running request stop at a token boundary
    and go on under the new weights from its tokens so far; its KV cache (computed by the old
    weights) is dropped and the next step prefills prompt + tokens so far again, so every token
    is sampled by one version's clean forward, and each token reports that version
    (``GenerateOutput.token_versions``). Off: the copy lands between decode steps, the rows keep
    their cache, and a request reports the version it started with.
    """

    pads_rows = True  # one left-padded KV cache: a step attends over the longest row's columns

    def __init__(
        self,
        model: nn.Module,
        *,
        max_total_tokens: int = 65536,
        max_batch: int = 64,
        device: str = "cpu",
        name: str = "local-0",
        context_length: int | None = None,
        seed: int | None = None,
        partial_rollouts: bool = False,
    ):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if max_total_tokens < 1:
            raise ValueError(f"max_total_tokens must be >= 1, got {max_total_tokens}")
        self.name = name
        self.device = torch.device(device)
        self.model = copy.deepcopy(model).to(self.device).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        cfg = getattr(self.model, "config", None)
        self.context_length = int(context_length or getattr(cfg, "block_size", 0) or 1 << 30)
        self.max_batch = max_batch
        self._max_total_tokens = max_total_tokens
        self._rng = random.Random(seed)  # keys of requests that come without a seed
        self._lock = threading.Lock()  # serializes forward passes and weight updates
        self._pending: deque[_Seq] = deque()
        self._running: list[_Seq] = []
        self._past: KV | None = None  # per layer (K, V) [B, H, capacity, D]; columns < _used are live
        self._used = 0
        self._mask: torch.Tensor | None = None
        self._next: torch.Tensor | None = None  # last sampled token per row, not yet in the cache
        self._driver: asyncio.Task | None = None
        self.steps = 0  # decode steps run (batched forwards), for tests and benchmarks
        self.prefills = 0
        self.generated_tokens = 0  # also kuberl_rollout_generated_tokens_total{engine=name}
        self._tokens_metric = GENERATED_TOKENS.labels(engine=name)
        self.fast_decode = _fast_decode_ok(self.model)
        self.last_error: BaseException | None = None
        self.weight_version: int | None = None
        self.partial_rollouts = partial_rollouts
        self._reprefill = False  # new weights since the batch's cache was computed (partial rollouts)
        self.reprefills = 0  # rows prefilled again under new weights, for tests and benchmarks

    # -- Engine interface ---------------------------------------------------------------------

    async def generate(self, req: GenerateRequest) -> GenerateOutput:
        req.validate()
        limit = min(req.max_new_tokens, self.context_length - len(req.input_ids))
        if limit <= 0:
            return GenerateOutput([], [], "length")
        loop = asyncio.get_running_loop()
        key = mix64(req.seed) if req.seed is not None else self._rng.getrandbits(64)
        seq = _Seq(req=req, future=loop.create_future(), limit=limit, key=key, version=self.weight_version)
        self._pending.append(seq)
        if self._driver is None or self._driver.done():
            self._driver = loop.create_task(self._drive(), name=f"{self.name}-driver")
        return await seq.future

    async def max_total_tokens(self) -> int:
        return self._max_total_tokens

    async def score(self, input_ids: list[int], start: int) -> ScoreOutput:
        check_score_args(input_ids, start)
        if len(input_ids) > self.context_length:
            raise ValueError(f"score: {len(input_ids)} tokens exceed the context length {self.context_length}")
        return await asyncio.to_thread(self._score, list(input_ids), start)

    @torch.inference_mode()
    def _score(self, input_ids: list[int], start: int) -> ScoreOutput:
        ids = torch.tensor([input_ids], dtype=torch.long, device=self.device)
        with self._lock:  # between decode steps, with the weights (and version) of this moment
            logits, _ = self.model(ids)
            version = self.weight_version
        lps = torch.log_softmax(logits[0, start - 1 : -1].float(), dim=-1)
        picked = lps.gather(1, ids[0, start:, None])[:, 0]
        return ScoreOutput(picked.tolist(), version)

    async def health(self) -> bool:
        """False after a batch step failed (the error went to every request in it) until the
        next step succeeds."""
        return self.last_error is None

    async def load_metrics(self) -> EngineLoad:
        live = [s for s in self._running if s.finish is None]
        used = sum(s.used for s in live)
        return EngineLoad(used / self._max_total_tokens, len(live), len(self._pending))

    async def close(self) -> None:
        """Stop; the requests in the engine now come back as "abort" with their tokens so far
        (with partial rollouts the loop goes on from them: requests made after this call, while
        it waits for the driver, are a restarted engine's and run)."""
        seqs = [*self._running, *self._pending]
        if self._driver is not None and not self._driver.done():
            self._driver.cancel()
            try:
                await self._driver
            except asyncio.CancelledError:
                pass
        else:
            self._running, self._pending = [], deque()
            self._past = self._mask = self._next = None
        for seq in seqs:
            if not seq.future.done():
                seq.future.set_result(self._output(seq, "abort"))

    # -- weights ------------------------------------------------------------------------------

    def set_weights(self, state_dict: dict[str, torch.Tensor], version: int | None = None) -> None:
        """Copy new policy weights in (between decode steps); running requests continue with them.

        ``version`` (the trainer's step) is what later requests report; a request that was
        running during the copy reports the version it started with (its oldest tokens'). With
        ``partial_rollouts`` the running rows are prefilled again under the new weights at the
        next step (see the class docstring).
        """
        with self._lock, torch.no_grad():
            self.model.load_state_dict(state_dict)
            self.weight_version = version
            if self.partial_rollouts and self._running:
                self._reprefill = True

    load_state_dict = set_weights

    def reseed(self, seed: int) -> None:
        """Restart the generator that keys requests without a seed (in arrival order)."""
        self._rng.seed(seed)

    # -- batching -----------------------------------------------------------------------------

    async def _drive(self) -> None:
        await asyncio.sleep(0)  # let the other generate() calls of this tick enqueue first
        admit: list[_Seq] = []
        try:
            while self._pending or self._running:
                for seq in self._running:
                    if seq.future.done():  # the caller went away (cancelled): drop the row
                        seq.finish = "abort"
                admit = self._admit()
                finished = await asyncio.to_thread(self._step, admit)
                admit = []
                self.last_error = None
                for seq in finished:
                    if not seq.future.done():
                        seq.future.set_result(self._output(seq, seq.finish))
        except BaseException as err:
            if isinstance(err, asyncio.CancelledError) and self.partial_rollouts:
                self._hand_back(admit)
                raise
            # A failed step poisons the shared batch: fail every request in it and start clean.
            for seq in [*admit, *self._running, *self._pending]:
                if not seq.future.done():
                    if isinstance(err, asyncio.CancelledError):
                        seq.future.cancel()
                    else:
                        seq.future.set_exception(err)
            self._running, self._pending = [], deque()
            self._past = self._mask = self._next = None
            self._used = 0
            if isinstance(err, asyncio.CancelledError):
                raise
            self.last_error = err

    def _hand_back(self, admit: list[_Seq]) -> None:
        """The engine stops (``close``, a restart): with partial rollouts every request comes back
        with its tokens so far ("abort" unless it had finished), for the loop to go on from."""
        with self._lock:  # a step the cancel left running on its thread ends first
            seqs = [*admit, *self._running, *self._pending]
            self._running, self._pending = [], deque()
            self._past = self._mask = self._next = None
            self._used = 0
            self._reprefill = False
        for seq in seqs:
            if not seq.future.done():
                seq.future.set_result(self._output(seq, seq.finish or "abort"))

    def _admit(self) -> list[_Seq]:
        live = [s for s in self._running if s.finish is None]
        reserved = sum(s.reserved for s in live)
        admit: list[_Seq] = []
        while self._pending and len(live) + len(admit) < self.max_batch:
            seq = self._pending[0]
            if seq.future.done():
                self._pending.popleft()
                continue
            if (live or admit) and reserved + seq.reserved > self._max_total_tokens:
                break
            reserved += seq.reserved
            admit.append(self._pending.popleft())
        return admit

    def _output(self, seq: _Seq, finish: str) -> GenerateOutput:
        if not self.partial_rollouts:
            return GenerateOutput(seq.out_ids, seq.out_lps, finish, seq.version)  # type: ignore[arg-type]
        known = [v for v in seq.out_versions if v is not None]
        oldest = min(known) if known and len(known) == len(seq.out_versions) else seq.version
        return GenerateOutput(
            seq.out_ids, seq.out_lps, finish, oldest, list(seq.out_versions)  # type: ignore[arg-type]
        )

    @torch.inference_mode()
    def _step(self, admit: list[_Seq]) -> list[_Seq]:
        """Prefill ``admit`` into the batch, then run one decode step; return finished rows."""
        with self._lock:
            finished = self._evict()
            if self._reprefill:
                # new weights: the cache is the old weights'; every running row starts over from
                # its prompt and tokens so far, prefilled with the new ones beside the admitted
                self._reprefill = False
                live = [s for s in self._running if s.finish is None]
                self._running, self._past, self._mask, self._next = [], None, None, None
                self._used = 0
                self.reprefills += len(live)
                admit = live + admit
            if admit:
                finished += self._prefill(admit)
            if self._running:
                self._decode()
                finished += self._evict()
            return finished

    def _prefill(self, admit: list[_Seq]) -> list[_Seq]:
        width = max(len(s.context) for s in admit)
        ids = torch.zeros(len(admit), width, dtype=torch.long)
        mask = torch.zeros(len(admit), width, dtype=torch.long)
        for i, s in enumerate(admit):
            n = len(s.context)
            ids[i, width - n :] = torch.tensor(s.context, dtype=torch.long)
            mask[i, width - n :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        logits, past = self.model(ids, attention_mask=mask)
        self.prefills += 1
        tokens = self._sample(admit, logits[:, -1])
        self._merge(admit, past, mask, tokens)
        return self._evict()

    def _live(self) -> KV:
        assert self._past is not None
        return [(k[:, :, : self._used], v[:, :, : self._used]) for k, v in self._past]

    def _set_past(self, past: KV) -> None:
        """Store a compact cache; the fast decoder gets headroom to write new columns in place."""
        self._used = past[0][0].shape[2]
        if self.fast_decode:
            past = [_with_headroom(k, v, self._used + _HEADROOM) for k, v in past]
        self._past = past

    def _merge(self, seqs: list[_Seq], past: KV, mask: torch.Tensor, tokens: torch.Tensor) -> None:
        if not self._running:
            self._running, self._mask, self._next = list(seqs), mask, tokens
            self._set_past(past)
            return
        assert self._past is not None and self._mask is not None and self._next is not None
        width = max(mask.shape[1], self._mask.shape[1])
        old_past, old_mask = _pad_left(self._live(), self._mask, width)
        new_past, new_mask = _pad_left(past, mask, width)
        self._set_past(
            [
                (torch.cat([k0, k1], dim=0), torch.cat([v0, v1], dim=0))
                for (k0, v0), (k1, v1) in zip(old_past, new_past, strict=True)
            ]
        )
        self._mask = torch.cat([old_mask, new_mask], dim=0)
        self._next = torch.cat([self._next, tokens], dim=0)
        self._running.extend(seqs)

    def _decode(self) -> None:
        assert self._past is not None and self._mask is not None and self._next is not None
        # Finished rows still in the batch get a masked-out column: they stop advancing.
        live = torch.tensor([s.finish is None for s in self._running], dtype=self._mask.dtype)
        mask = torch.cat([self._mask, live.to(self._mask.device)[:, None]], dim=1)
        if self.fast_decode:
            if self._used == self._past[0][0].shape[2]:
                self._past = [_with_headroom(k, v, self._used + _HEADROOM) for k, v in self._past]
            last = _gpt_decode_step(self.model, self._next, self._past, self._used, mask)
            self._used += 1
        else:
            logits, past = self.model(self._next[:, None], past=self._past, attention_mask=mask)
            self._past, self._used = past, past[0][0].shape[2]
            last = logits[:, -1]
        self._mask = mask
        self.steps += 1
        self._next = self._sample(self._running, last)

    def _sample(self, seqs: list[_Seq], logits: torch.Tensor) -> torch.Tensor:
        temps = torch.tensor([s.req.temperature for s in seqs], dtype=torch.float32, device=logits.device)
        top_p = torch.tensor([s.req.top_p for s in seqs], dtype=torch.float32, device=logits.device)
        u = torch.tensor(
            [seeded_uniform(s.key, s.req.first_draw + len(s.out_ids)) for s in seqs], dtype=torch.float64
        )
        tokens, lps = sample_tokens(logits, temps, top_p, uniforms=u)
        produced = 0
        for s, tok, lp in zip(seqs, tokens.tolist(), lps.tolist(), strict=True):
            if s.finish is not None:
                continue
            produced += 1
            s.out_ids.append(tok)
            s.out_lps.append(lp)
            s.out_versions.append(self.weight_version)
            if tok in s.req.stop_token_ids:
                s.finish = "stop"
            elif len(s.out_ids) >= s.limit:
                s.finish = "length"
        self.generated_tokens += produced
        self._tokens_metric.inc(produced)
        return tokens

    def _evict(self) -> list[_Seq]:
        """Return newly finished rows; compact the batch once a quarter of its rows are finished.

        Compaction (dropping rows, trimming all-padding columns) copies the whole cache, so it
        is batched: finished rows ride along masked out until enough of them accumulate.
        """
        done = [s for s in self._running if s.finish is not None and not s.reported]
        for s in done:
            s.reported = True
        dead = sum(s.finish is not None for s in self._running)
        if not dead or dead * 4 < len(self._running):
            return done
        keep = [i for i, s in enumerate(self._running) if s.finish is None]
        if not keep:
            self._running, self._past, self._mask, self._next = [], None, None, None
            self._used = 0
            return done
        assert self._past is not None and self._mask is not None and self._next is not None
        index = torch.tensor(keep, dtype=torch.long, device=self._mask.device)
        mask = self._mask.index_select(0, index)
        first = int(mask.any(dim=0).long().argmax())  # first column holding a real token
        self._mask = mask[:, first:]
        self._set_past(
            [
                (k.index_select(0, index)[:, :, first:], v.index_select(0, index)[:, :, first:])
                for k, v in self._live()
            ]
        )
        self._next = self._next.index_select(0, index)
        self._running = [self._running[i] for i in keep]
        return done
