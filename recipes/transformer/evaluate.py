"""Translate with beam search (beam 1 = greedy) and score BLEU with sacrebleu; average checkpoints.

Command line (after training; the data folder and tokenizer come from the checkpoint):

    python -m recipes.transformer.evaluate --save-dir checkpoints/transformer-smoke \\
        --average-last 3 --split test --beam 4 --lenpen 0.6

Beam search follows fairseq's: each step keeps the ``beam`` best unfinished hypotheses
of the ``2 x beam`` best candidates; a candidate ending in EOS among the best ``beam``
is finished with score ``sum(log p) / length ** lenpen``; a sentence is done when it has
``beam`` finished hypotheses, and at ``max_len_a * source length + max_len_b`` tokens
EOS is forced.

    >>> import torch
    >>> from recipes.transformer.model import Transformer, architecture
    >>> model = Transformer(architecture("transformer_tiny"), vocab_size=30).eval()
    >>> hyps = beam_search(model, torch.tensor([[5, 6, 2]]), beam=2, max_len_a=0, max_len_b=4)
    >>> len(hyps) == 1 and len(hyps[0]) <= 4
    True
"""

from __future__ import annotations

import argparse
import json
import os
import sys

if __package__ in (None, ""):  # `python recipes/transformer/evaluate.py`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch
import torch.nn.functional as F

from recipes.transformer.tokenizer import BOS, EOS, PAD


def _reorder_cache(cache: dict, order: torch.Tensor) -> None:
    for layer in cache.values():
        self_cache = layer.get("self")
        if self_cache:
            self_cache["k"] = self_cache["k"].index_select(0, order)
            self_cache["v"] = self_cache["v"].index_select(0, order)


@torch.no_grad()
def beam_search(
    model,
    src_tokens: torch.Tensor,
    *,
    beam: int = 4,
    lenpen: float = 1.0,
    max_len_a: float = 1.2,
    max_len_b: int = 10,
) -> list[list[int]]:
    """Best hypothesis (token ids, without EOS) for each source row of ``src_tokens``."""
    device = src_tokens.device
    n = src_tokens.size(0)
    enc, pad_mask = model.encode(src_tokens)
    src_len = (~pad_mask).sum(1)
    limit = model.cfg.max_positions - 1
    max_len = (max_len_a * src_len.float() + max_len_b).long().clamp(1, limit)  # tokens incl. EOS
    enc, pad_mask = enc.repeat_interleave(beam, 0), pad_mask.repeat_interleave(beam, 0)
    max_len_rows = max_len.repeat_interleave(beam, 0)

    tokens = torch.full((n * beam, 1), EOS, dtype=torch.long, device=device)
    scores = torch.zeros(n, beam, device=device)
    scores[:, 1:] = float("-inf")  # all beams start equal: keep only the first one alive
    finished: list[list[tuple[float, list[int]]]] = [[] for _ in range(n)]
    done = torch.zeros(n, dtype=torch.bool)
    cache: dict = {}
    offsets = (torch.arange(n, device=device) * beam).unsqueeze(1)
    for step in range(int(max_len.max())):
        logits = model.decode(tokens[:, -1:], enc, pad_mask, cache=cache, start=step)
        lprobs = F.log_softmax(logits[:, -1].float(), dim=-1)
        lprobs[:, PAD] = float("-inf")
        lprobs[:, BOS] = float("-inf")
        at_limit = (step + 1) >= max_len_rows
        if at_limit.any():  # the last allowed position must be EOS
            eos_col = lprobs[at_limit, EOS].clone()
            lprobs[at_limit] = float("-inf")
            lprobs[at_limit, EOS] = eos_col
        vocab = lprobs.size(1)
        cand = (scores.view(-1, 1) + lprobs).view(n, beam * vocab)
        top_scores, top_idx = cand.topk(min(2 * beam, cand.size(1)), dim=1)
        beam_idx, top_tok = top_idx // vocab, top_idx % vocab
        is_eos = top_tok.eq(EOS) & torch.isfinite(top_scores)

        # finish the EOS candidates that rank among the best `beam`
        hits = torch.nonzero(is_eos[:, :beam]).tolist()
        if hits:
            cpu_tokens = tokens.cpu()
            for s, c in hits:
                if done[s] or len(finished[s]) >= beam:
                    continue
                row = s * beam + int(beam_idx[s, c])
                hyp = cpu_tokens[row, 1:].tolist()
                length = len(hyp) + 1  # with the EOS
                finished[s].append((float(top_scores[s, c]) / (length**lenpen), hyp))
        done |= torch.tensor([len(f) >= beam for f in finished])
        if bool(done.all()):
            break
        # the best `beam` candidates that do not end in EOS continue
        rank = torch.arange(is_eos.size(1), device=device).expand_as(is_eos)
        keep = (rank + is_eos.long() * is_eos.size(1)).topk(beam, dim=1, largest=False).indices
        scores = top_scores.gather(1, keep)
        scores[~torch.isfinite(scores)] = float("-inf")
        order = (beam_idx.gather(1, keep) + offsets).view(-1)
        next_tok = top_tok.gather(1, keep).view(-1, 1)
        tokens = torch.cat([tokens.index_select(0, order), next_tok], dim=1)
        _reorder_cache(cache, order)
    return [max(f)[1] if f else [] for f in finished]


def translate(
    model,
    split,
    indices,
    *,
    tokenizer,
    device,
    beam: int,
    lenpen: float,
    max_len_a: float,
    max_len_b: int,
    max_sentences: int = 128,
) -> dict[int, str]:
    """Decode the source sentences ``indices`` of ``split``; returns {index: detokenized text}."""
    from recipes.transformer.data import collate

    was_training = model.training
    model.eval()
    order = sorted(indices, key=lambda i: int(split.src_lengths[i]))  # similar lengths together
    out: dict[int, str] = {}
    try:
        for start in range(0, len(order), max_sentences):
            chunk = order[start : start + max_sentences]
            batch = collate(split, chunk, device=device)
            hyps = beam_search(
                model,
                batch["src_tokens"],
                beam=beam,
                lenpen=lenpen,
                max_len_a=max_len_a,
                max_len_b=max_len_b,
            )
            for i, hyp in zip(chunk, hyps):
                out[int(i)] = tokenizer.decode(hyp)
    finally:
        model.train(was_training)
    return out


def corpus_bleu(hypotheses: list[str], references: list[str]) -> float:
    """sacrebleu's corpus BLEU (13a tokenization) of detokenized text."""
    try:
        import sacrebleu
    except ImportError as exc:
        raise ImportError(
            "BLEU needs sacrebleu: pip install sacrebleu (or 'commopt[recipes]')"
        ) from exc
    return float(sacrebleu.corpus_bleu(hypotheses, [references]).score)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m recipes.transformer.evaluate", description=__doc__.splitlines()[0]
    )
    p.add_argument("--save-dir", help="take the newest checkpoints of this folder")
    p.add_argument(
        "--checkpoints", nargs="+", help="explicit checkpoint files (averaged when several)"
    )
    p.add_argument(
        "--average-last", type=int, default=1, help="average the N newest numbered checkpoints"
    )
    p.add_argument("--data", help="data folder (default: the one the checkpoint was trained on)")
    p.add_argument("--split", default="test")
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--lenpen", type=float, default=0.6)
    p.add_argument("--max-len-a", type=float, default=1.2)
    p.add_argument("--max-len-b", type=int, default=10)
    p.add_argument("--max-sentences", type=int, default=128)
    p.add_argument("--limit", type=int, help="score only the first N sentences")
    p.add_argument("--output", help="write the translations here, one per line")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return p


def main(argv: list[str] | None = None) -> int:
    from recipes.transformer.checkpoint import average_checkpoints, numbered_checkpoints
    from recipes.transformer.data import load_split
    from recipes.transformer.model import Transformer, TransformerConfig
    from recipes.transformer.tokenizer import tokenizer_from_state

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.checkpoints:
        paths = args.checkpoints
    elif args.save_dir:
        paths = numbered_checkpoints(args.save_dir)[-args.average_last :]
        if not paths:
            parser.error(f"no checkpoint_*_*.pt files in {args.save_dir}")
    else:
        parser.error("give --save-dir or --checkpoints")
    for p in paths:
        if not os.path.isfile(p):
            parser.error(f"checkpoint {p} does not exist")
    state = average_checkpoints(paths)
    train_args = state["args"]
    tokenizer = tokenizer_from_state(state["tokenizer"])
    model = Transformer(TransformerConfig(**state["model_config"]), tokenizer.vocab_size)
    model.load_state_dict(state["model"])
    model.to(args.device).eval()
    data_dir = args.data or train_args["data"]
    split = load_split(
        data_dir,
        args.split,
        train_args["src_lang"],
        train_args["tgt_lang"],
        tokenizer,
        tokenizer_key=state["tokenizer_key"],
    )
    n = len(split) if args.limit is None else min(args.limit, len(split))
    hyps = translate(
        model,
        split,
        range(n),
        tokenizer=tokenizer,
        device=args.device,
        beam=args.beam,
        lenpen=args.lenpen,
        max_len_a=args.max_len_a,
        max_len_b=args.max_len_b,
        max_sentences=args.max_sentences,
    )
    ordered = [hyps[i] for i in range(n)]
    bleu = corpus_bleu(ordered, split.references[:n])
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.writelines(h + "\n" for h in ordered)
    print(
        json.dumps(
            {
                "event": "bleu",
                "split": args.split,
                "bleu": round(bleu, 2),
                "sentences": n,
                "checkpoints": [os.path.basename(p) for p in paths],
                "beam": args.beam,
                "lenpen": args.lenpen,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
