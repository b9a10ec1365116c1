"""VoxCPM1 family (VoxCPM-0.5B, VoxCPM1.5): residual LM input and DiT condition are sums."""

from __future__ import annotations

import torch

from engine.models.voxcpm import VoxCPMBackbone


class VoxCPM1(VoxCPMBackbone):
    condition_tokens = 1

    def residual_input(self, lm_out: torch.Tensor, audio_embed: torch.Tensor) -> torch.Tensor:
        return lm_out + audio_embed

    def dit_condition(self, lm_hidden: torch.Tensor, residual_hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_to_dit_proj(lm_hidden) + self.res_to_dit_proj(residual_hidden)
