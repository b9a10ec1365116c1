"""The prefill's inputs and bodies: the uncached prompt tokens of several sequences flattened on the host, and their
run through both LMs, eagerly or over static buffers padded to a token bucket (with tokens that read nothing and write
to a scratch KV block), which on CUDA a graph captures per bucket (`cuda_graphs`); larger prefills run eagerly. LocEnc
runs on the audio rows alone, packed (a graph per row bucket): a text-only prompt runs none."""

from __future__ import annotations

import numpy as np
import torch

from engine.io.checkpoint import LoadedModel
from engine.runner.attention import AttentionMetadata, PagedKVCache
from engine.runner.buffers import PrefillBuffers, PrefillInputs, host_block_tables
from engine.sequence import Sequence


class PrefillStep:
    """The prefill over a runner's model; the static buffers and the KV caches come with each call (they are replaced
    with the KV cache)."""

    def __init__(self, model: LoadedModel, block_size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.model = model
        self.cfg = model.config
        self.block_size = block_size
        self.dtype = dtype
        self.device = device

    def inputs(self, seqs: list[Sequence]) -> PrefillInputs:
        """The sequences' uncached tokens flattened. A worker builds these for a whole burst before its first step, so
        per token only C loops run, and of the features only the audio rows' travel (LocEnc's input: a burst's text
        rows would be megabytes of zeros)."""
        ids, audio, last, mask, positions, slots, rows, last_rows, qlens, klens = [], [], [], [], [], [], [], [], [], []
        loras: list[int] = []
        bs = self.block_size
        for i, seq in enumerate(seqs):
            seq_ids, seq_feats, seq_mask = seq.prefill_inputs()
            start, n = seq.num_cached_tokens, len(seq_ids)
            ids += seq_ids[start:]
            if seq_mask[start:].any():
                audio.append(seq_feats[start:][seq_mask[start:]])
            last.append(seq_feats[-1])
            mask.append(seq_mask[start:])
            positions += range(start, n)
            j = np.arange(start, n)
            slots.append(np.asarray(seq.block_table, dtype=np.int64)[j // bs] * bs + j % bs)
            rows += [i] * (n - start)
            loras += [seq.lora_slot] * (n - start)
            qlens.append(n - start)
            klens.append(n)
            last_rows.append(len(ids) - 1)
        empty = torch.zeros(0, self.cfg.patch_size, self.cfg.feat_dim)
        return PrefillInputs(
            token_ids=torch.tensor(ids, dtype=torch.long), audio_feats=torch.cat(audio) if audio else empty,
            last_feats=torch.stack(last), audio_mask=torch.cat(mask),
            positions=torch.tensor(positions, dtype=torch.long), slot_mapping=torch.from_numpy(np.concatenate(slots)),
            row_index=torch.tensor(rows, dtype=torch.int32),
            block_tables=host_block_tables(seqs, max(len(s.block_table) for s in seqs)),
            last_rows=torch.tensor(last_rows, dtype=torch.long), query_lens=qlens, key_lens=klens,
            lora_slots=torch.tensor(loras, dtype=torch.long))

    def eager(self, x: PrefillInputs, base_cache: PagedKVCache, residual_cache: PagedKVCache,
              terms: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The prefill, eagerly; `terms`: add the rows' runtime adapters' terms."""
        dev = self.device
        pos = x.positions.to(dev)
        meta = AttentionMetadata(True, x.slot_mapping.to(dev), x.block_tables.to(dev), x.row_index.to(dev),
                                 (pos + 1).to(torch.int32), x.query_lens, x.key_lens)
        return self.model.backbone.prefill(
            x.token_ids.to(dev), x.audio_feats.to(dev), x.audio_mask.to(dev), pos, x.last_rows.to(dev),
            base_cache.attend_fn(meta), residual_cache.attend_fn(meta),
            lora_slots=x.lora_slots.to(dev) if terms else None)

    def encode_forward(self, b: PrefillBuffers, rows: int, terms: bool) -> None:
        """LocEnc over the first `rows` packed audio patches, their embeddings written to their token rows of
        `audio_embed` (graph body; padding patches write the scratch row)."""
        x = b.inputs
        embed = self.model.backbone.encode_patches(x.audio_feats[:rows], x.audio_lora_slots[:rows] if terms else None)
        b.audio_embed.index_copy_(0, x.audio_rows[:rows], embed.to(b.audio_embed.dtype))

    def forward(self, b: PrefillBuffers, base_cache: PagedKVCache, residual_cache: PagedKVCache, tokens: int,
                terms: bool) -> None:
        """A prefill over the first `tokens` rows of the static buffers (graph body): no host-side lengths. The
        audio rows' embeddings are those `encode_forward` wrote (a prompt without audio rows runs no LocEnc)."""
        x = b.inputs
        meta = AttentionMetadata(True, x.slot_mapping[:tokens], x.block_tables, x.row_index[:tokens],
                                 x.context_lens[:tokens])
        mask = x.audio_mask[:tokens]
        audio_embed = torch.where(mask[:, None], b.audio_embed[:tokens], 0.0)
        lm_h, res_h = self.model.backbone.prefill_lms(
            x.token_ids[:tokens], audio_embed, mask, x.positions[:tokens], x.last_rows,
            base_cache.attend_fn(meta), residual_cache.attend_fn(meta),
            lora_slots=x.lora_slots[:tokens] if terms else None)
        b.lm_hidden.copy_(lm_h)
        b.residual_hidden.copy_(res_h)

    @staticmethod
    def fill(b: PrefillBuffers, x: PrefillInputs, bucket: int, audio_bucket: int) -> None:
        """Stage `x` padded to `bucket` tokens, its audio rows' patches packed and padded to `audio_bucket` rows (0:
        it has none), and queue the one copy to the static buffers."""
        s = b.host_inputs()
        n, rows = len(x.token_ids), len(x.last_rows)
        audio_rows = x.audio_mask.nonzero().squeeze(1)  # LocEnc's rows (none: audio_bucket is 0)
        k = len(audio_rows)
        s.fill_padding(b.scratch_kv_slot, slice(n, bucket), slice(k, audio_bucket))
        for field, values in ((s.token_ids, x.token_ids), (s.audio_mask, x.audio_mask), (s.positions, x.positions),
                              (s.slot_mapping, x.slot_mapping), (s.row_index, x.row_index),
                              (s.lora_slots, x.lora_slots), (s.context_lens, x.positions + 1)):
            field[:n] = values
        s.block_tables[:rows, :x.block_tables.shape[1]] = x.block_tables
        s.last_rows[:rows] = x.last_rows
        s.audio_feats[:k] = x.audio_feats
        s.audio_rows[:k] = audio_rows
        s.audio_lora_slots[:k] = x.lora_slots[audio_rows]
        b.send_inputs(audio_bucket)

    def dry_run(self, lens: list[int], table_width: int, base_cache: PagedKVCache, residual_cache: PagedKVCache,
                lora: bool) -> None:
        """A prefill of sequences of these lengths on dummy inputs (all pointing at the same blocks; `lora`: with
        the runtime adapters' terms), for KV sizing."""
        n, p, d = sum(lens), self.cfg.patch_size, self.cfg.feat_dim
        dev = self.device
        positions = torch.cat([torch.arange(k, device=dev) for k in lens])
        mask = torch.zeros(n, dtype=torch.bool, device=dev)
        mask[: n // 2] = True  # half audio positions: LocEnc runs too
        slots = positions % (table_width * self.block_size)
        table = torch.arange(table_width, dtype=torch.int32, device=dev).expand(len(lens), -1)
        row_index = torch.cat([torch.full((k,), i, dtype=torch.int32, device=dev) for i, k in enumerate(lens)])
        meta = AttentionMetadata(True, slots, table, row_index, (positions + 1).to(torch.int32), lens, lens)
        self.model.backbone.prefill(torch.zeros(n, dtype=torch.long, device=dev),
                                    torch.zeros(n // 2, p, d, dtype=self.dtype, device=dev), mask, positions,
                                    torch.tensor([n - 1], device=dev), base_cache.attend_fn(meta),
                                    residual_cache.attend_fn(meta),
                                    lora_slots=torch.full((n,), -1, device=dev) if lora else None)
