"""Named sets of defaults for ``train.py``; any command-line flag overrides its preset value.

* ``smoke``: the synthetic corpus of :mod:`recipes.transformer.smoke_corpus` (generated on
  first use), a 0.26M-parameter Transformer, Adam at lr 2e-3 after 300 warm-up updates,
  800 updates: learns to a BLEU near 100 in a few minutes on 2 CPU cores, with or without
  gradient compression or double buffering (benchmarks/parity_transformer.py). The peak
  LR is lower and the warm-up longer than a plain run needs because double buffering's
  one-step-stale Adam updates learn far slower at lr 3e-3 with 100 warm-up updates.
* ``wmt16-en-de``: Ott et al. 2018 (published): ``transformer_vaswani_wmt_en_de_big``,
  Adam (0.9, 0.98), lr 1e-3 with 4000 warm-up updates from 1e-7, label smoothing 0.1,
  3584 tokens per GPU, fp16 with dynamic loss scaling, joint 32k vocabulary, beam 4 and
  length penalty 0.6 over the average of the last 10 checkpoints.

    >>> PRESETS["smoke"]["arch"], PRESETS["smoke"]["lr"], PRESETS["smoke"]["max_update"]
    ('transformer_tiny', 0.002, 800)
    >>> sorted(PRESETS)
    ['smoke', 'wmt16-en-de']
"""

from __future__ import annotations

COMMON = {
    "src_lang": "en",
    "tgt_lang": "de",
    "tokenizer": "sentencepiece",
    "spm_type": "bpe",
    "adam_betas": "0.9,0.98",
    "adam_eps": 1e-8,
    "weight_decay": 0.0,
    "warmup_init_lr": 1e-7,
    "label_smoothing": 0.1,
    "clip_norm": 0.0,
    "update_freq": 1,
    "max_epoch": 0,
    "seed": 1,
    "beam": 4,
    "lenpen": 0.6,
    "max_len_a": 1.2,
    "max_len_b": 10,
    "log_interval": 100,
    "keep_last": 10,
    "average_last": 1,
    "final_eval": "test",
}

PRESETS: dict[str, dict] = {
    "smoke": {
        **COMMON,
        "data": "data/transformer-smoke",
        "generate_smoke_corpus": True,
        "src_lang": "src",
        "tgt_lang": "tgt",
        "arch": "transformer_tiny",
        "vocab_size": 400,
        "max_tokens": 2000,
        "max_positions": 256,
        # a gentle schedule so that double buffering (one-step-stale Adam) matches fp32 too:
        # at lr 3e-3 with 100 warm-up updates it fell to 14 BLEU (docs/recipes.md)
        "lr": 2e-3,
        "warmup_updates": 300,
        "max_update": 800,
        "precision": "fp32",
        "save_interval_updates": 100,
        "validate_interval_updates": 100,
        "log_interval": 25,
        "keep_last": 3,
        "average_last": 1,
        "beam": 1,
        "lenpen": 1.0,  # greedy: the smoke language has one right answer
    },
    "wmt16-en-de": {
        **COMMON,
        "data": None,  # required: see docs/recipes.md for preparing it
        "generate_smoke_corpus": False,
        "arch": "transformer_vaswani_wmt_en_de_big",
        "vocab_size": 32000,
        "max_tokens": 3584,
        "max_positions": 1024,
        "lr": 1e-3,
        "warmup_updates": 4000,
        "max_update": 30000,
        "precision": "fp16",
        "save_interval_updates": 1000,
        "validate_interval_updates": 1000,
        "average_last": 10,
    },
}


def preset_names() -> list[str]:
    return sorted(PRESETS)
