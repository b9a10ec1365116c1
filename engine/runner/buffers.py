"""The persistent device buffers a step reads and writes, so that a captured CUDA graph can replay it: the decode
step's inputs as one packed byte buffer with a view per field, its outputs side by side for one copy to the host, and
the graphed prefill's static inputs; plus the batch and token buckets that graphs are captured for."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from engine.sequence import Sequence


def graph_buckets(max_batch: int) -> list[int]:
    """Batch sizes with a captured graph; a batch runs in the smallest bucket that holds it."""
    small = [b for b in (1, 2, 4, 8) if b < max_batch]
    return small + list(range(16, max_batch, 16)) + [max_batch]


def prefill_buckets(max_tokens: int) -> list[int]:
    """Token counts with a captured prefill graph: powers of two from 16 up to max_tokens (capped at
    2048: longer prefills are rare and cost more than their launches)."""
    top = min(max_tokens, 2048)
    out, t = [], 16
    while t < top:
        out.append(t)
        t *= 2
    return [*out, top]


def host_block_tables(seqs: list[Sequence], width: int, pad_rows: int = 0) -> torch.Tensor:
    """Block tables padded with block 0 (never read past a sequence's length), on the host."""
    rows = [s.block_table + [0] * (width - len(s.block_table)) for s in seqs] + [[0] * width] * pad_rows
    return torch.tensor(rows, dtype=torch.int32)


Field = tuple[str, torch.dtype, tuple[int, ...]]  # (name, dtype, shape) of one input in a packed byte buffer


def packed_layout(fields: list[Field]) -> tuple[dict[str, int], int]:
    """Each field's byte offset in one packed buffer, 16-byte aligned (as a torch allocation is, so the kernels
    reading them compile to the same variants), and the buffer's size, a multiple of 16."""
    offsets, size = {}, 0
    for name, dtype, shape in fields:
        offsets[name] = size = -(-size // 16) * 16
        size += math.prod(shape) * dtype.itemsize
    return offsets, -(-size // 16) * 16


def packed_views(packed: torch.Tensor, fields: list[Field]) -> dict[str, torch.Tensor]:
    """The fields as views of the byte buffer `packed`, laid out by `packed_layout`."""
    offsets, _ = packed_layout(fields)
    return {name: packed[offsets[name]:offsets[name] + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
            for name, dtype, shape in fields}


@dataclass
class PrefillInputs:
    """The host-side inputs of one prefill: the uncached tokens of several sequences, flattened."""

    token_ids: torch.Tensor  # (T,) long
    audio_feats: torch.Tensor  # (K, P, D) float32: the K audio rows' features in row order (text rows' zeros: left out)
    last_feats: torch.Tensor  # (B, P, D) float32: each sequence's last row's (the previous patch of its first decode)
    audio_mask: torch.Tensor  # (T,) bool
    positions: torch.Tensor  # (T,) long
    slot_mapping: torch.Tensor  # (T,) long
    row_index: torch.Tensor  # (T,) int32: which sequence
    block_tables: torch.Tensor  # (B, width) int32
    last_rows: torch.Tensor  # (B,) long
    query_lens: list[int]
    key_lens: list[int]
    lora_slots: torch.Tensor  # (T,) long: each token's runtime LoRA slot, -1 for none


@dataclass
class PrefillFields:
    """A graphed prefill's inputs, padded to the largest token bucket: views of one byte buffer (`PrefillBuffers`)."""

    token_ids: torch.Tensor  # (tokens,) long
    audio_mask: torch.Tensor  # (tokens,) bool
    positions: torch.Tensor  # (tokens,) long
    slot_mapping: torch.Tensor  # (tokens,) long: padding tokens write the scratch KV slot
    row_index: torch.Tensor  # (tokens,) int32
    context_lens: torch.Tensor  # (tokens,) int32: 0 on padding tokens, which read nothing
    lora_slots: torch.Tensor  # (tokens,) long
    block_tables: torch.Tensor  # (rows, table width) int32
    last_rows: torch.Tensor  # (rows,) long
    # LocEnc's input: the audio rows' patches, packed, and the row each one's embedding goes to (padding: the scratch
    # row `tokens` of audio_embed). The patches come last: a copy stops after the rows a prefill uses.
    audio_rows: torch.Tensor  # (tokens,) long
    audio_lora_slots: torch.Tensor  # (tokens,) long
    audio_feats: torch.Tensor  # (tokens, P, D) model dtype

    def fill_padding(self, scratch_kv_slot: int, tokens: slice = slice(None), audio: slice = slice(None)) -> None:
        """Token rows `tokens` and packed audio rows `audio` as padding (default: all of them), and every block table
        and last row zeroed (a prefill then writes its own rows): they read nothing and write only the scratch KV slot
        and the scratch embedding row."""
        for field in (self.token_ids, self.audio_mask, self.positions, self.row_index, self.context_lens):
            field[tokens] = 0
        self.slot_mapping[tokens] = scratch_kv_slot
        self.lora_slots[tokens] = -1
        self.audio_feats[audio] = 0
        self.audio_rows[audio] = len(self.token_ids)
        self.audio_lora_slots[audio] = -1
        self.block_tables.zero_()
        self.last_rows.zero_()


class PrefillBuffers:
    """Static inputs/outputs of a graphed prefill, sized for the largest token bucket. The inputs are one byte buffer
    with a view per field (`inputs`); the host fills a pinned mirror of it (`staging`) and moves what a prefill uses in
    one copy (CUDA; on the CPU the mirror is the buffer itself). One copy instead of one per field: the fields'
    eleven pageable copies took ~0.5 ms of host time before a prefill could start."""

    def __init__(self, tokens: int, rows: int, table_width: int, patch: int, feat_dim: int, hidden: int,
                 scratch_kv_slot: int, dtype: torch.dtype, device: torch.device) -> None:
        long, i32 = torch.long, torch.int32
        self.layout: list[Field] = [
            ("token_ids", long, (tokens,)), ("audio_mask", torch.bool, (tokens,)), ("positions", long, (tokens,)),
            ("slot_mapping", long, (tokens,)), ("row_index", i32, (tokens,)), ("context_lens", i32, (tokens,)),
            ("lora_slots", long, (tokens,)), ("block_tables", i32, (rows, table_width)), ("last_rows", long, (rows,)),
            ("audio_rows", long, (tokens,)), ("audio_lora_slots", long, (tokens,)),
            ("audio_feats", dtype, (tokens, patch, feat_dim))]
        self.offsets, size = packed_layout(self.layout)
        self.audio_row_bytes = patch * feat_dim * dtype.itemsize
        self.packed = torch.empty(size, dtype=torch.uint8, device=device)
        self.inputs = PrefillFields(**packed_views(self.packed, self.layout))
        self.inputs.fill_padding(scratch_kv_slot)
        self.host_packed: torch.Tensor | None = None  # the pinned mirror (CUDA)
        self.staging = self.inputs
        if device.type == "cuda":
            self.host_packed = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            self.staging = PrefillFields(**packed_views(self.host_packed, self.layout))
            self.staging.fill_padding(scratch_kv_slot)
        self.copied: torch.cuda.Event | None = None  # the last copy from the mirror
        self.audio_embed = torch.zeros(tokens + 1, hidden, dtype=dtype, device=device)  # read where audio_mask is set
        self.lm_hidden = torch.zeros(rows, hidden, dtype=dtype, device=device)
        self.residual_hidden = torch.zeros(rows, hidden, dtype=dtype, device=device)
        self.scratch_kv_slot = scratch_kv_slot

    def host_inputs(self) -> PrefillFields:
        """The staging views to fill for the next prefill (once the last copy from them is done: long done then)."""
        if self.copied is not None:
            self.copied.synchronize()
        return self.staging

    def send_inputs(self, audio_rows: int) -> None:
        """Queue the copy of the staged inputs to the device buffer: every field, and the first `audio_rows` patches."""
        if self.host_packed is None:
            return
        end = self.offsets["audio_feats"] + audio_rows * self.audio_row_bytes
        self.packed[:end].copy_(self.host_packed[:end], non_blocking=True)
        self.copied = torch.cuda.Event()
        self.copied.record(torch.cuda.current_stream(self.packed.device))


@dataclass
class StepInputs:
    """The per-step inputs of a decode step for `rows` rows: views of one byte buffer (see `DecodeBuffers`)."""

    slot_index: torch.Tensor  # (rows,) long: each row's slot (state row)
    positions: torch.Tensor  # (rows,) long
    slot_mapping: torch.Tensor  # (rows,) long: KV slot of the new token
    context_lens: torch.Tensor  # (rows,) int32
    cfg: torch.Tensor  # (rows,) float32
    block_tables: torch.Tensor  # (rows, table width) int32
    noise: torch.Tensor  # (rows, D, P) float32
    lora_slots: torch.Tensor  # (rows,) long: each row's runtime LoRA slot, -1 for none

    def fill_padding(self, scratch_seq_slot: int, scratch_kv_slot: int, start: int = 0) -> None:
        """Rows from `start` on as padding: they read nothing and write only scratch rows."""
        self.slot_index[start:] = scratch_seq_slot
        self.positions[start:] = 0
        self.slot_mapping[start:] = scratch_kv_slot
        self.context_lens[start:] = 1
        self.cfg[start:] = 0.0
        self.block_tables[start:] = 0
        self.noise[start:] = 0.0
        self.lora_slots[start:] = -1


class DecodeBuffers:
    """Static inputs and outputs of one decode step, sized for the largest batch (graph-addressable).

    A step's inputs are one byte buffer, laid out per row count (`step_inputs`): the graph of a batch bucket reads
    its layout's views, and the host fills the same layout in pinned memory and moves it in one copy.
    (One copy instead of one per input: the small copies left the device idle between two B=1 steps.)"""

    FIELDS: tuple[tuple[str, torch.dtype], ...] = (
        ("slot_index", torch.long), ("positions", torch.long), ("slot_mapping", torch.long),
        ("context_lens", torch.int32), ("cfg", torch.float32), ("block_tables", torch.int32),
        ("noise", torch.float32), ("lora_slots", torch.long))

    def __init__(self, rows: int, table_width: int, feat_dim: int, patch: int, samples: int, scratch_seq_slot: int,
                 scratch_kv_slot: int, dtype: torch.dtype, device: torch.device) -> None:
        z = functools.partial(torch.zeros, device=device)
        self.table_width, self.feat_dim, self.patch_size = table_width, feat_dim, patch
        self.scratch_seq_slot, self.scratch_kv_slot = scratch_seq_slot, scratch_kv_slot
        self.inputs = z(self.input_bytes(rows), dtype=torch.uint8)
        self._layouts: dict[tuple[int, int], StepInputs] = {}
        self.row_index = torch.arange(rows, dtype=torch.int32, device=device)
        # Each row's patch (P * D, float32) and stop flag (1.0 / 0.0) side by side: one copy to the host per step
        # (with the patch already in float32: no conversion kernel before it).
        self.results = z(rows, patch * feat_dim + 1, dtype=torch.float32)
        self.audio = z(rows, samples, dtype=torch.float32)
        # The VAE's own copies of its inputs when it runs behind the next step (VaeStream.overlaps).
        self.vae_index = torch.full((rows,), scratch_seq_slot, dtype=torch.long, device=device)
        self.vae_patch = z(rows, patch, feat_dim, dtype=dtype)

    def patch(self, rows: int) -> torch.Tensor:
        """(rows, P, D) float32 view of the results: each row's new patch."""
        return self.results[:rows, :-1].view(rows, self.patch_size, self.feat_dim)

    def stop(self, rows: int) -> torch.Tensor:
        """(rows,) float32 view of the results: 1.0 where the stop head fired."""
        return self.results[:rows, -1]

    def _fields(self, rows: int) -> list[Field]:
        shapes = [(rows,)] * 5 + [(rows, self.table_width), (rows, self.feat_dim, self.patch_size), (rows,)]
        return [(name, dtype, shape) for (name, dtype), shape in zip(self.FIELDS, shapes, strict=True)]

    def input_bytes(self, rows: int) -> int:
        """Bytes of the inputs of `rows` rows (`packed_layout`)."""
        return packed_layout(self._fields(rows))[1]

    def step_inputs(self, rows: int, packed: torch.Tensor | None = None) -> StepInputs:
        """The inputs of a `rows`-row step as views of `packed` (default: the device buffer)."""
        packed = self.inputs if packed is None else packed
        key = (rows, packed.data_ptr())  # the device buffer and the runner's pinned ones live as long as this
        if key not in self._layouts:
            self._layouts[key] = StepInputs(**packed_views(packed, self._fields(rows)))
        return self._layouts[key]

    def reset_inputs(self, rows: int) -> None:
        """All `rows` rows of that layout as padding, right before a warm-up or dry run runs the step on them (the
        layouts of different row counts overlap: resetting one garbles the others)."""
        self.step_inputs(rows).fill_padding(self.scratch_seq_slot, self.scratch_kv_slot)
