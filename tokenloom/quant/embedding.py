"""A token embedding whose table stays quantized: the lookup decodes only the gathered rows.

The table is a kept quantized layer (quant/linear.py Int8Linear / Int4Linear, quant/kquant.py
KQuantLinear) whose output channels are the vocabulary: with tied embeddings it is the LM head itself, so
the table is in memory once (Gemma 3 270M: a 262144 x 640 Q8_0 table is 178 MB as blocks, 335 MB as
bfloat16). A lookup of T tokens decodes T rows, (T, hidden), in the model dtype; models that scale their
embeddings (Gemma) do it on the output, as with a dense table.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from tokenloom.errors import ConfigError


class RowDecodable(Protocol):
    in_features: int
    out_features: int

    def dequantize_rows(self, rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor: ...


class QuantEmbedding(nn.Module):
    def __init__(self, table: nn.Module, dtype: torch.dtype = torch.bfloat16) -> None:
        """`table`: a quantized layer of (vocab, hidden) weight with `dequantize_rows`, shared (not copied)."""
        super().__init__()
        if not hasattr(table, "dequantize_rows"):
            raise ConfigError(f"{type(table).__name__} cannot decode single rows")
        self.table = table
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features
        self.dtype = dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(...) token ids -> (..., hidden) rows of the dequantized table."""
        rows = self.table.dequantize_rows(input_ids.reshape(-1), self.dtype)
        return rows.reshape(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, quantized as {type(self.table).__name__}"
