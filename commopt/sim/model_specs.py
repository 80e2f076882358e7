"""How the built-in profiles in ``commopt/sim/profiles/`` are made (run this module to rebuild).

Layer sizes come from the architectures (torchvision's resnet50 for ResNet-50; the published
hyper-parameters for the Transformers, counted here layer by layer). Backward weights are
multiply-accumulates of the forward pass (the backward pass costs about twice the forward one,
layer by layer); memory-bound layers (normalisation) count ``NORM_MACS_PER_ELEMENT`` per
output element. Single-GPU throughputs are the published ones (each profile cites its source); where none
is published the profile says how its figure was derived.

    $ python -m commopt.sim.model_specs          # rewrites commopt/sim/profiles/*.json
"""

from __future__ import annotations

import os

from commopt.sim.model_profiles import PROFILE_DIR, Layer, ModelProfile

NORM_MACS_PER_ELEMENT = 100  # assumption: a normalisation element costs as much time as ~100 MACs
FORWARD_FRACTION = 1 / 3  # backward about 2/3 of the step

CGX_THROUGHPUT = "published single-GPU throughput (CGX)"
#: ResNet-50 training in FP32 on one V100 16 GB: NVIDIA DeepLearningExamples, PyTorch ResNet-50 v1.5
#: README (DGX-1, pytorch-21.03): 367 img/s FP32 (1200 mixed precision).
V100_FP32_RESNET50 = 367
#: P100 has no tensor cores: its FP32 rate scaled from the V100's by single-precision peaks
#: (P100 PCIe 9.3 TFLOP/s, V100 SXM2 15.7 TFLOP/s; datasheets).
P100_FP32_RESNET50 = round(V100_FP32_RESNET50 * 9.3 / 15.7)
P100_SOURCE = (
    f"derived, {P100_FP32_RESNET50} img/s FP32: the V100's published FP32 rate "
    f"({V100_FP32_RESNET50} img/s, NVIDIA DeepLearningExamples ResNet-50 v1.5 README) x 9.3/15.7, "
    "the ratio of their FP32 peaks (datasheets)"
)


def resnet50_profile() -> ModelProfile:
    """ResNet-50 from torchvision's parameters; MACs from a 224x224 forward pass."""
    import torch

    from commopt.sim.resnet import resnet50

    model = resnet50().eval()
    macs: dict[str, float] = {}

    def hook(name):
        def record(module, inputs, output):
            if isinstance(module, torch.nn.Conv2d):
                k = (
                    module.in_channels
                    // module.groups
                    * module.kernel_size[0]
                    * module.kernel_size[1]
                )
                macs[name] = output.numel() * k
            elif isinstance(module, torch.nn.Linear):
                macs[name] = output.numel() * module.in_features
            else:
                macs[name] = output.numel() * NORM_MACS_PER_ELEMENT

        return record

    owners = [(n, m) for n, m in model.named_modules() if list(m.parameters(recurse=False))]
    handles = [m.register_forward_hook(hook(n)) for n, m in owners]
    with torch.no_grad():
        model(torch.zeros(1, 3, 224, 224))
    for h in handles:
        h.remove()
    layers = tuple(
        Layer(n, sum(p.numel() for p in m.parameters(recurse=False)), float(macs[n]))
        for n, m in owners
    )
    return ModelProfile(
        name="resnet50",
        description="ResNet-50 (torchvision), ImageNet 224x224, 64 images per GPU",
        sample_unit="images",
        batch_per_gpu=64,
        grad_bytes_per_param=4,
        forward_fraction=FORWARD_FRACTION,
        throughput={
            "v100": 1226,
            "a100": 2470,
            "rtx3090": 850,
            "rtx2080ti": 484,
            "p100": P100_FP32_RESNET50,
        },
        layers=layers,
        sources={
            "layers": "torchvision.models.resnet50 parameters; backward weights = forward MACs at 224x224",
            "batch_per_gpu": "64 per GPU (published ChainerMN ImageNet settings)",
            "throughput": CGX_THROUGHPUT
            + " for v100/a100/rtx3090/rtx2080ti (mixed precision); p100: "
            + P100_SOURCE,
            "grad_bytes_per_param": "float32 gradients",
        },
    )


def _decoder_layers_txl(n_layer, d, d_inner, tgt, klen):
    per = []
    for i in range(n_layer):
        numel = (
            (d * 3 * d)
            + (d * d)
            + 2 * d
            + (d * d)
            + (d * d_inner + d_inner)
            + (d_inner * d + d)
            + 2 * d
        )
        macs = (
            klen * d * 3 * d
            + klen * d * d
            + 3 * tgt * klen * d
            + tgt * d * d
            + 2 * tgt * d * d_inner
        )
        per.append(Layer(f"layers.{i}", numel, float(macs)))
    return per


def transformer_xl_base_profile() -> ModelProfile:
    """Transformer-XL base as in NVIDIA's DeepLearningExamples (whose DGX-1 rows match the
    published V100 row): 16 layers, d_model 512, d_inner 2048, 8 heads x 64, tgt_len = mem_len
    = 192, WikiText-103 vocabulary 267735 with adaptive softmax (cutoffs 19997, 39997, 199997,
    div_val 1) tied to the embedding, 32 segments per GPU, apex AMP O2 (float16 gradients)."""
    d, d_inner, n_layer, tgt, mem, vocab = 512, 2048, 16, 192, 192, 267735
    klen = tgt + mem
    head = 19997 + 3
    # Tokens in the three tail clusters (assumption: 6%, 3%, 1% of WikiText-103 tokens).
    tail_macs = tgt * d * (0.06 * 20000 + 0.03 * 160000 + 0.01 * (vocab - 199997))
    layers = [
        # The tied embedding/softmax weight is last ready: its gradient is complete only after
        # the embedding lookup's backward, at the very end of the backward pass.
        Layer(
            "word_emb (tied with the softmax weight) + r_w_bias, r_r_bias",
            vocab * d + 2 * d,
            float(tgt * d),
        ),
        *_decoder_layers_txl(n_layer, d, d_inner, tgt, klen),
        Layer(
            "crit (adaptive softmax: bias, cluster weight and bias)",
            vocab + 3 * d + 3,
            float(tgt * d * head + tail_macs),
        ),
    ]
    return ModelProfile(
        name="transformer-xl-base",
        description="Transformer-XL base, WikiText-103, 32 x 192 tokens per GPU, fp16 gradients",
        sample_unit="tokens",
        batch_per_gpu=32 * 192,
        grad_bytes_per_param=2,
        forward_fraction=FORWARD_FRACTION,
        throughput={"v100": 37000, "rtx3090": 38000, "a100": 60000, "rtx2080ti": 13000},
        layers=tuple(layers),
        sources={
            "architecture": "NVIDIA DeepLearningExamples PyTorch Transformer-XL README (base model, "
            "pytorch/run_wt103_base.sh); its DGX-1 V100 batch-32 rows 36692 / 65889 / "
            "133838 / 258648 tok/s match the published 37k / 63k / 131k / 259k",
            "batch_per_gpu": "32 segments x tgt_len 192 = 6144 tokens per GPU (same README)",
            "grad_bytes_per_param": "apex AMP O2: float16 model and gradients (same README)",
            "throughput": CGX_THROUGHPUT + " (the 1-GPU column of the scaling table for rtx3090)",
            "tail clusters": "assumption: 6% / 3% / 1% of tokens fall in the three tail clusters",
            "tied embedding": "NVIDIA's mem_transformer.py / train.py: div_val 1 (one 267735 x 512 matrix), "
            "tie_weight on (the softmax uses the embedding's own Parameter), dense "
            "(sparse only with sample_softmax > 0, default -1); tie_projs has no effect "
            "(d_embed = d_model: no projections). Its gradient sums both uses before "
            "DDP's hook fires, i.e. after the embedding's backward",
        },
    )


def _bert_layers(n_layer, d, d_ff, seq):
    out = []
    for i in range(n_layer):
        numel = 4 * (d * d + d) + 2 * d + (d * d_ff + d_ff) + (d_ff * d + d) + 2 * d
        macs = (
            seq * 4 * d * d
            + 2 * seq * seq * d
            + 2 * seq * d * d_ff
            + 2 * seq * d * NORM_MACS_PER_ELEMENT
        )
        out.append(Layer(f"encoder.layer.{i}", numel, float(macs)))
    return out


def _bert(name, n_layer, d, d_ff, seq, per_gpu_seqs, throughput, sources, description):
    vocab = 30522
    layers = [
        Layer(
            "embeddings (word, position, token type, LayerNorm)",
            vocab * d + 512 * d + 2 * d + 2 * d,
            float(seq * d * NORM_MACS_PER_ELEMENT),
        ),
        *_bert_layers(n_layer, d, d_ff, seq),
        Layer("qa_outputs", 2 * d + 2, float(seq * 2 * d)),
    ]
    return ModelProfile(
        name=name,
        description=description,
        sample_unit="tokens",
        batch_per_gpu=per_gpu_seqs * seq,
        grad_bytes_per_param=4,
        forward_fraction=FORWARD_FRACTION,
        throughput=throughput,
        layers=tuple(layers),
        sources=sources,
    )


_BERT_UNIT = (
    "the published BERT figures are labelled samples/s without batch or sequence length; "
    "3830/s on one V100 is only physically possible as tokens/s of BERT-large at sequence "
    "length 384 (about 10 sequences/s, 7.4 TFLOP/s), so we read them as tokens/s"
)


def bert_large_profile() -> ModelProfile:
    return _bert(
        "bert-large",
        24,
        1024,
        4096,
        384,
        4,
        {"v100": 3830, "rtx3090": 5820},
        {
            "architecture": "BERT-large: 24 layers, hidden 1024, FFN 4096, vocabulary 30522, SQuAD head "
            "(published F1 93.12 is a SQuAD v1.1 score)",
            "throughput": CGX_THROUGHPUT + "; " + _BERT_UNIT,
            "batch_per_gpu": "assumption: 4 sequences x 384 tokens per GPU (FP32/TF32 fine-tuning on 16-24 GB)",
            "grad_bytes_per_param": "float32 gradients (FP32/TF32 training, consistent with the throughput)",
        },
        "BERT-large SQuAD fine-tuning, 4 x 384 tokens per GPU, fp32 gradients",
    )


def bert_base_profile() -> ModelProfile:
    large = bert_large_profile()
    base_layers = _bert_layers(12, 768, 3072, 384)
    large_layers = _bert_layers(24, 1024, 4096, 384)
    ratio = sum(x.backward_weight for x in large_layers) / sum(
        x.backward_weight for x in base_layers
    )
    return _bert(
        "bert-base",
        12,
        768,
        3072,
        384,
        4,
        {gpu: round(v * ratio) for gpu, v in large.throughput.items()},
        {
            "architecture": "BERT-base: 12 layers, hidden 768, FFN 3072, vocabulary 30522, SQuAD head",
            "throughput": f"derived: bert-large's figures x {ratio:.2f} (its MACs per token / BERT-base's); "
            "no published BERT-base throughput in the reference",
            "batch_per_gpu": "assumption: 4 sequences x 384 tokens per GPU",
        },
        "BERT-base SQuAD fine-tuning, 4 x 384 tokens per GPU, fp32 gradients",
    )


def transformer_big_profile() -> ModelProfile:
    """fairseq Transformer big for WMT'16 En-De: 6+6 layers, 1024, FFN 4096, shared embeddings."""
    d, ff, vocab, src_len = 1024, 4096, 32768, 30
    attn = 4 * (d * d + d)
    ffn = (d * ff + ff) + (ff * d + d)
    enc = [
        Layer(f"encoder.layers.{i}", attn + ffn + 4 * d, float(attn + ffn + 2 * src_len * d))
        for i in range(6)
    ]
    dec = [
        Layer(
            f"decoder.layers.{i}", 2 * attn + ffn + 6 * d, float(2 * attn + ffn + 4 * src_len * d)
        )
        for i in range(6)
    ]
    layers = [
        Layer(
            "embed_tokens (shared by encoder, decoder and output projection)", vocab * d, float(d)
        ),
        *enc,
        *dec,
        Layer("output projection (tied) + final norms", 4 * d, float(vocab * d)),
    ]
    # MACs per target token (one source token each, on average) against TXL's per token.
    txl = transformer_xl_base_profile()
    txl_per_token = sum(x.backward_weight for x in txl.layers) / 192
    big_per_token = sum(x.backward_weight for x in layers)
    v100 = round(37000 * txl_per_token / big_per_token)
    return ModelProfile(
        name="transformer-big",
        description="fairseq Transformer big, WMT'16 En-De, 3584 tokens per GPU, fp16 gradients",
        sample_unit="tokens",
        batch_per_gpu=3584,
        grad_bytes_per_param=2,
        forward_fraction=FORWARD_FRACTION,
        throughput={"v100": v100},
        layers=tuple(layers),
        sources={
            "architecture": "published (Ott et al. 2018): 6+6 layers, 1024 model, 4096 FFN, 16 heads, "
            "shared embeddings; vocabulary 32768 joined BPE (assumption)",
            "batch_per_gpu": "max 3584 tokens per GPU (published)",
            "grad_bytes_per_param": "fp16 training (published)",
            "throughput": f"derived: Transformer-XL's published V100 rate x MACs per token ratio "
            f"= {v100} tokens/s (assumption: same hardware efficiency)",
        },
    )


BUILDERS = {
    "resnet50": resnet50_profile,
    "transformer-xl-base": transformer_xl_base_profile,
    "bert-large": bert_large_profile,
    "bert-base": bert_base_profile,
    "transformer-big": transformer_big_profile,
}


def write_builtin_profiles(directory: str = PROFILE_DIR) -> list[str]:
    os.makedirs(directory, exist_ok=True)
    paths = []
    for name, build in BUILDERS.items():
        path = os.path.join(directory, f"{name}.json")
        build().save(path)
        paths.append(path)
    return paths


if __name__ == "__main__":
    for p in write_builtin_profiles():
        print("wrote", p)
