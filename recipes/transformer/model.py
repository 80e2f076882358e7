"""An encoder-decoder Transformer laid out as fairseq's, in plain torch.

What follows fairseq (so its published hyper-parameters carry over): token embeddings
scaled by sqrt(d) plus fixed sinusoidal positions counted from ``pad + 1``; one
embedding matrix shared by encoder, decoder and output projection (joint vocabulary);
post-norm layers by default and pre-norm with ``normalize_before`` (then a final
LayerNorm closes each stack); dropout after attention/FFN and on embeddings, separate
attention-weight dropout and ReLU dropout; Xavier-uniform linear layers (q/k/v with
gain 1/sqrt(2)) and N(0, d^-1/2) embeddings with a zero pad row.

    >>> import torch
    >>> cfg = ARCHITECTURES["transformer_tiny"]
    >>> model = Transformer(cfg, vocab_size=40)
    >>> src = torch.tensor([[5, 6, 7, 2]]); prev = torch.tensor([[2, 8, 9]])
    >>> model(src, prev).shape
    torch.Size([1, 3, 40])
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from recipes.transformer.tokenizer import PAD


@dataclass(frozen=True)
class TransformerConfig:
    embed_dim: int
    ffn_dim: int
    heads: int
    encoder_layers: int
    decoder_layers: int
    dropout: float
    attention_dropout: float = 0.0
    activation_dropout: float = 0.0
    normalize_before: bool = False
    max_positions: int = 1024
    share_all_embeddings: bool = True


ARCHITECTURES = {
    # a few hundred thousand parameters: learns the smoke corpus on a CPU in minutes
    "transformer_tiny": TransformerConfig(
        embed_dim=64,
        ffn_dim=256,
        heads=4,
        encoder_layers=2,
        decoder_layers=2,
        dropout=0.1,
        max_positions=256,
    ),
    # fairseq's transformer_wmt_en_de (Transformer base)
    "transformer_wmt_en_de": TransformerConfig(
        embed_dim=512, ffn_dim=2048, heads=8, encoder_layers=6, decoder_layers=6, dropout=0.1
    ),
    # fairseq's transformer_vaswani_wmt_en_de_big (Ott et al. 2018: 29.3 BLEU, published)
    "transformer_vaswani_wmt_en_de_big": TransformerConfig(
        embed_dim=1024, ffn_dim=4096, heads=16, encoder_layers=6, decoder_layers=6, dropout=0.3
    ),
}


def architecture(name: str, **overrides) -> TransformerConfig:
    """The named configuration with ``overrides`` (those that are not None) applied."""
    if name not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {name!r}; choose one of {', '.join(ARCHITECTURES)}")
    return replace(ARCHITECTURES[name], **{k: v for k, v in overrides.items() if v is not None})


def sinusoidal_table(num_positions: int, dim: int) -> torch.Tensor:
    """Row p holds sin(p * w_i) for the first half and cos(p * w_i) for the second half,
    with w_i geometric from 1 to 1/10000 (row ``PAD`` is zero)."""
    half = dim // 2
    freq = torch.exp(
        torch.arange(half, dtype=torch.float) * -(math.log(10000.0) / max(half - 1, 1))
    )
    angles = torch.arange(num_positions, dtype=torch.float).unsqueeze(1) * freq.unsqueeze(0)
    table = torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)
    if dim % 2:
        table = torch.cat([table, torch.zeros(num_positions, 1)], dim=1)
    table[PAD] = 0
    return table


class SinusoidalPositions(nn.Module):
    """Positions counted from PAD + 1 over non-pad tokens; pads get a zero vector."""

    def __init__(self, dim: int, max_positions: int):
        super().__init__()
        self.register_buffer(
            "table", sinusoidal_table(max_positions + PAD + 1, dim), persistent=False
        )

    def forward(self, tokens: torch.Tensor, start: int = 0) -> torch.Tensor:
        if start:  # incremental decoding: one new (never padded) position per sentence
            positions = torch.full_like(tokens, PAD + 1 + start)
        else:
            mask = tokens.ne(PAD).long()
            positions = torch.cumsum(mask, dim=1) * mask + PAD
        longest = start + 1 if start else tokens.size(1)  # a bound known without a device sync
        if longest + PAD + 1 > self.table.size(0):
            raise ValueError(
                f"sequence of {longest} tokens is longer than max_positions={self.table.size(0) - PAD - 1}"
            )
        return self.table[positions]


class MultiheadAttention(nn.Module):
    """Scaled dot-product attention with separate q/k/v projections and a key/value cache."""

    def __init__(self, dim: int, heads: int, dropout: float):
        super().__init__()
        if dim % heads:
            raise ValueError(f"embed_dim {dim} is not divisible by heads {heads}")
        self.heads, self.head_dim, self.dropout = heads, dim // heads, dropout
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (
            nn.Linear(dim, dim) for _ in range(4)
        )
        for proj in (self.q_proj, self.k_proj, self.v_proj):
            nn.init.xavier_uniform_(proj.weight, gain=1 / math.sqrt(2))
        nn.init.xavier_uniform_(self.out_proj.weight)
        nn.init.zeros_(self.out_proj.bias)

    def _split(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, D) -> (B, H, T, Dh)
        return x.view(x.size(0), x.size(1), self.heads, self.head_dim).transpose(1, 2)

    def forward(
        self, query, key_value, *, key_padding_mask=None, causal=False, cache=None, static_kv=False
    ):
        """``key_padding_mask``: (B, S) True at pads. ``cache``: a dict kept between
        decoding steps (self-attention appends to it; ``static_kv`` reuses it as is)."""
        q = self._split(self.q_proj(query))
        if cache is not None and static_kv and "k" in cache:
            k, v = cache["k"], cache["v"]
        else:
            k, v = self._split(self.k_proj(key_value)), self._split(self.v_proj(key_value))
            if cache is not None:
                if not static_kv and "k" in cache:
                    k, v = torch.cat([cache["k"], k], dim=2), torch.cat([cache["v"], v], dim=2)
                cache["k"], cache["v"] = k, v
        mask = None
        if key_padding_mask is not None:
            mask = ~key_padding_mask[:, None, None, :]  # True = may attend
        if causal and q.size(2) > 1:
            t, s = q.size(2), k.size(2)
            allowed = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(diagonal=s - t)
            mask = allowed if mask is None else (mask & allowed)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0
        )
        out = out.transpose(1, 2).reshape(query.size(0), query.size(1), -1)
        return self.out_proj(out)


def _linear(i: int, o: int) -> nn.Linear:
    layer = nn.Linear(i, o)
    nn.init.xavier_uniform_(layer.weight)
    nn.init.zeros_(layer.bias)
    return layer


class _Sublayers(nn.Module):
    """Residual blocks with post-norm (x = LN(x + f(x))) or pre-norm (x = x + f(LN(x)))."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.cfg = cfg
        self.ffn_in, self.ffn_out = (
            _linear(cfg.embed_dim, cfg.ffn_dim),
            _linear(cfg.ffn_dim, cfg.embed_dim),
        )
        self.ffn_norm = nn.LayerNorm(cfg.embed_dim)

    def residual(self, x, norm, fn):
        if self.cfg.normalize_before:
            return x + F.dropout(fn(norm(x)), self.cfg.dropout, self.training)
        return norm(x + F.dropout(fn(x), self.cfg.dropout, self.training))

    def ffn(self, x):
        h = F.dropout(F.relu(self.ffn_in(x)), self.cfg.activation_dropout, self.training)
        return self.ffn_out(h)


class EncoderLayer(_Sublayers):
    def __init__(self, cfg: TransformerConfig):
        super().__init__(cfg)
        self.self_attn = MultiheadAttention(cfg.embed_dim, cfg.heads, cfg.attention_dropout)
        self.self_attn_norm = nn.LayerNorm(cfg.embed_dim)

    def forward(self, x, pad_mask):
        x = self.residual(
            x, self.self_attn_norm, lambda h: self.self_attn(h, h, key_padding_mask=pad_mask)
        )
        return self.residual(x, self.ffn_norm, self.ffn)


class DecoderLayer(_Sublayers):
    def __init__(self, cfg: TransformerConfig):
        super().__init__(cfg)
        self.self_attn = MultiheadAttention(cfg.embed_dim, cfg.heads, cfg.attention_dropout)
        self.self_attn_norm = nn.LayerNorm(cfg.embed_dim)
        self.cross_attn = MultiheadAttention(cfg.embed_dim, cfg.heads, cfg.attention_dropout)
        self.cross_attn_norm = nn.LayerNorm(cfg.embed_dim)

    def forward(self, x, enc, enc_pad_mask, cache=None):
        self_cache = cross_cache = None
        if cache is not None:
            self_cache, cross_cache = cache.setdefault("self", {}), cache.setdefault("cross", {})
        x = self.residual(
            x, self.self_attn_norm, lambda h: self.self_attn(h, h, causal=True, cache=self_cache)
        )
        x = self.residual(
            x,
            self.cross_attn_norm,
            lambda h: self.cross_attn(
                h, enc, key_padding_mask=enc_pad_mask, cache=cross_cache, static_kv=True
            ),
        )
        return self.residual(x, self.ffn_norm, self.ffn)


class Transformer(nn.Module):
    """Encoder-decoder with one shared embedding; ``forward`` returns logits (B, T, V)."""

    def __init__(self, cfg: TransformerConfig, vocab_size: int):
        super().__init__()
        if not cfg.share_all_embeddings:
            raise NotImplementedError("only shared (joint-vocabulary) embeddings are implemented")
        self.cfg = cfg
        self.embed = nn.Embedding(vocab_size, cfg.embed_dim, padding_idx=PAD)
        nn.init.normal_(self.embed.weight, mean=0.0, std=cfg.embed_dim**-0.5)
        with torch.no_grad():
            self.embed.weight[PAD].zero_()
        self.embed_scale = math.sqrt(cfg.embed_dim)
        self.positions = SinusoidalPositions(cfg.embed_dim, cfg.max_positions)
        self.encoder_layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.encoder_layers))
        self.decoder_layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.decoder_layers))
        # pre-norm stacks end with a LayerNorm (the residual stream is never normalized otherwise)
        self.encoder_norm = nn.LayerNorm(cfg.embed_dim) if cfg.normalize_before else nn.Identity()
        self.decoder_norm = nn.LayerNorm(cfg.embed_dim) if cfg.normalize_before else nn.Identity()

    def _embed(self, tokens, start: int = 0):
        x = self.embed_scale * self.embed(tokens) + self.positions(tokens, start)
        return F.dropout(x, self.cfg.dropout, self.training)

    def encode(self, src_tokens: torch.Tensor):
        """Returns (encoder states (B, S, D), source pad mask (B, S))."""
        pad_mask = src_tokens.eq(PAD)
        x = self._embed(src_tokens)
        for layer in self.encoder_layers:
            x = layer(x, pad_mask)
        return self.encoder_norm(x), pad_mask

    def decode(self, prev_output_tokens, enc, enc_pad_mask, cache=None, start: int = 0):
        """Logits for every position of ``prev_output_tokens`` (or, with a ``cache``, for
        the one new token at position ``start``)."""
        x = self._embed(prev_output_tokens, start)
        for i, layer in enumerate(self.decoder_layers):
            x = layer(x, enc, enc_pad_mask, None if cache is None else cache.setdefault(i, {}))
        x = self.decoder_norm(x)
        return F.linear(x, self.embed.weight)

    def forward(self, src_tokens, prev_output_tokens):
        enc, pad_mask = self.encode(src_tokens)
        return self.decode(prev_output_tokens, enc, pad_mask)


def label_smoothed_nll_loss(logits: torch.Tensor, target: torch.Tensor, epsilon: float):
    """fairseq's label-smoothed cross-entropy, summed over non-pad tokens.

    loss = (1 - eps - eps/(V-1)) * nll + eps/(V-1) * sum_v(-log p_v), i.e. the true class
    gets 1 - eps and the other V-1 classes share eps. Returns (loss, nll_loss), in fp32.
    """
    lprobs = F.log_softmax(logits.float(), dim=-1)
    keep = target.ne(PAD)
    nll = -lprobs.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    smooth = -lprobs.sum(-1)
    eps_i = epsilon / (lprobs.size(-1) - 1)
    loss = (1.0 - epsilon - eps_i) * nll + eps_i * smooth
    return loss[keep].sum(), nll[keep].sum()


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
