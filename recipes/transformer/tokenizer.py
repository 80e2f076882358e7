"""Subword tokenizers with fairseq's special-token ids (bos 0, pad 1, eos 2, unk 3).

Two kinds, one interface (``encode(line) -> list[int]``, ``decode(ids) -> str``,
``vocab_size``, ``state()`` to rebuild it from a checkpoint):

* :class:`SentencePieceTokenizer`: a joint sentencepiece model trained by the recipe on
  the training text of both languages (or one given with ``--spm-model``);
* :class:`PretokenizedTokenizer`: text already split into subwords (for example the
  ``@@ ``-marked BPE files of the WMT'16 En-De distribution) and its vocabulary file.

    >>> tok = PretokenizedTokenizer(["hel@@", "lo", "world"])
    >>> ids = tok.encode("hel@@ lo world")
    >>> tok.decode(ids)
    'hello world'
"""

from __future__ import annotations

import os
import tempfile

BOS, PAD, EOS, UNK = 0, 1, 2, 3
SPECIALS = ["<s>", "<pad>", "</s>", "<unk>"]


def _sentencepiece():
    try:
        import sentencepiece
    except ImportError as exc:  # optional dependency of the recipes
        raise ImportError(
            "the Transformer recipe needs sentencepiece: pip install sentencepiece "
            "(or pip install 'commopt[recipes]')"
        ) from exc
    return sentencepiece


class SentencePieceTokenizer:
    """A sentencepiece model held as its serialized bytes (so it travels in checkpoints)."""

    kind = "sentencepiece"

    def __init__(self, model_proto: bytes):
        spm = _sentencepiece()
        self.model_proto = bytes(model_proto)
        self.sp = spm.SentencePieceProcessor(model_proto=self.model_proto)
        if (self.sp.pad_id(), self.sp.eos_id(), self.sp.unk_id()) != (PAD, EOS, UNK):
            raise ValueError(
                "the sentencepiece model must use pad=1, eos=2, unk=3 (fairseq's ids); "
                "train it with --pad_id=1 --eos_id=2 --unk_id=3 --bos_id=0, or let the recipe train one"
            )

    @classmethod
    def load(cls, path: str) -> SentencePieceTokenizer:
        with open(path, "rb") as f:
            return cls(f.read())

    @classmethod
    def train(
        cls,
        text_files: list[str],
        vocab_size: int,
        *,
        model_type: str = "unigram",
        max_sentences: int = 2_000_000,
        character_coverage: float = 1.0,
        threads: int = 1,
    ) -> SentencePieceTokenizer:
        """Train a joint model on ``text_files`` (one sentence per line)."""
        spm = _sentencepiece()
        spm.set_random_generator_seed(1)  # the sentence sampling must not differ between runs
        with tempfile.TemporaryDirectory() as tmp:
            prefix = os.path.join(tmp, "spm")
            spm.SentencePieceTrainer.train(
                input=",".join(text_files),
                model_prefix=prefix,
                vocab_size=vocab_size,
                model_type=model_type,
                character_coverage=character_coverage,
                bos_id=BOS,
                pad_id=PAD,
                eos_id=EOS,
                unk_id=UNK,
                # sampling keeps WMT-sized corpora tractable
                input_sentence_size=max_sentences,
                shuffle_input_sentence=True,
                num_threads=threads,
                minloglevel=2,
                hard_vocab_limit=False,
            )
            with open(prefix + ".model", "rb") as f:
                return cls(f.read())

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    def encode(self, line: str) -> list[int]:
        return self.sp.encode(line.strip(), out_type=int)

    def encode_many(self, lines: list[str]) -> list[list[int]]:
        return self.sp.encode([line.strip() for line in lines], out_type=int)

    def decode(self, ids) -> str:
        return self.sp.decode([int(i) for i in ids if int(i) not in (BOS, PAD, EOS)])

    def state(self) -> dict:
        return {"kind": self.kind, "model_proto": self.model_proto}


class PretokenizedTokenizer:
    """Text already split into subwords; ``bpe_marker`` is removed when decoding."""

    kind = "pretokenized"

    def __init__(self, pieces: list[str], bpe_marker: str = "@@ "):
        self.pieces = SPECIALS + [p for p in pieces if p not in SPECIALS]
        self.index = {p: i for i, p in enumerate(self.pieces)}
        self.bpe_marker = bpe_marker

    @classmethod
    def load(cls, vocab_path: str, bpe_marker: str = "@@ ") -> PretokenizedTokenizer:
        """Read a vocabulary file: one piece per line, optionally followed by a count."""
        with open(vocab_path, encoding="utf-8") as f:
            pieces = [line.split()[0] for line in f if line.strip()]
        return cls(pieces, bpe_marker)

    @property
    def vocab_size(self) -> int:
        return len(self.pieces)

    def encode(self, line: str) -> list[int]:
        return [self.index.get(p, UNK) for p in line.split()]

    def encode_many(self, lines: list[str]) -> list[list[int]]:
        return [self.encode(line) for line in lines]

    def decode(self, ids) -> str:
        text = " ".join(self.pieces[int(i)] for i in ids if int(i) not in (BOS, PAD, EOS))
        if self.bpe_marker:
            text = (text + " ").replace(self.bpe_marker, "").rstrip()
        return text

    def state(self) -> dict:
        return {
            "kind": self.kind,
            "pieces": self.pieces[len(SPECIALS) :],
            "bpe_marker": self.bpe_marker,
        }


def tokenizer_from_state(state: dict):
    """Rebuild a tokenizer saved with ``state()`` (for example from a checkpoint)."""
    if state["kind"] == SentencePieceTokenizer.kind:
        return SentencePieceTokenizer(state["model_proto"])
    if state["kind"] == PretokenizedTokenizer.kind:
        return PretokenizedTokenizer(state["pieces"], state["bpe_marker"])
    raise ValueError(f"unknown tokenizer kind {state['kind']!r}")
