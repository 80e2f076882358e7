"""A small causal Transformer over characters (pre-norm, learned positions, tied embedding).

>>> import torch
>>> from recipes.text_lm.model import CharTransformer
>>> m = CharTransformer(vocab_size=98, d_model=32, layers=1, heads=2, context=16)
>>> m(torch.zeros(2, 16, dtype=torch.long)).shape
torch.Size([2, 16, 98])
"""

from __future__ import annotations

import torch
from torch import nn


class CharTransformer(nn.Module):
    def __init__(
        self, vocab_size: int, d_model: int = 64, layers: int = 2, heads: int = 4, context: int = 64
    ):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model)
        nn.init.normal_(self.embed.weight, std=0.02)  # tied output: keep the first logits small
        self.pos = nn.Parameter(torch.zeros(context, d_model))
        nn.init.normal_(self.pos, std=0.02)
        layer = nn.TransformerEncoderLayer(
            d_model, heads, 4 * d_model, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        mask = torch.triu(torch.full((context, context), float("-inf")), diagonal=1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        n = ids.shape[1]
        h = self.embed(ids) + self.pos[:n]
        h = self.blocks(h, mask=self.mask[:n, :n], is_causal=True)
        return self.norm(h) @ self.embed.weight.T
