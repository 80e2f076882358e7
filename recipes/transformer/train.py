"""Train a fairseq-style Transformer for translation with commopt data parallelism.

One runnable script, top to bottom (tokenizer, data, the Trainer's loop, evaluation,
checkpoints); the model, data and launch pieces live beside it in recipes/transformer/, and
what both recipes share in recipes/common.py and recipes/run_log.py.

    # one process, the synthetic smoke corpus (generated on first use), a few minutes on a CPU
    python -m recipes.transformer.train --preset smoke
    # two ranks with 4-bit QSGD and error feedback
    mpirun -np 2 python -m recipes.transformer.train --preset smoke --compression qsgd4+ef
    # WMT'16 En-De, Transformer big, 8 GPUs per node
    torchrun --nproc-per-node 8 recipes/transformer/train.py --preset wmt16-en-de --data data/wmt16_en_de

One update: every rank takes its ``--update-freq`` batches of at most ``--max-tokens``
padded tokens, sums the label-smoothed cross-entropy, divides it by its own number of
target tokens and back-propagates; the commopt optimizer averages the gradients over the
ranks (compressed as asked) and Adam applies them with the inverse-sqrt learning rate.

Resuming is exact: a checkpoint holds the model, the optimizer wrapper's state (Adam's
moments and whatever commopt keeps: error-feedback residuals, a pending double-buffered
gradient), the loss scaler, the data position and every rank's random state, and
dropout is seeded per update. ``SAVE_DIR/checkpoint_last.pt`` is picked up by the next
run in the same folder unless ``--reset`` is given.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import random
import sys
import time

if __package__ in (None, ""):  # `python recipes/transformer/train.py`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch

from commopt.optim.checkpoint import (
    drop_codec_state,
    has_codec_state,
    join_rank_state,
    split_rank_state,
)
from recipes.common import choose_device, create_communicator, multi_node_optimizer, set_cpu_threads
from recipes.precision import MixedPrecision
from recipes.run_log import RunLog
from recipes.transformer import checkpoint as ckpt
from recipes.transformer.data import ShardedBatchIterator, collate, load_split, shard_for_rank
from recipes.transformer.model import (
    Transformer,
    architecture,
    count_parameters,
    label_smoothed_nll_loss,
)
from recipes.transformer.options import build_parser, local_steps_options, parse_args
from recipes.transformer.schedule import inverse_sqrt_lr, set_lr

LN2 = math.log(2.0)


# -- set-up -----------------------------------------------------------------------------
def _tokenizer_key(state: dict) -> str:
    import hashlib

    h = hashlib.sha1(state["kind"].encode())
    h.update(state.get("model_proto") or "\n".join(state.get("pieces", [])).encode())
    return h.hexdigest()


def prepare_tokenizer(args, comm, restored: dict | None):
    """Rank 0 trains (or reads) the tokenizer; every rank gets it from rank 0's bytes."""
    from recipes.transformer.data import split_paths
    from recipes.transformer.tokenizer import (
        PretokenizedTokenizer,
        SentencePieceTokenizer,
        tokenizer_from_state,
    )

    state = None
    if restored is not None:
        state = restored["tokenizer"]
    elif comm.rank == 0:
        if args.bpe_vocab:
            tok = PretokenizedTokenizer.load(args.bpe_vocab)
        elif args.spm_model:
            tok = SentencePieceTokenizer.load(args.spm_model)
        else:
            files = list(split_paths(args.data, "train", args.src_lang, args.tgt_lang))
            for f in files:
                if not os.path.isfile(f):
                    raise FileNotFoundError(
                        f"missing {f}: the data folder needs train.{args.src_lang} "
                        f"and train.{args.tgt_lang}"
                    )
            tok = SentencePieceTokenizer.train(
                files, args.vocab_size, model_type=args.spm_type, threads=torch.get_num_threads()
            )
            os.makedirs(args.save_dir, exist_ok=True)
            with open(os.path.join(args.save_dir, "spm.model"), "wb") as f:
                f.write(tok.model_proto)  # for tools outside the recipe
        state = tok.state()
    state = comm.bcast_obj(state, 0)
    return tokenizer_from_state(state), _tokenizer_key(state)


def load_data(args, comm, tokenizer, key: str) -> dict:
    """Encode the splits once per node (the first rank writes the cache, the others read it)."""

    def load(split):
        return load_split(
            args.data, split, args.src_lang, args.tgt_lang, tokenizer, tokenizer_key=key
        )

    splits = ["train", "valid"] + (["test"] if args.final_eval == "test" else [])
    data = {}
    if comm.intra_rank == 0:
        data = {s: load(s) for s in splits}
    comm.barrier()
    if comm.intra_rank != 0:
        data = {s: load(s) for s in splits}
    return data


# -- random state ---------------------------------------------------------------------------
def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def seed_update(seed: int, rank: int, num_updates: int) -> None:
    """Dropout masks depend only on (seed, rank, update): resuming reproduces them."""
    torch.manual_seed((seed * 1_000_003 + rank * 10_007 + num_updates) % (2**63))


# -- the trainer --------------------------------------------------------------------------
@dataclasses.dataclass
class Stats:
    loss: float | torch.Tensor = 0.0  # label-smoothed, summed over target tokens, nats
    nll: float | torch.Tensor = 0.0
    ntokens: int = 0
    nsentences: int = 0
    updates: int = 0

    def add(self, other: Stats) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def as_floats(self) -> Stats:
        return Stats(float(self.loss), float(self.nll), self.ntokens, self.nsentences, self.updates)


class Trainer:
    """Holds everything one rank needs to run and resume the training loop."""

    def __init__(self, args, comm, device, data, tokenizer, tokenizer_key, log: RunLog):
        self.args, self.comm, self.device, self.data = args, comm, device, data
        self.tokenizer, self.tokenizer_key, self.log = tokenizer, tokenizer_key, log
        self.cfg = architecture(
            args.arch,
            dropout=args.dropout,
            attention_dropout=args.attention_dropout,
            activation_dropout=args.activation_dropout,
            normalize_before=args.normalize_before or None,
            max_positions=args.max_positions,
        )
        torch.manual_seed(args.seed)  # the same initial weights everywhere (rank 0's win anyway)
        self.model = Transformer(self.cfg, tokenizer.vocab_size).to(device)
        base = torch.optim.Adam(
            self.model.parameters(),
            lr=args.warmup_init_lr,
            betas=args.adam_betas,
            eps=args.adam_eps,
            weight_decay=args.weight_decay,
        )
        self.optimizer = multi_node_optimizer(
            base, comm, args, model=self.model, seed=args.seed, **local_steps_options(args)
        )
        self.precision = MixedPrecision.resolve(args.precision, device)
        self.scaler = self.precision.scaler
        batch_sentences = None
        if args.batch_size:
            batch_sentences = args.batch_size // (comm.size * args.update_freq)
        self.iterator = ShardedBatchIterator(
            data["train"],
            rank=comm.rank,
            world_size=comm.size,
            update_freq=args.update_freq,
            seed=args.seed,
            max_tokens=args.max_tokens,
            max_sentences=batch_sentences,
            max_positions=args.max_positions,
        )
        self.num_updates = 0
        self.best_valid_loss = float("inf")
        self.train_time = 0.0  # seconds spent in updates, over all runs of this training

    # -- one update ---------------------------------------------------------------------
    def _no_sync(self, last: bool):
        """Accumulating batches: only the last backward of an update starts the reduction."""
        return contextlib.nullcontext() if last else self.optimizer.no_sync()

    def train_update(self, batches) -> Stats:
        args = self.args
        set_lr(
            self.optimizer,
            inverse_sqrt_lr(
                self.num_updates,
                lr=args.lr,
                warmup_updates=args.warmup_updates,
                warmup_init_lr=args.warmup_init_lr,
            ),
        )
        seed_update(args.seed, self.comm.rank, self.num_updates)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        samples = [collate(self.data["train"], b, device=self.device) for b in batches]
        local_tokens = sum(s["ntokens"] for s in samples)
        stats = Stats(updates=1)
        for i, sample in enumerate(samples):
            with self._no_sync(i == len(samples) - 1):
                with self.precision.autocast():
                    logits = self.model(sample["src_tokens"], sample["prev_output_tokens"])
                loss, nll = label_smoothed_nll_loss(logits, sample["target"], args.label_smoothing)
                # per-token mean over this rank's update; the optimizer averages over ranks
                scaled = loss / local_tokens
                self.precision.backward(scaled)
            # tensors, not floats: reading them would wait for the GPU at every batch
            stats.add(
                Stats(
                    loss=loss.detach(),
                    nll=nll.detach(),
                    ntokens=sample["ntokens"],
                    nsentences=sample["nsentences"],
                )
            )
        clip, double_buffered = args.clip_norm > 0, args.double_buffering
        if self.scaler is not None and (clip or not double_buffered):
            if not double_buffered:
                self.optimizer.synchronize()  # unscale and check the averaged gradients
            # (double buffering: unscale this rank's gradients before they are sent)
            self.scaler.unscale_(self.optimizer)
        if clip:
            self.optimizer.synchronize()  # the gradients step() applies, averaged
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), args.clip_norm)
        self.precision.step(self.optimizer)
        self.num_updates += 1
        return stats

    # -- validation -----------------------------------------------------------------------
    @torch.no_grad()
    def valid_loss(self) -> dict:
        """Loss over the whole valid set, each rank scoring a contiguous share."""
        self.optimizer.wait()  # no gradient reduction in flight while we evaluate
        split = self.data["valid"]
        self.model.eval()
        mine = list(shard_for_rank(len(split), self.comm.rank, self.comm.size))
        from recipes.transformer.data import batches_by_size

        total = Stats()
        if mine:
            idx = torch.tensor(mine)
            for b in batches_by_size(
                split.src_lengths,
                split.tgt_lengths,
                indices=idx,
                max_tokens=max(self.args.max_tokens or 0, 4096),
            ):
                sample = collate(split, b, device=self.device)
                with self.precision.autocast():
                    logits = self.model(sample["src_tokens"], sample["prev_output_tokens"])
                loss, nll = label_smoothed_nll_loss(
                    logits, sample["target"], self.args.label_smoothing
                )
                total.add(
                    Stats(
                        loss=loss,
                        nll=nll,
                        ntokens=sample["ntokens"],
                        nsentences=sample["nsentences"],
                    )
                )
        self.model.train()
        everyone = Stats()
        for s in self.comm.allgather_obj(total.as_floats()):
            everyone.add(s)
        return {
            "loss": everyone.loss / everyone.ntokens / LN2,
            "nll_loss": everyone.nll / everyone.ntokens / LN2,
            "ppl": 2 ** (everyone.nll / everyone.ntokens / LN2),
        }

    def bleu(self, split_name: str) -> float:
        """Decode ``split_name`` (each rank a share) and score it on rank 0; every rank gets it."""
        from recipes.transformer.evaluate import corpus_bleu, translate

        self.optimizer.wait()
        split = self.data[split_name]
        mine = list(shard_for_rank(len(split), self.comm.rank, self.comm.size))
        a = self.args
        hyps = translate(
            self.model,
            split,
            mine,
            tokenizer=self.tokenizer,
            device=self.device,
            beam=a.beam,
            lenpen=a.lenpen,
            max_len_a=a.max_len_a,
            max_len_b=a.max_len_b,
        )
        merged: dict[int, str] = {}
        for part in self.comm.allgather_obj(hyps):
            merged.update(part)
        score = None
        if self.comm.rank == 0:
            score = corpus_bleu([merged[i] for i in range(len(split))], split.references)
        return self.comm.bcast_obj(score, 0)

    def validate(self, epoch: int) -> None:
        # compensated double buffering: the model holds predicted weights between steps
        with self.optimizer.true_weights():
            result = self.valid_loss()
            if self.args.eval_bleu:
                result["bleu"] = self.bleu("valid")
        self.best_valid_loss = min(self.best_valid_loss, result["loss"])
        self.log.event(
            "valid",
            echo=True,
            epoch=epoch,
            update=self.num_updates,
            best_loss=self.best_valid_loss,
            **result,
        )

    # -- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The checkpoint: rank 0's shared state plus every rank's own (random state)."""
        rank_states = self.comm.allgather_obj({"rng": rng_state()})
        return {
            "args": dict(vars(self.args)),
            "model_config": dataclasses.asdict(self.cfg),
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler else None,
            "num_updates": self.num_updates,
            "train_iterator": self.iterator.state_dict(),
            "best_valid_loss": self.best_valid_loss,
            "train_time": self.train_time,
            "world_size": self.comm.size,
            "rank_states": rank_states,
            "tokenizer": self.tokenizer.state(),
            "tokenizer_key": self.tokenizer_key,
        }

    def save(self) -> None:
        if self.args.no_save:
            return
        state = self.state_dict()  # collective: every rank takes part
        # The optimizer's per-rank part (error-feedback residuals) goes to this rank's own
        # file beside the checkpoint; the rest, the same on every rank, into rank 0's file.
        state["optimizer"], own = split_rank_state(state["optimizer"])
        # Rank files only when there is such state; rank 0's file says so, so that a rank
        # whose file is missing at resume fails instead of losing its residuals silently.
        state["rank_files"] = self.comm.size if has_codec_state(own["codec_state"]) else 0
        if state["rank_files"]:
            for name in (f"checkpoint_{self.iterator.epoch}_{self.num_updates}.pt", ckpt.LAST):
                ckpt.atomic_save(
                    own, os.path.join(self.args.save_dir, name) + f".rank{self.comm.rank}"
                )
            self.comm.barrier()  # before rank 0 prunes old checkpoints and their rank files
        if self.comm.rank == 0:
            path = ckpt.save_checkpoint(
                state,
                self.args.save_dir,
                epoch=self.iterator.epoch,
                num_updates=self.num_updates,
                keep_last=self.args.keep_last,
            )
            self.log.event("checkpoint", echo=True, update=self.num_updates, path=path)
        self.comm.barrier()  # nobody runs ahead of a checkpoint that is being written

    def load_state_dict(self, state: dict) -> None:
        if dataclasses.asdict(self.cfg) != state["model_config"]:
            raise ValueError(
                "the checkpoint's model differs from --arch and its options; "
                "resume with the same ones or pass --reset"
            )
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(self._own_optimizer_state(state["optimizer"]))
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.num_updates = int(state["num_updates"])
        self.best_valid_loss = float(state.get("best_valid_loss", float("inf")))
        self.train_time = float(state.get("train_time", 0.0))
        self.iterator.load_state_dict(state["train_iterator"])
        ranks = state.get("rank_states") or []
        if state.get("world_size") != self.comm.size:
            self.log.write(
                f"resuming {state.get('world_size')}-rank training on {self.comm.size} ranks: "
                f"the data order (and any per-rank optimizer state) differs from an uninterrupted run"
            )
            self.iterator.updates_in_epoch = min(
                self.iterator.updates_in_epoch, self.iterator.updates_per_epoch
            )
        if self.comm.rank < len(ranks):
            set_rng_state(ranks[self.comm.rank]["rng"])

    def _own_optimizer_state(self, opt_state: dict) -> dict:
        """The optimizer state this rank can load: the checkpoint file is rank 0's.

        With error feedback each rank's residuals are in its own ``.rank{r}`` file; a rank
        that finds another rank's, or a checkpoint of another number of ranks, restarts its
        residuals at zero (commopt.optim.drop_codec_state), which the log says.
        """
        extra = opt_state.get("commopt") or {}
        if (
            extra.get("version") == 2
            and has_codec_state(extra.get("codec_state", {}))
            and (extra["rank"] != self.comm.rank or extra["world_size"] != self.comm.size)
        ):
            self.log.write(
                f"rank {self.comm.rank}: error-feedback residuals restart at zero "
                f"(the checkpoint holds rank {extra['rank']}'s of "
                f"{extra['world_size']} ranks)"
            )
            return drop_codec_state(opt_state)
        return opt_state

    # -- the loop ------------------------------------------------------------------------------
    def done(self) -> bool:
        a = self.args
        return (a.max_update > 0 and self.num_updates >= a.max_update) or (
            a.max_epoch > 0 and self.iterator.epoch > a.max_epoch
        )

    def train(self) -> None:
        a, log = self.args, self.log
        window, window_start = Stats(), time.time()
        last_validated = last_saved = -1
        while not self.done():
            epoch = self.iterator.epoch
            for batches in self.iterator.updates():
                t0 = time.time()
                stats = self.train_update(batches)
                self.train_time += time.time() - t0
                window.add(stats)
                at_end = self.done()
                if self.num_updates % a.log_interval == 0 or at_end:
                    shown = self._log_train(window, time.time() - window_start, epoch)
                    window, window_start = Stats(), time.time()
                    log.advance(1, f"loss {shown:.3f} epoch {epoch}" if log.bar_shown else "")
                else:
                    log.advance(1)
                if at_end:
                    break
                if (
                    a.validate_interval_updates
                    and self.num_updates % a.validate_interval_updates == 0
                ):
                    self.validate(epoch)
                    last_validated = self.num_updates
                if a.save_interval_updates and self.num_updates % a.save_interval_updates == 0:
                    self.save()
                    last_saved = self.num_updates
            if self.iterator.end_of_epoch:
                self.iterator.next_epoch()
                if not self.done():
                    if not a.validate_interval_updates:
                        self.validate(epoch)
                        last_validated = self.num_updates
                    if not a.save_interval_updates:
                        self.save()
                        last_saved = self.num_updates
        if a.double_buffering or a.sync_every:
            self.optimizer.flush()  # apply the gradients still pending: the model is final only now
            last_validated = last_saved = -1
        if last_validated != self.num_updates:
            self.validate(self.iterator.epoch)
        if last_saved != self.num_updates:
            self.save()

    def _log_train(self, window: Stats, seconds: float, epoch: int) -> float:
        """Log the window's statistics summed over the ranks; returns the loss (bits/token)."""
        everyone = Stats()
        for s in self.comm.allgather_obj(window.as_floats()):
            everyone.add(s)
        n = max(everyone.ntokens, 1)
        updates = max(window.updates, 1)
        self.log.event(
            "train",
            echo=not self.log.bar_shown,  # the bar shows the loss; without one, a line does
            epoch=epoch,
            update=self.num_updates,
            loss=everyone.loss / n / LN2,
            nll_loss=everyone.nll / n / LN2,
            ppl=2 ** (everyone.nll / n / LN2),
            lr=self.optimizer.param_groups[0]["lr"],
            wps=everyone.ntokens / max(seconds, 1e-9),
            ups=updates / max(seconds, 1e-9),
            wpb=everyone.ntokens / updates,
            bsz=everyone.nsentences / updates,
            loss_scale=self.scaler.get_scale() if self.scaler else None,
            train_time=self.train_time,
        )
        return everyone.loss / n / LN2

    def final_evaluation(self) -> float | None:
        """BLEU of the average of the last ``--average-last`` checkpoints (or the model as is)."""
        a = self.args
        if a.final_eval == "none":
            return None
        self.optimizer.wait()
        averaged = 1
        if a.average_last > 1 and not a.no_save:
            paths = (
                ckpt.numbered_checkpoints(a.save_dir)[-a.average_last :]
                if self.comm.rank == 0
                else None
            )
            paths = self.comm.bcast_obj(paths, 0)
            averaged = len(paths)
            if averaged > 1:
                if self.comm.rank == 0:
                    self.model.load_state_dict(ckpt.average_checkpoints(paths)["model"])
                for tensor in self.model.state_dict().values():  # rank 0's average to everyone
                    self.comm.broadcast(tensor, 0)
        score = self.bleu(a.final_eval)
        self.log.event(
            "final",
            echo=True,
            split=a.final_eval,
            bleu=score,
            averaged_checkpoints=averaged,
            beam=a.beam,
            lenpen=a.lenpen,
            update=self.num_updates,
            train_time=self.train_time,
        )
        return score


def _restore_state(args, comm) -> dict | None:
    """The checkpoint to resume from, read where it exists and sent to the ranks that lack it."""
    path = args.restore_file or os.path.join(args.save_dir, ckpt.LAST)
    if args.reset and not args.restore_file:
        return None
    have = comm.allgather_obj(os.path.isfile(path))
    if not any(have):
        if args.restore_file:
            raise FileNotFoundError(f"--restore-file {path} is missing on every rank")
        return None
    if all(have):
        state = ckpt.load_checkpoint(path)
    elif not have[0]:
        raise FileNotFoundError(f"{path} exists on some ranks but not on rank 0")
    else:
        state = comm.bcast_obj(ckpt.load_checkpoint(path) if comm.rank == 0 else None, 0)
    extra = state["optimizer"].get("commopt")
    if extra is not None and "rank" not in extra:  # the per-rank part lives beside it
        own_path = f"{path}.rank{comm.rank}"
        if os.path.isfile(own_path):
            own = ckpt.load_checkpoint(own_path)
        elif state.get("rank_files") == comm.size:
            raise FileNotFoundError(
                f"rank {comm.rank}: {own_path} is missing: the checkpoint keeps each of its "
                f"{comm.size} ranks' error-feedback residuals in a file of its own. Copy rank "
                f"{comm.rank}'s file there (resuming with another number of ranks restarts the "
                f"residuals at zero instead)"
            )
        else:
            own = {"rank": comm.rank, "world_size": comm.size, "codec_state": {}}  # none saved
        state["optimizer"] = join_rank_state(state["optimizer"], own)
    return state


def run(argv: list[str] | None = None) -> Trainer:
    """Train as the command line says; returns the trainer (tests inspect it)."""
    args = parse_args(argv)
    device = choose_device(args.device)
    try:
        MixedPrecision.resolve(args.precision, device)
    except ValueError as exc:
        build_parser().error(f"--precision {args.precision}: {exc}")
    comm = create_communicator(args.communicator)
    if args.batch_size and args.batch_size % (comm.size * args.update_freq):
        build_parser().error(
            f"--batch-size {args.batch_size} is not divisible by {comm.size} ranks x --update-freq "
            f"{args.update_freq}; use a multiple of {comm.size * args.update_freq}"
        )
    threads = set_cpu_threads(args.threads, comm.intra_size) if device.type == "cpu" else None

    if (
        args.generate_smoke_corpus
        and comm.intra_rank == 0
        and not os.path.isfile(os.path.join(args.data, f"test.{args.tgt_lang}"))
    ):
        from recipes.transformer.smoke_corpus import write_smoke_corpus

        write_smoke_corpus(args.data, src_lang=args.src_lang, tgt_lang=args.tgt_lang)
    comm.barrier()

    restored = _restore_state(args, comm)
    tokenizer, key = prepare_tokenizer(args, comm, restored)
    data = load_data(args, comm, tokenizer, key)
    log = RunLog(
        rank=comm.rank,
        path=args.json_log,
        progress="text" if args.no_progress_bar else "auto",
        total=args.max_update or 0,
        initial=int(restored["num_updates"]) if restored else 0,
        unit="upd",
        out=sys.stdout,  # text lines on stdout, as fairseq prints its log
    )
    try:
        try:
            trainer = Trainer(args, comm, device, data, tokenizer, key, log)
        except ValueError as exc:  # batching options that do not fit the data
            build_parser().error(str(exc))
        if restored is not None:
            trainer.load_state_dict(restored)
            log.event("resume", echo=True, update=trainer.num_updates, epoch=trainer.iterator.epoch)
        del restored
        it = trainer.iterator
        log.event(
            "config",
            echo=True,
            preset=args.preset,
            arch=args.arch,
            parameters=count_parameters(trainer.model),
            ranks=comm.size,
            communicator=comm.name,
            device=str(device),
            threads=threads,
            vocab=tokenizer.vocab_size,
            train_pairs=len(data["train"]),
            skipped_pairs=it.skipped,
            updates_per_epoch=it.updates_per_epoch,
            dropped_batches_per_epoch=it.dropped_batches,
            precision=args.precision,
            compression=args.compression,
            allreduce_grad_dtype=args.allreduce_grad_dtype,
            double_buffering=args.double_buffering,
            **local_steps_options(args),
            overlap=not args.no_overlap,
            max_tokens=args.max_tokens,
            batch_size=args.batch_size,
            update_freq=args.update_freq,
            seed=args.seed,
        )
        trainer.train()
        trainer.final_bleu = trainer.final_evaluation()
    finally:
        log.close()
    return trainer


def main(argv: list[str] | None = None) -> int:
    run(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
