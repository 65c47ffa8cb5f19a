"""The built-in ViT: a small Qwen2-VL-shaped vision tower with deterministic seeded weights.

Layout: 14 px patches -> linear patch embedding -> 2x2 patch merge (each token covers 28 px) -> pre-norm
transformer blocks with a 2-D sin-cos position embedding built from the token's (row, col) -> projection to
``out_dim``. The weights are random but fixed by ``seed``, so two processes (or two machines with the same
torch) produce the same embeddings for the same image: tests and the demo can compare across the wire.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from tensorwire.encoder._base import ImageEmbedding, VisionEncoder
from tensorwire.encoder._config import BuiltinViTConfig, PreprocessConfig
from tensorwire.encoder._preprocess import grid_position_ids, prepare


def sincos_2d(position_ids: torch.Tensor, dim: int) -> torch.Tensor:
    """2-D sin-cos embedding [n, dim]: half the channels encode the row, half the column (MAE-style)."""
    quarter = dim // 4
    omega = 1.0 / (10000 ** (torch.arange(quarter, dtype=torch.float32, device=position_ids.device) / quarter))
    parts = []
    for axis in range(2):
        angles = position_ids[:, axis].float()[:, None] * omega[None, :]
        parts += [angles.sin(), angles.cos()]
    return torch.cat(parts, dim=1)


class BuiltinViT(nn.Module):
    def __init__(self, cfg: BuiltinViTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        p = cfg.patch_size
        self.patch_embed = nn.Linear(3 * p * p, cfg.hidden)
        self.merge = nn.Linear(cfg.hidden * cfg.merge_size**2, cfg.hidden)
        layer = nn.TransformerEncoderLayer(
            cfg.hidden,
            cfg.heads,
            cfg.hidden * cfg.mlp_ratio,
            dropout=0.0,
            activation="gelu",
            batch_first=True,
            norm_first=True,
        )
        self.blocks = nn.TransformerEncoder(layer, cfg.depth, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.out_dim)

    def patchify(self, pixels: torch.Tensor) -> torch.Tensor:
        """[3, H, W] -> [rows * cols, merge^2 * 3 * p * p], tokens row-major, each token's patches together."""
        p, m = self.cfg.patch_size, self.cfg.merge_size
        _, h, w = pixels.shape
        rows, cols = h // (p * m), w // (p * m)
        x = pixels.reshape(3, rows, m, p, cols, m, p)
        x = x.permute(1, 4, 2, 5, 0, 3, 6)  # rows, cols, m, m, 3, p, p
        return x.reshape(rows * cols, m * m, 3 * p * p)

    def forward(self, pixels: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        patches = self.patchify(pixels)  # [n, m*m, 3*p*p]
        x = self.patch_embed(patches).flatten(1)  # [n, m*m*hidden]
        x = self.merge(x) + sincos_2d(position_ids, self.cfg.hidden).to(x.dtype)
        x = self.blocks(x.unsqueeze(0)).squeeze(0)
        out: torch.Tensor = self.proj(self.norm(x))
        return out


class BuiltinEncoder(VisionEncoder):
    """``--model builtin``: the ``BuiltinViT`` with seeded weights, float32 on CPU (bfloat16 on CUDA)."""

    def __init__(
        self,
        *,
        device: str = "cpu",
        preprocess: PreprocessConfig | None = None,
        vit: BuiltinViTConfig | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(name="builtin", device=device, preprocess=preprocess or PreprocessConfig())
        self.vit_config = vit or BuiltinViTConfig()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.vit_config.seed)
            model = BuiltinViT(self.vit_config)
            # Default init leaves activations tiny after a few blocks; a larger projection keeps the output varied.
            nn.init.normal_(model.proj.weight, std=1.0 / math.sqrt(self.vit_config.hidden))
        self._dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.model = model.to(device=self.device, dtype=self._dtype).eval()
        self._unit = self.vit_config.patch_size * self.vit_config.merge_size

    @property
    def hidden_size(self) -> int:
        return self.vit_config.out_dim

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    def _encode(self, images: Sequence[bytes]) -> list[ImageEmbedding]:
        prepared = [prepare(data, self.preprocess, self._unit, index=i) for i, data in enumerate(images)]
        out = []
        for prep in prepared:
            pos = grid_position_ids(*prep.grid).to(self.device)
            pixels = prep.pixels.to(device=self.device, dtype=self._dtype)
            emb = self.model(pixels, pos).contiguous()
            out.append(
                ImageEmbedding(embedding=emb, position_ids=pos, grid=prep.grid, original_size=prep.original_size)
            )
        return out
