"""Command-line options of ``train.py``: a preset gives the defaults, flags override them,
and :func:`parse_args` rejects what cannot work with a message that says what to do.

    >>> args = parse_args(["--preset", "smoke", "--max-update", "5"])
    >>> args.arch, args.max_update, args.max_tokens
    ('transformer_tiny', 5, 2000)
"""

from __future__ import annotations

import argparse
import os

from recipes.common import add_commopt_arguments
from recipes.transformer.model import ARCHITECTURES
from recipes.transformer.presets import PRESETS, preset_names


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m recipes.transformer.train",
        description="Train a fairseq-style Transformer for translation with commopt data parallelism.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    # Every default below is None: None means "take the preset's value".
    g = p.add_argument_group("preset and data")
    g.add_argument("--preset", required=True, help=f"one of: {', '.join(preset_names())}")
    g.add_argument("--data", help="folder with {train,valid,test}.{src_lang,tgt_lang} text files")
    g.add_argument(
        "--save-dir", help="checkpoints and logs (default: checkpoints/transformer-PRESET)"
    )
    g.add_argument("--src-lang")
    g.add_argument("--tgt-lang")
    g.add_argument("--spm-model", help="use this sentencepiece model instead of training one")
    g.add_argument(
        "--bpe-vocab",
        help="the text is already split into subwords (e.g. '@@ ' BPE); "
        "this is its vocabulary file",
    )
    g.add_argument(
        "--vocab-size", type=int, help="size of the sentencepiece model the recipe trains"
    )
    g.add_argument("--spm-type", choices=["bpe", "unigram"])
    g.add_argument("--max-positions", type=int, help="sentence pairs longer than this are skipped")

    g = p.add_argument_group("model")
    g.add_argument("--arch", help=f"one of: {', '.join(ARCHITECTURES)}")
    g.add_argument("--normalize-before", action="store_true", default=None, help="pre-norm layers")
    g.add_argument("--dropout", type=float)
    g.add_argument("--attention-dropout", type=float)
    g.add_argument("--activation-dropout", type=float)

    g = p.add_argument_group("batching and optimization")
    g.add_argument("--max-tokens", type=int, help="padded tokens per batch per rank")
    g.add_argument(
        "--batch-size",
        type=int,
        help="sentences per update over all ranks (instead of "
        "--max-tokens); divisible by ranks x --update-freq",
    )
    g.add_argument("--update-freq", type=int, help="batches accumulated per update on each rank")
    g.add_argument("--lr", type=float, help="peak learning rate")
    g.add_argument("--warmup-updates", type=int)
    g.add_argument("--warmup-init-lr", type=float)
    g.add_argument("--adam-betas", help="beta1,beta2")
    g.add_argument("--adam-eps", type=float)
    g.add_argument("--weight-decay", type=float)
    g.add_argument("--clip-norm", type=float, help="clip the gradient norm (0: no clipping)")
    g.add_argument("--label-smoothing", type=float)
    g.add_argument("--max-update", type=int, help="stop after this many updates")
    g.add_argument("--max-epoch", type=int, help="stop after this many epochs (0: no limit)")
    g.add_argument("--seed", type=int)
    g.add_argument(
        "--precision",
        choices=["fp32", "fp16", "bf16"],
        help="compute precision (fp16 uses dynamic loss scaling; GPU only)",
    )
    g.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    g.add_argument(
        "--threads", type=int, help="CPU threads per rank (default: cores / ranks per node)"
    )

    add_commopt_arguments(p)

    g = p.add_argument_group("local steps (DiLoCo; docs/local-steps.md)")
    g.add_argument(
        "--sync-every",
        type=int,
        help="take local steps and average the weights' changes every N updates (the "
        "local_steps schedule; default: average the gradients every update)",
    )
    g.add_argument(
        "--fragments", type=int, help="fragments synchronised on a staggered schedule (default 1)"
    )
    g.add_argument(
        "--overlap-steps",
        type=int,
        help="updates a fragment's reduction overlaps before it is applied (default 0)",
    )
    g.add_argument("--outer-lr", type=float, help="the outer Nesterov SGD's learning rate (0.7)")

    g = p.add_argument_group("checkpoints, validation and logging")
    g.add_argument(
        "--save-interval-updates", type=int, help="save every N updates (0: end of epoch only)"
    )
    g.add_argument("--keep-last", type=int, help="keep the N newest numbered checkpoints")
    g.add_argument("--no-save", action="store_true", help="write no checkpoints")
    g.add_argument(
        "--restore-file",
        help="resume from this checkpoint (default: SAVE_DIR/checkpoint_last.pt if it exists)",
    )
    g.add_argument(
        "--reset", action="store_true", help="start afresh even if SAVE_DIR has a checkpoint"
    )
    g.add_argument(
        "--validate-interval-updates", type=int, help="validate every N updates (0: per epoch)"
    )
    g.add_argument(
        "--eval-bleu", action="store_true", help="also decode the valid set and report BLEU"
    )
    g.add_argument(
        "--final-eval",
        choices=["none", "valid", "test"],
        help="split to score with BLEU at the end",
    )
    g.add_argument(
        "--average-last", type=int, help="final BLEU with the average of the last N checkpoints"
    )
    g.add_argument("--beam", type=int)
    g.add_argument("--lenpen", type=float)
    g.add_argument("--max-len-a", type=float)
    g.add_argument("--max-len-b", type=int)
    g.add_argument("--log-interval", type=int)
    g.add_argument("--json-log", help="JSON-lines log (default: SAVE_DIR/log.jsonl)")
    g.add_argument("--no-progress-bar", action="store_true")
    return p


def parse_args(argv: list[str] | None = None, world_size: int | None = None) -> argparse.Namespace:
    """Parse, fill from the preset and validate; errors exit with status 2 and a message."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.preset not in PRESETS:
        parser.error(f"unknown preset {args.preset!r}; choose one of: {', '.join(preset_names())}")
    preset = PRESETS[args.preset]
    given = {k for k, v in vars(args).items() if v is not None}
    if "batch_size" in given and "max_tokens" not in given:
        args.max_tokens = 0  # --batch-size replaces the preset's --max-tokens
    for key, value in preset.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.normalize_before = bool(args.normalize_before)
    for key in ("dropout", "attention_dropout", "activation_dropout"):
        if not hasattr(args, key):
            setattr(args, key, None)
    if args.save_dir is None:
        args.save_dir = os.path.join("checkpoints", f"transformer-{args.preset}")
    if args.json_log is None:
        args.json_log = os.path.join(args.save_dir, "log.jsonl")
    try:
        validate(args, given=given, world_size=world_size)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def validate(args: argparse.Namespace, *, given: set[str], world_size: int | None) -> None:
    """Raise ValueError with the fix for any option that cannot work.

    ``given``: the options set on the command line; ``world_size``: the number of ranks
    (None when not known yet).
    """
    if args.arch not in ARCHITECTURES:
        raise ValueError(f"unknown --arch {args.arch!r}; choose one of: {', '.join(ARCHITECTURES)}")
    if args.data is None:
        raise ValueError(
            f"the {args.preset} preset needs --data DIR (see docs/recipes.md for preparing it)"
        )
    if not os.path.isdir(args.data) and ("data" in given or not args.generate_smoke_corpus):
        hint = (
            "leave --data out to let the smoke preset generate its corpus, or run "
            f"`python -m recipes.transformer.smoke_corpus {args.data}`"
            if args.generate_smoke_corpus
            else "see docs/recipes.md for downloading and preparing it"
        )
        raise ValueError(f"data folder {args.data!r} does not exist; {hint}")
    if "batch_size" in given and "max_tokens" in given:
        raise ValueError("give --max-tokens or --batch-size, not both")
    if args.max_tokens == 0 and "batch_size" in given:
        args.max_tokens = None
    elif args.max_tokens is not None and args.max_tokens <= 0:
        raise ValueError(f"--max-tokens must be a positive number of tokens, got {args.max_tokens}")
    if args.update_freq < 1:
        raise ValueError(f"--update-freq must be >= 1, got {args.update_freq}")
    if args.batch_size is not None:
        if args.batch_size <= 0:
            raise ValueError(f"--batch-size must be positive, got {args.batch_size}")
        if world_size is not None and args.batch_size % (world_size * args.update_freq):
            raise ValueError(
                f"--batch-size {args.batch_size} is not divisible by {world_size} ranks x "
                f"--update-freq {args.update_freq}; use a multiple of {world_size * args.update_freq}"
            )
    if args.max_tokens is None and args.batch_size is None:
        raise ValueError("give --max-tokens or --batch-size")
    if args.max_update <= 0 and args.max_epoch <= 0:
        raise ValueError("give --max-update or --max-epoch (a positive number)")
    if args.lr <= 0 or args.warmup_updates < 0 or not 0 <= args.warmup_init_lr <= args.lr:
        raise ValueError("need --lr > 0, --warmup-updates >= 0 and 0 <= --warmup-init-lr <= --lr")
    try:
        betas = tuple(float(b) for b in str(args.adam_betas).strip("()").split(","))
    except ValueError:
        betas = ()
    if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
        raise ValueError(
            f"--adam-betas must be two numbers in [0, 1) like 0.9,0.98; got {args.adam_betas!r}"
        )
    args.adam_betas = betas
    if not 0 <= args.label_smoothing < 1:
        raise ValueError(f"--label-smoothing must be in [0, 1), got {args.label_smoothing}")
    if args.spm_model and args.bpe_vocab:
        raise ValueError("give --spm-model or --bpe-vocab, not both")
    for flag in ("spm_model", "bpe_vocab", "restore_file"):
        path = getattr(args, flag)
        if path and not os.path.isfile(path):
            raise ValueError(f"--{flag.replace('_', '-')} {path!r} is not a file")
    if args.beam < 1:
        raise ValueError(f"--beam must be >= 1, got {args.beam}")
    if args.average_last < 1:
        raise ValueError(f"--average-last must be >= 1, got {args.average_last}")
    if args.compression in ("", "none", "None"):
        args.compression = None
    _validate_local_steps(args)


#: the local-steps options of the command line and the optimizer's keyword for each
LOCAL_STEPS = {
    "sync_every": "sync_every",
    "fragments": "fragments",
    "overlap_steps": "overlap_steps",
    "outer_lr": "outer_lr",
}


def _validate_local_steps(args: argparse.Namespace) -> None:
    given = [k for k in LOCAL_STEPS if k != "sync_every" and getattr(args, k, None) is not None]
    if args.sync_every is None:
        if given:
            raise ValueError(
                f"--{given[0].replace('_', '-')} is an option of local steps: give --sync-every N"
            )
        return
    if args.sync_every < 1:
        raise ValueError(f"--sync-every must be >= 1, got {args.sync_every}")
    if args.double_buffering:
        raise ValueError("give --sync-every or --double-buffering, not both")


def local_steps_options(args: argparse.Namespace) -> dict[str, object]:
    """The optimizer's keyword arguments for the local-steps options given (none: {})."""
    if getattr(args, "sync_every", None) is None:
        return {}
    out: dict[str, object] = {"schedule": "local_steps"}
    for flag, keyword in LOCAL_STEPS.items():
        value = getattr(args, flag, None)
        if value is not None:
            out[keyword] = value
    return out
