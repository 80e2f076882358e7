"""The Transformer recipe in one process: corpus, batching, model, decoding, options, resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip(
    "sentencepiece", reason="the Transformer recipe needs sentencepiece (commopt[recipes])"
)
pytest.importorskip("sacrebleu", reason="the Transformer recipe needs sacrebleu (commopt[recipes])")

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from recipes.transformer import checkpoint as ckpt  # noqa: E402
from recipes.transformer.data import (  # noqa: E402
    ShardedBatchIterator,
    TokenizedSplit,
    batches_by_size,
    collate,
    load_split,
)
from recipes.transformer.evaluate import beam_search, corpus_bleu  # noqa: E402
from recipes.transformer.model import Transformer, architecture, label_smoothed_nll_loss  # noqa: E402
from recipes.transformer.options import parse_args  # noqa: E402
from recipes.transformer.schedule import inverse_sqrt_lr  # noqa: E402
from recipes.transformer.smoke_corpus import generate_corpus_lines, write_smoke_corpus  # noqa: E402
from recipes.transformer.tokenizer import EOS, PAD, PretokenizedTokenizer, SentencePieceTokenizer  # noqa: E402


@pytest.fixture(scope="module")
def smoke_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("smoke")
    write_smoke_corpus(str(d), sizes={"train": 1500, "valid": 40, "test": 40})
    return d


@pytest.fixture(scope="module")
def tokenizer(smoke_dir):
    return SentencePieceTokenizer.train(
        [str(smoke_dir / "train.src"), str(smoke_dir / "train.tgt")], 300, model_type="bpe"
    )


# -- corpus ---------------------------------------------------------------------------------------
def test_smoke_corpus_follows_its_rules():
    # The documented rule, checked on every pair of a sample: articles, adverb first,
    # verb last with past "-ta" and plural-subject "-s", one object noun with case "-k".
    from recipes.transformer.smoke_corpus import ADVERBS, NOUNS, VERBS

    assert generate_corpus_lines(7, 50) == generate_corpus_lines(7, 50)
    assert generate_corpus_lines(7, 50) != generate_corpus_lines(8, 50)
    adverbs = dict(ADVERBS)
    plural_nouns = {pl for _, pl, _ in NOUNS}
    verbs = {form: (root, form == past) for sg, pl, past, root in VERBS for form in (sg, pl, past)}
    roots = {root for _, _, root in NOUNS}
    for src, tgt in generate_corpus_lines(5, 300):
        s, t = src.split(), tgt.split()
        assert s.count("the") == t.count("el") and s.count("some") == t.count("ke")
        if s[-1] in adverbs:
            assert t[0] == adverbs[s[-1]]
        verb = next(w for w in s if w in verbs)
        root, past = verbs[verb]
        subject_plural = s[s.index(verb) - 1] in plural_nouns
        assert t[-1] == root + ("ta" if past else "") + ("s" if subject_plural else ""), (src, tgt)
        objects = [w for w in t if w.endswith("k") and (w[:-1] in roots or w[:-3] in roots)]
        assert len(objects) == 1, (src, tgt)


def test_smoke_corpus_files_are_line_aligned(smoke_dir):
    for split, n in (("train", 1500), ("valid", 40), ("test", 40)):
        src = (smoke_dir / f"{split}.src").read_text().splitlines()
        tgt = (smoke_dir / f"{split}.tgt").read_text().splitlines()
        assert len(src) == len(tgt) == n
    assert (smoke_dir / "valid.src").read_text() != (smoke_dir / "test.src").read_text()


# -- tokenizers -------------------------------------------------------------------------------------
def test_sentencepiece_round_trip_and_special_ids(tokenizer, smoke_dir):
    line = (smoke_dir / "train.tgt").read_text().splitlines()[3]
    ids = tokenizer.encode(line)
    assert all(i > 3 for i in ids)  # bos/pad/eos/unk are 0..3 as in fairseq
    assert tokenizer.decode(ids + [EOS, PAD]) == line
    assert tokenizer.vocab_size == 300


def test_pretokenized_bpe_vocab(tmp_path):
    vocab = tmp_path / "vocab.bpe"
    vocab.write_text("hel@@ 10\nlo 8\nwor@@ 3\nld 3\n")
    tok = PretokenizedTokenizer.load(str(vocab))
    ids = tok.encode("hel@@ lo wor@@ ld zzz")
    assert ids[-1] == 3  # unknown piece -> unk
    assert tok.decode(ids[:-1]) == "hello world"


# -- batching ------------------------------------------------------------------------------------
def test_batches_respect_max_tokens_and_cover_everything_once():
    g = torch.Generator().manual_seed(0)
    src = torch.randint(2, 40, (500,), generator=g)
    tgt = torch.randint(2, 40, (500,), generator=g)
    batches = batches_by_size(src, tgt, max_tokens=200)
    seen = torch.cat(batches).sort().values
    assert torch.equal(seen, torch.arange(500))
    for b in batches:
        assert len(b) * int(torch.maximum(src[b], tgt[b]).max()) <= 200
    fixed = batches_by_size(src, tgt, max_sentences=16)
    assert all(len(b) <= 16 for b in fixed) and sum(len(b) for b in fixed) == 500


def _split_from_lengths(lengths):
    flat = torch.full((int(sum(lengths)),), 5, dtype=torch.int32)
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor(lengths), 0)
    return TokenizedSplit(
        flat, offsets, flat.clone(), offsets.clone(), ["x"] * len(lengths), ["x"] * len(lengths)
    )


def test_ranks_get_disjoint_batches_and_resume_mid_epoch():
    split = _split_from_lengths([3 + (i * 7) % 20 for i in range(300)])
    kw = dict(
        world_size=2, update_freq=2, seed=3, max_tokens=60, max_sentences=None, max_positions=100
    )
    r0, r1 = ShardedBatchIterator(split, rank=0, **kw), ShardedBatchIterator(split, rank=1, **kw)
    u0, u1 = list(r0.updates()), list(r1.updates())
    assert len(u0) == len(u1) == r0.updates_per_epoch > 0
    got = [int(i) for upd in u0 + u1 for b in upd for i in b]
    assert len(got) == len(set(got))  # no pair twice in one epoch
    assert all(len(upd) == 2 for upd in u0)  # update-freq batches per update
    # resume from the middle of the epoch: same remaining updates
    again = ShardedBatchIterator(split, rank=0, **kw)
    again.load_state_dict({"epoch": 1, "updates_in_epoch": 3})
    rest = list(again.updates())
    assert [[b.tolist() for b in u] for u in rest] == [[b.tolist() for b in u] for u in u0[3:]]
    r0.next_epoch()
    assert [b.tolist() for b in next(r0.updates())] != [b.tolist() for b in u0[0]]


def test_collate_shifts_target_behind_eos(smoke_dir, tokenizer):
    split = load_split(
        str(smoke_dir), "valid", "src", "tgt", tokenizer, tokenizer_key="t", use_cache=False
    )
    batch = collate(split, [0, 1, 2])
    assert batch["src_tokens"].shape[0] == 3
    t = batch["target"][0]
    n = int(t.ne(PAD).sum())
    assert t[n - 1] == EOS
    assert batch["prev_output_tokens"][0, 0] == EOS
    assert torch.equal(batch["prev_output_tokens"][0, 1:n], t[: n - 1])
    assert batch["ntokens"] == int(batch["target"].ne(PAD).sum())


# -- model ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("normalize_before", [False, True])
def test_decoder_is_causal_and_source_padding_is_ignored(normalize_before):
    torch.manual_seed(0)
    model = Transformer(
        architecture("transformer_tiny", normalize_before=normalize_before), 50
    ).eval()
    src = torch.tensor([[7, 8, 9, EOS]])
    prev = torch.tensor([[EOS, 11, 12, 13]])
    out = model(src, prev)
    changed = prev.clone()
    changed[0, 3] = 30
    assert torch.allclose(model(src, changed)[0, :3], out[0, :3], atol=1e-6)
    assert not torch.allclose(model(src, changed)[0, 3], out[0, 3])
    padded = torch.tensor([[7, 8, 9, EOS, PAD, PAD]])
    assert torch.allclose(model(padded, prev), out, atol=1e-5)
    assert hasattr(model.encoder_norm, "weight") == normalize_before


def test_incremental_decoding_matches_full_forward():
    torch.manual_seed(1)
    model = Transformer(architecture("transformer_tiny"), 50).eval()
    src = torch.tensor([[7, 8, 9, EOS], [10, 11, EOS, PAD]])
    prev = torch.tensor([[EOS, 11, 12, 13, 14], [EOS, 15, 16, 17, 18]])
    full = model(src, prev)
    enc, mask = model.encode(src)
    cache: dict = {}
    steps = [
        model.decode(prev[:, t : t + 1], enc, mask, cache=cache, start=t)[:, -1]
        for t in range(prev.size(1))
    ]
    assert torch.allclose(torch.stack(steps, 1), full, atol=1e-5)


def test_architectures_match_fairseq_sizes():
    with torch.device("meta"):  # sizes only: no memory, no initialisation time
        big = Transformer(architecture("transformer_vaswani_wmt_en_de_big"), 32768)
    # Ott et al.'s big model with a 32k joint vocabulary: about 210M parameters (published order)
    n = sum(p.numel() for p in big.parameters())
    assert 200e6 < n < 225e6, n
    assert big.cfg.dropout == 0.3 and big.cfg.heads == 16 and big.cfg.ffn_dim == 4096
    assert architecture("transformer_wmt_en_de").embed_dim == 512
    assert big.embed.weight is big.embed.weight  # one matrix: encoder, decoder and output
    with pytest.raises(ValueError, match="unknown architecture"):
        architecture("transformer_huge")


def test_label_smoothed_loss_formula():
    torch.manual_seed(2)
    logits = torch.randn(2, 3, 11)
    target = torch.tensor([[4, 5, PAD], [6, 7, 8]])
    loss0, nll0 = label_smoothed_nll_loss(logits, target, 0.0)
    ref = torch.nn.functional.cross_entropy(
        logits.view(-1, 11), target.view(-1), ignore_index=PAD, reduction="sum"
    )
    assert torch.allclose(loss0, ref) and torch.allclose(nll0, ref)
    eps = 0.1
    loss, nll = label_smoothed_nll_loss(logits, target, eps)
    lp = torch.log_softmax(logits, -1)
    keep = target.ne(PAD)
    q = torch.full_like(lp, eps / 10)  # true class 1 - eps, the 10 others share eps
    q.scatter_(-1, target.unsqueeze(-1), 1 - eps)
    manual = -(q * lp).sum(-1)[keep].sum()
    assert torch.allclose(loss, manual, atol=1e-5) and torch.allclose(nll, nll0)


def test_inverse_sqrt_schedule():
    kw = dict(lr=5e-4, warmup_updates=4000, warmup_init_lr=1e-7)
    assert inverse_sqrt_lr(0, **kw) == 1e-7
    assert inverse_sqrt_lr(2000, **kw) == pytest.approx((1e-7 + 5e-4) / 2)
    assert inverse_sqrt_lr(4000, **kw) == pytest.approx(5e-4)
    assert inverse_sqrt_lr(64000, **kw) == pytest.approx(5e-4 / 4)


# -- decoding and scoring ---------------------------------------------------------------------------
def test_beam_of_one_is_greedy_decoding():
    torch.manual_seed(3)
    model = Transformer(architecture("transformer_tiny"), 30).eval()
    src = torch.tensor([[5, 6, 7, EOS], [8, 9, EOS, PAD]])
    hyps = beam_search(model, src, beam=1, max_len_a=0, max_len_b=6)
    for row, hyp in zip(src, hyps):
        prev = [EOS]
        while len(prev) < 7:
            logits = model(row[row.ne(PAD)].unsqueeze(0), torch.tensor([prev]))[0, -1]
            logits[PAD] = logits[0] = float("-inf")
            if len(prev) == 6:
                break
            nxt = int(logits.argmax())
            if nxt == EOS:
                break
            prev.append(nxt)
        assert hyp == prev[1:]
    wide = beam_search(model, src, beam=4, max_len_a=0, max_len_b=6)
    assert all(len(h) <= 5 and EOS not in h for h in wide)


def test_bleu_of_exact_and_wrong_output():
    refs = ["the cat sat on the mat", "a dog ran in the park"]
    assert corpus_bleu(refs, refs) == pytest.approx(100.0)
    assert corpus_bleu(["x y z", "q r s"], refs) < 5


def test_checkpoint_averaging_streams_files(tmp_path):
    paths = []
    for i, value in enumerate((1.0, 2.0, 6.0)):
        p = str(tmp_path / f"checkpoint_1_{i + 1}.pt")
        torch.save(
            {"model": {"w": torch.full((2,), value), "n": torch.tensor(i)}, "optimizer": {}}, p
        )
        paths.append(p)
    assert ckpt.numbered_checkpoints(str(tmp_path)) == paths
    avg = ckpt.average_checkpoints(paths)
    assert avg["model"]["w"].tolist() == [3.0, 3.0]
    assert int(avg["model"]["n"]) == 2 and "optimizer" not in avg


# -- command line ----------------------------------------------------------------------------------
def _error_of(argv, capsys, world_size=None):
    with pytest.raises(SystemExit) as exc:
        parse_args(argv, world_size=world_size)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_bad_arguments_get_clear_messages(capsys, tmp_path):
    err = _error_of(["--preset", "smoke", "--data", str(tmp_path / "nope")], capsys)
    assert "does not exist" in err and "smoke_corpus" in err
    err = _error_of(["--preset", "wmt14-xx"], capsys)
    assert "unknown preset 'wmt14-xx'" in err and "smoke" in err
    err = _error_of(["--preset", "wmt16-en-de"], capsys)
    assert "needs --data" in err
    err = _error_of(
        ["--preset", "smoke", "--batch-size", "30", "--update-freq", "4"], capsys, world_size=2
    )
    assert "not divisible by 2 ranks x --update-freq 4" in err and "multiple of 8" in err
    err = _error_of(["--preset", "smoke", "--max-tokens", "0"], capsys)
    assert "--max-tokens must be a positive" in err
    err = _error_of(["--preset", "smoke", "--max-tokens", "100", "--batch-size", "8"], capsys)
    assert "not both" in err
    err = _error_of(["--preset", "smoke", "--adam-betas", "0.9"], capsys)
    assert "--adam-betas" in err


def test_max_tokens_below_the_longest_pair_is_rejected():
    split = _split_from_lengths([5, 9, 40])
    with pytest.raises(ValueError, match="raise --max-tokens to at least 40"):
        ShardedBatchIterator(
            split,
            rank=0,
            world_size=1,
            update_freq=1,
            seed=1,
            max_tokens=30,
            max_sentences=None,
            max_positions=100,
        )


def _train_args(extra, data, save_dir):
    return [
        "--preset",
        "smoke",
        "--data",
        str(data),
        "--save-dir",
        str(save_dir),
        "--max-tokens",
        "300",
        "--no-progress-bar",
        "--final-eval",
        "none",
        "--log-interval",
        "1",
        "--threads",
        "1",
        "--vocab-size",
        "300",
        *extra,
    ]


@pytest.fixture
def in_process_training():
    """Run train.run() in this process, restoring the global torch state it changes."""
    from recipes.transformer import train

    threads, rng = torch.get_num_threads(), torch.get_rng_state()
    yield train.run
    torch.set_num_threads(threads)
    torch.set_rng_state(rng)


def test_unknown_compression_is_rejected(tmp_path, smoke_dir, in_process_training, capsys):
    with pytest.raises(SystemExit) as exc:
        in_process_training(
            _train_args(["--compression", "qsgd77", "--max-update", "1"], smoke_dir, tmp_path)
        )
    assert exc.value.code == 2
    assert "qsgd77" in capsys.readouterr().err


# -- exact resume across processes --------------------------------------------------------------------
def _train_losses(save_dir):
    records = [json.loads(line) for line in open(os.path.join(save_dir, "log.jsonl"))]
    return [(r["update"], r["loss"]) for r in records if r["event"] == "train"]


def test_resume_is_exact_on_cpu(tmp_path, smoke_dir, in_process_training):
    """3+3 updates in one run equal 3 updates, then a new process resuming for 3 more."""
    common = [
        "--dropout",
        "0.1",
        "--save-interval-updates",
        "0",
        "--validate-interval-updates",
        "0",
    ]
    a, b = tmp_path / "straight", tmp_path / "resumed"
    in_process_training(_train_args(common + ["--max-update", "6"], smoke_dir, a))
    in_process_training(_train_args(common + ["--max-update", "3"], smoke_dir, b))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "recipes.transformer.train",
            *_train_args(common + ["--max-update", "6"], smoke_dir, b),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    sa, sb = ckpt.load_checkpoint(str(a / ckpt.LAST)), ckpt.load_checkpoint(str(b / ckpt.LAST))
    assert sa["num_updates"] == sb["num_updates"] == 6
    for k, v in sa["model"].items():
        assert torch.equal(v, sb["model"][k]), k
    assert _train_losses(a) == _train_losses(b)
    assert any(json.loads(line)["event"] == "resume" for line in open(b / "log.jsonl"))


# -- local steps ----------------------------------------------------------------------------------------
def test_local_steps_options_reach_the_optimizer(tmp_path, smoke_dir, in_process_training):
    from commopt.optim.schedules.local_steps import LocalStepsSchedule

    flags = ["--sync-every", "4", "--fragments", "2", "--overlap-steps", "1", "--outer-lr", "0.5"]
    trainer = in_process_training(
        _train_args(flags + ["--max-update", "2", "--no-save"], smoke_dir, tmp_path)
    )
    schedule = trainer.optimizer.schedule
    assert isinstance(schedule, LocalStepsSchedule)
    assert (schedule.sync_every, schedule.num_fragments, schedule.overlap_steps) == (4, 2, 1)
    assert {f.outer.param_groups[0]["lr"] for f in schedule.fragments} == {0.5}
    assert schedule.position == 2
    config = next(
        json.loads(line)
        for line in open(tmp_path / "log.jsonl")
        if json.loads(line)["event"] == "config"
    )
    assert config["schedule"] == "local_steps" and config["sync_every"] == 4


def test_local_steps_options_are_checked(capsys, smoke_dir):
    err = _error_of(["--preset", "smoke", "--data", str(smoke_dir), "--fragments", "2"], capsys)
    assert "--fragments is an option of local steps: give --sync-every N" in err
    err = _error_of(["--preset", "smoke", "--data", str(smoke_dir), "--sync-every", "0"], capsys)
    assert "--sync-every must be >= 1" in err
    err = _error_of(
        ["--preset", "smoke", "--data", str(smoke_dir), "--sync-every", "4", "--double-buffering"],
        capsys,
    )
    assert "not both" in err
