"""VoxCPM2 family: the residual LM input is a learned fusion of the FSQ output and the audio
embedding (`fusion_concat_proj`), and the DiT sees the LM and residual LM as two condition tokens.
Its residual LM has no rotary embedding (`residual_lm_no_rope` in config.json)."""

from __future__ import annotations

import torch
from torch import nn

from engine.config import VoxCPMConfig
from engine.models.voxcpm import VoxCPMBackbone


class VoxCPM2(VoxCPMBackbone):
    condition_tokens = 2

    def __init__(self, cfg: VoxCPMConfig) -> None:
        super().__init__(cfg)
        h = cfg.lm.hidden_size
        self.fusion_concat_proj = nn.Linear(2 * h, h)

    def residual_input(self, lm_out: torch.Tensor, audio_embed: torch.Tensor) -> torch.Tensor:
        return self.fusion_concat_proj(torch.cat((lm_out, audio_embed), dim=-1))

    def dit_condition(self, lm_hidden: torch.Tensor, residual_hidden: torch.Tensor) -> torch.Tensor:
        return torch.cat((self.lm_to_dit_proj(lm_hidden), self.res_to_dit_proj(residual_hidden)), dim=-1)
