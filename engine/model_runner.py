"""Runs scheduled batches through the model: builds the attention metadata, owns the KV caches,
draws each sequence's noise, applies the stop rule and decodes each new patch to audio.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from engine.attention import AttentionMetadata, PagedKVCache
from engine.block_manager import BlockManager
from engine.checkpoint import LoadedModel
from engine.sequence import Sequence

log = logging.getLogger(__name__)


@dataclass
class PatchResult:
    seq: Sequence
    patch: torch.Tensor  # (P, D) float32, on CPU
    audio: np.ndarray  # float32 samples at the output sample rate
    finished: bool
    finish_reason: str | None = None


class ModelRunner:
    def __init__(self, model: LoadedModel, num_blocks: int, block_size: int, inference_timesteps: int,
                 device: torch.device) -> None:
        self.model = model
        self.cfg = model.config
        self.device = device
        self.dtype = next(model.backbone.parameters()).dtype
        self.block_size = block_size
        self.inference_timesteps = inference_timesteps
        lm, res = self.cfg.lm, self.cfg.residual_lm
        self.base_cache = PagedKVCache(lm.num_hidden_layers, num_blocks, block_size, lm.num_key_value_heads,
                                       lm.head_dim, self.dtype, device)
        self.residual_cache = PagedKVCache(res.num_hidden_layers, num_blocks, block_size,
                                           res.num_key_value_heads, res.head_dim, self.dtype, device)
        p = self.cfg.patch_size
        self.samples_per_patch = p * model.vae.decode_chunk_size

    @staticmethod
    def kv_bytes_per_block(model: LoadedModel, block_size: int, dtype: torch.dtype) -> int:
        cfg = model.config
        return sum(PagedKVCache.bytes_per_block(c.num_hidden_layers, block_size, c.num_key_value_heads,
                                                c.head_dim, dtype) for c in (cfg.lm, cfg.residual_lm))

    def _tables(self, seqs: list[Sequence]) -> torch.Tensor:
        width = max(len(s.block_table) for s in seqs)
        rows = [s.block_table + [-1] * (width - len(s.block_table)) for s in seqs]
        return torch.tensor(rows, dtype=torch.int32, device=self.device)

    @torch.inference_mode()
    def prefill(self, seqs: list[Sequence]) -> None:
        """Fill both LMs' caches with each sequence's prompt (minus its prefix-cached blocks) and
        leave each sequence ready for its first decode step."""
        ids, feats, mask, positions, slots, last_rows, qlens, klens = [], [], [], [], [], [], [], []
        last_feats = []
        for seq in seqs:
            seq_ids, seq_feats, seq_mask = seq.prefill_inputs()
            last_feats.append(seq_feats[-1])
            start, n = seq.num_cached_tokens, len(seq_ids)
            ids += seq_ids[start:]
            feats.append(seq_feats[start:])
            mask.append(seq_mask[start:])
            positions += range(start, n)
            slots += [seq.block_table[i // self.block_size] * self.block_size + i % self.block_size
                      for i in range(start, n)]
            qlens.append(n - start)
            klens.append(n)
            last_rows.append(sum(qlens) - 1)
        dev = self.device
        meta = AttentionMetadata(
            is_prefill=True,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            block_tables=self._tables(seqs),
            context_lens=torch.tensor(klens, dtype=torch.int32, device=dev),
            query_lens=qlens,
            key_lens=klens,
        )
        lm_h, res_h = self.model.backbone.prefill(
            torch.tensor(ids, dtype=torch.long, device=dev), torch.cat(feats).to(dev), torch.cat(mask).to(dev),
            torch.tensor(positions, dtype=torch.long, device=dev), torch.tensor(last_rows, device=dev),
            self.base_cache.attend_fn(meta), self.residual_cache.attend_fn(meta))
        for i, seq in enumerate(seqs):
            seq.lm_hidden, seq.residual_hidden = lm_h[i], res_h[i]
            seq.prev_patch = last_feats[i].to(dev)
            if seq.noise is None:
                seq.noise = torch.Generator().manual_seed(
                    seq.params.seed if seq.params.seed is not None else int(torch.randint(0, 2**62, ()).item()))
            if seq.decoder is None:
                seq.decoder = self.model.vae.streaming_decoder()
                if len(seq.prompt.context):
                    seq.decoder.prime(self._patches_to_latents(seq.prompt.context.to(dev)))

    def _patches_to_latents(self, patches: torch.Tensor) -> torch.Tensor:
        """(N, P, D) -> (1, D, N * P) float32 VAE input."""
        return patches.float().reshape(-1, patches.shape[-1]).T.unsqueeze(0)

    def _noise(self, seq: Sequence) -> torch.Tensor:
        d, p = self.cfg.feat_dim, self.cfg.patch_size
        if seq.injected_noise is not None:
            z = seq.injected_noise[seq.num_generated].reshape(d, p).float()
        else:
            z = torch.randn((d, p), generator=seq.noise)
        return z * seq.params.temperature

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence], blocks: BlockManager) -> list[PatchResult]:
        """One patch for each sequence; the patch is fed back into both LMs in the same step."""
        dev = self.device
        slots = [blocks.append_slot(s) for s in seqs]
        positions = torch.tensor([s.num_tokens for s in seqs], dtype=torch.long, device=dev)
        meta = AttentionMetadata(
            is_prefill=False,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            block_tables=self._tables(seqs),
            context_lens=(positions + 1).to(torch.int32),
        )
        out = self.model.backbone.decode_step(
            torch.stack([s.lm_hidden for s in seqs]), torch.stack([s.residual_hidden for s in seqs]),
            torch.stack([s.prev_patch for s in seqs]), torch.stack([self._noise(s) for s in seqs]).to(dev),
            torch.tensor([s.params.cfg_value for s in seqs], dtype=torch.float32, device=dev), positions,
            self.inference_timesteps, self.base_cache.attend_fn(meta), self.residual_cache.attend_fn(meta))
        stops = out.stop.tolist()
        results = []
        for i, seq in enumerate(seqs):
            patch = out.patch[i]
            step = seq.num_generated  # index of this patch
            seq.generated.append(patch.float().cpu())
            seq.num_generated += 1
            seq.prev_patch = patch
            seq.lm_hidden, seq.residual_hidden = out.lm_hidden[i], out.residual_hidden[i]
            reason = None
            if stops[i] and step > seq.params.min_len:
                reason = "stop"
            elif seq.num_generated >= seq.max_patches:
                reason = "length"
            audio = seq.decoder.decode_chunk(self._patches_to_latents(patch.unsqueeze(0)))
            results.append(PatchResult(seq, seq.generated[-1], audio.reshape(-1).float().cpu().numpy(),
                                       reason is not None, reason))
        return results
