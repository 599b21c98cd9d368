"""``builtin:arith-bpe``: a byte-level BPE trained locally in seconds on the synthetic corpus.

Digits are pre-tokenized into groups of up to 2 (``\\d{1,2}``, all 110 such groups are single tokens) before BPE, so a number is a few
tokens that the model copies as units (with character-level digits a small model does not
learn to copy 5-6 digit results). Everything else goes through byte-level BPE without the
GPT-2 word regex, so the fixed tool-call boilerplate merges into a handful of tokens and
rollouts stay short. The template's SPECIAL_TOKENS are single special tokens.

The trained tokenizer is cached as ``tokenizer.json`` in the run folder (and stored with each
checkpoint), so a resumed run uses the identical vocabulary.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from kuberl.rollout.template import IM_END, SPECIAL_TOKENS

BUILTIN = "builtin:arith-bpe"


class BPETokenizer:
    """The rollout ``Tokenizer`` protocol (encode, decode, eos_id) over an HF tokenizer."""

    def __init__(self, hf: HFTokenizer):
        self.hf = hf
        eos = hf.token_to_id(IM_END)
        if eos is None:
            raise ValueError(f"tokenizer has no {IM_END!r} token")
        self.eos_id: int = eos
        self.vocab_size: int = hf.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=False)

    def to_str(self) -> str:
        return self.hf.to_str()

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.hf.save(str(path))

    @classmethod
    def from_str(cls, s: str) -> BPETokenizer:
        return cls(HFTokenizer.from_str(s))

    @classmethod
    def from_file(cls, path: str | Path) -> BPETokenizer:
        return cls(HFTokenizer.from_file(str(path)))


def train_bpe(corpus: list[str], vocab_size: int = 1024) -> BPETokenizer:
    """Train the digit-grouped byte-level BPE on ``corpus`` (deterministic for a given corpus)."""
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\d{1,2}"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator(corpus, trainer=trainer)
    return BPETokenizer(hf)


def load_tokenizer(
    source: str, cache_dir: str | Path, *, vocab_size: int = 1024, seed: int = 0
) -> BPETokenizer:
    """``builtin:arith-bpe`` (trained once, cached in ``cache_dir``) or a tokenizer.json path."""
    if source != BUILTIN:
        p = Path(source)
        if p.is_dir():
            p = p / "tokenizer.json"
        if not p.is_file():
            raise ValueError(f"tokenizer {source!r}: expected {BUILTIN} or a tokenizer.json file")
        return BPETokenizer.from_file(p)
    cached = Path(cache_dir) / "tokenizer.json"
    if cached.is_file():
        return BPETokenizer.from_file(cached)
    from kuberl.trainer.data import tokenizer_corpus

    tok = train_bpe(tokenizer_corpus(20000, seed), vocab_size)
    tok.save(cached)
    return tok
