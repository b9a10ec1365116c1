"""Runs scheduled batches through the model on one device: the one object the engine talks to.

It owns the device state: per-sequence step state in slot buffers (one row per running sequence, plus a scratch row
for padding rows), the paged KV caches (sized by a dry run of the largest steps), the static step buffers. A step
itself is elsewhere: its body in `decode_step` / `prefill_step`, its CUDA graphs per bucket in `cuda_graphs`, the
pinned host buffers of its inputs and outputs in `host_io`. Here: slots given and taken back, which runtime LoRA
adapter a step merges, a decode step launched without waiting (`launch_decode`) and its outputs read later
(`collect_decode`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.block_manager import BlockManager
from engine.engine_config import EngineConfig
from engine.io.checkpoint import LoadedModel
from engine.models import dit_rows_per_stream
from engine.models.minicpm import attach_gated_companions, fuse_projections, quantize_projections
from engine.ops import layer_stack, vae_conv
from engine.options import current
from engine.runner.attention import PagedKVCache, select_backend
from engine.runner.buffers import (
    DecodeBuffers,
    PrefillBuffers,
    PrefillInputs,
    graph_buckets,
    host_block_tables,
    prefill_buckets,
)
from engine.runner.cuda_graphs import StepGraphs
from engine.runner.decode_step import DecodeStep
from engine.runner.host_io import HostStepBuffers, queued_copy
from engine.runner.lora import LoRASlots
from engine.runner.prefill_step import PrefillStep
from engine.runner.vae_stream import VaeStream
from engine.sequence import Sequence, Status, StepEvent

log = logging.getLogger(__name__)


@dataclass
class LaunchedDecode:
    """A decode step queued on the device: its sequences, where its outputs land on the host (pinned
    buffers on CUDA) and the event that says they are there (None: already there)."""

    seqs: list[Sequence]
    outputs: tuple[torch.Tensor, torch.Tensor]  # results (B, P * D + 1) float32 (`DecodeBuffers`), audio (B, S)
    done: torch.cuda.Event | None
    prefilled: list[Sequence] = field(default_factory=list)  # prefilled in the same step (pipelined engine)


class ModelRunner:
    def __init__(self, model: LoadedModel, config: EngineConfig, device: torch.device) -> None:
        self.model = model
        self.cfg = model.config
        self.device = device
        self.dtype = next(model.backbone.parameters()).dtype
        self.config = config
        block_size, max_num_seqs = config.block_size, config.max_num_seqs
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.inference_timesteps = config.inference_timesteps
        self.backend = select_backend(device, self.dtype, config.attention_backend)
        opts = current()
        if device.type == "cuda" and opts.fuse:
            fuse_projections(model.backbone)
            layer_stack.prepare(device)  # the layer kernels' barrier counters, before any graph capture
        # FP8 weights after the merged adapter, fusing and stacking; before runtime adapters' base copies and capture.
        quantized = quantize_projections(model.backbone, config.quantization, device)
        if config.quantization:
            log.info("quantization %s: projection weights %s", config.quantization, quantized)
        if device.type == "cuda" and opts.fuse:  # the gated GEMMs' interleaved weights, where rows will reach them
            attach_gated_companions(model.backbone, model.backbone.feat_decoder,
                                    max_num_seqs * dit_rows_per_stream(model.config), bool(quantized["fp8_gemm"]))
        # Runtime LoRA adapters: their slots exist before KV sizing and graph capture, which then include them.
        self.lora = LoRASlots(model.backbone, model.config.architecture, config.max_loras,
                              config.max_lora_rank, device, self.dtype, opts.lora_merged_steps,
                              config.lora_slot_wait_s) if config.max_loras else None
        self.lora_mixed = False  # whether the last decode step added terms (rows of different adapters)
        if device.type == "cuda":
            # cuDNN's algorithm search runs at a convolution shape's first call, which a graph capture cannot hold
            # (a bucket's VAE meets it there), and it made the pool no faster (docs/benchmarks.md, Refuted).
            torch.backends.cudnn.benchmark = False
            vae_conv.match_cudnn_tf32()  # process-wide: a worker owns its process
        self.use_graphs = device.type == "cuda" and not config.enforce_eager
        self.vae_stream = VaeStream(device, self.use_graphs)
        p, d = self.cfg.patch_size, self.cfg.feat_dim
        self.samples_per_patch = p * model.vae.decode_chunk_size
        self.table_width = (config.max_model_len + block_size - 1) // block_size
        # Slot state: one row per running sequence plus a scratch row that padding rows read and write.
        rows, h = max_num_seqs + 1, self.cfg.lm.hidden_size
        self.scratch_slot = max_num_seqs
        self.free_slots = list(range(max_num_seqs))
        self.lm_hidden = torch.zeros(rows, h, dtype=self.dtype, device=device)
        self.residual_hidden = torch.zeros(rows, h, dtype=self.dtype, device=device)
        self.prev_patch = torch.zeros(rows, p, d, dtype=self.dtype, device=device)
        vae_param = next(model.vae.decoder.parameters())
        self.vae_states = [torch.zeros(rows, c, n, dtype=vae_param.dtype, device=device)
                           for c, n in model.vae.decoder.state_shapes]
        self.decode_step = DecodeStep(model, self.lm_hidden, self.residual_hidden, self.prev_patch, self.vae_states,
                                      self.inference_timesteps, self.vae_stream, device)
        self.base_cache: PagedKVCache | None = None
        self.residual_cache: PagedKVCache | None = None
        self.buffers: DecodeBuffers | None = None
        self.prefill_buffers: PrefillBuffers | None = None
        self.step_graphs = StepGraphs(device)
        # Its graphs and timings by the names the engine and the tools read (the same dicts: cleared, never replaced).
        self.graphs, self.term_graphs = self.step_graphs.decode, self.step_graphs.decode_terms
        self.prefill_graphs, self.prefill_term_graphs = self.step_graphs.prefill, self.step_graphs.prefill_terms
        self.capture_times = self.step_graphs.capture_times
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.prefill_bucket_sizes = prefill_buckets(config.max_num_batched_tokens)
        self.host = HostStepBuffers()
        self.prefill_step = PrefillStep(model, block_size, self.dtype, device)

    # --- KV cache -----------------------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        return sum(PagedKVCache.bytes_per_block(c.num_hidden_layers, self.block_size, c.num_key_value_heads,
                                                c.head_dim, self.dtype) for c in (self.cfg.lm, self.cfg.residual_lm))

    def allocate_kv_cache(self, num_blocks: int) -> None:
        lm, res = self.cfg.lm, self.cfg.residual_lm
        self.base_cache = PagedKVCache(lm.num_hidden_layers, num_blocks, self.block_size, lm.num_key_value_heads,
                                       lm.head_dim, self.dtype, self.device, self.backend)
        self.residual_cache = PagedKVCache(res.num_hidden_layers, num_blocks, self.block_size,
                                           res.num_key_value_heads, res.head_dim, self.dtype, self.device,
                                           self.backend)
        p, d = self.cfg.patch_size, self.cfg.feat_dim
        self.buffers = DecodeBuffers(self.max_num_seqs, self.table_width, d, p, self.samples_per_patch,
                                     self.scratch_slot, self.base_cache.scratch_slot, self.dtype, self.device)
        self.prefill_buffers = PrefillBuffers(self.prefill_bucket_sizes[-1], self.max_num_seqs,
                                              self.table_width, p, d, self.cfg.lm.hidden_size,
                                              self.base_cache.scratch_slot, self.dtype, self.device)
        self.step_graphs.clear()
        self.vae_stream.reset()
        self.host.reset()

    @torch.inference_mode()
    def profile_num_blocks(self, gpu_memory_utilization: float, max_model_len: int) -> int:
        """KV blocks that fit in `gpu_memory_utilization` of the device after the weights and the peak
        working memory of the largest prefill and the largest decode step (measured, not estimated)."""
        assert self.device.type == "cuda"
        torch.cuda.empty_cache()
        self.allocate_kv_cache(self.table_width)  # room for one full-length sequence, for the dry run
        tokens = min(self.max_num_batched_tokens, max_model_len * self.max_num_seqs)
        full, rest = divmod(tokens, max_model_len)
        lens = [max_model_len] * full + ([rest] if rest else [])
        largest = self.max_num_seqs

        buffers = self.buffers
        assert buffers is not None

        def dry_step(rows: int, vae: bool) -> None:
            # The layouts of different row counts share bytes: padding in this one right before it runs.
            buffers.reset_inputs(rows)
            self._decode_forward(rows, self.table_width, vae)

        def prefill_and_step() -> None:
            assert self.base_cache is not None and self.residual_cache is not None
            self.prefill_step.dry_run(lens, self.table_width, self.base_cache, self.residual_cache,
                                      self.lora is not None)
            dry_step(largest, not self.vae_stream.overlaps(largest))

        peak_extra = self._working_memory(prefill_and_step)
        in_step = [b for b in graph_buckets(largest) if not self.vae_stream.overlaps(b)]
        if in_step and self.vae_stream.overlaps(largest):  # a smaller bucket's step with its VAE inside may need more
            peak_extra = max(peak_extra, self._working_memory(lambda: dry_step(max(in_step), True)))
        if self.vae_stream.overlaps(largest):  # the VAE graphs' own pool is held beside the step's: its peak counts
            peak_extra += self._working_memory(lambda: self._vae_forward(largest))
        self.base_cache = self.residual_cache = self.buffers = None
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        used_now = total - free  # weights, this process's other buffers, other processes
        budget = total * gpu_memory_utilization - used_now - peak_extra
        num_blocks = int(budget // self.kv_bytes_per_block())
        log.info("KV sizing: total %.1f GiB, in use %.1f GiB, step peak %.2f GiB -> %d blocks (%.1f GiB)",
                 total / 2**30, used_now / 2**30, peak_extra / 2**30, num_blocks,
                 num_blocks * self.kv_bytes_per_block() / 2**30)
        if num_blocks < self.table_width:
            raise RuntimeError(f"gpu_memory_utilization={gpu_memory_utilization} leaves room for {num_blocks} KV "
                               f"blocks; one max_model_len sequence needs {self.table_width}")
        return num_blocks

    def _working_memory(self, body: Callable[[], None]) -> int:
        """Peak bytes `body` allocates on the device beyond what stays allocated after it."""
        torch.cuda.reset_peak_memory_stats(self.device)
        body()
        torch.cuda.synchronize(self.device)
        stats = torch.cuda.memory_stats(self.device)
        return stats["allocated_bytes.all.peak"] - stats["allocated_bytes.all.current"]

    # --- slots --------------------------------------------------------------------------------
    def assign_slots(self, seqs: list[Sequence]) -> None:
        """Give sequences state rows: a new one a fresh VAE stream, a resumed one its saved state. Batched
        (one op per state buffer, one VAE pass per context length), so a burst of new requests costs a
        few dozen launches, not dozens per request."""
        if seqs:
            self.vae_stream.join()
        for seq in seqs:
            seq.slot = self.free_slots.pop()
        fresh = [s for s in seqs if s.saved_vae_state is None]
        if fresh:
            index = queued_copy(torch.tensor([s.slot for s in fresh]), self.device)
            for buf in self.vae_states:
                buf.index_fill_(0, index, 0)
        for seq in seqs:
            if seq.saved_vae_state is not None:
                for buf, state in zip(self.vae_states, seq.saved_vae_state, strict=True):
                    buf[seq.slot].copy_(state)
                seq.saved_vae_state = None
        self._prime_vae_streams([s for s in fresh if len(s.prompt.context)])

    def _prime_vae_streams(self, seqs: list[Sequence]) -> None:
        """Continuation: a new VAE stream starts after the prompt's last patches (their audio dropped). One VAE
        pass per context length, in chunks padded to a power of two (padding rows decode into the scratch slot):
        few shapes (cuDNN searches each once), no more patches at once than the profiled step's max_num_seqs
        (at most 16 rows)."""
        by_length: dict[int, list[Sequence]] = {}
        for seq in seqs:
            by_length.setdefault(len(seq.prompt.context), []).append(seq)
        for patches, group in by_length.items():
            most = 1 << (max(1, min(16, self.max_num_seqs // patches)).bit_length() - 1)
            for start in range(0, len(group), most):
                chunk = group[start:start + most]
                pad = (1 << (len(chunk) - 1).bit_length()) - len(chunk)
                context = torch.stack([s.prompt.context for s in chunk])
                context = queued_copy(torch.cat([context, context[:1].expand(pad, -1, -1, -1)]), self.device)
                index = queued_copy(torch.tensor([s.slot for s in chunk] + [self.scratch_slot] * pad), self.device)
                self._decode_audio(index, self._latents(context))

    def release_slot(self, seq: Sequence, keep_state: bool = False) -> None:
        """Free a sequence's row (finished, aborted) or park its VAE stream state (preempted)."""
        if seq.slot is None:
            return
        if keep_state:
            self.vae_stream.join()
            seq.saved_vae_state = [buf[seq.slot].clone() for buf in self.vae_states]
        self.free_slots.append(seq.slot)
        seq.slot = None

    # --- prefill ------------------------------------------------------------------------------
    def prefill_inputs(self, seqs: list[Sequence]) -> PrefillInputs:
        return self.prefill_step.inputs(seqs)

    def prefill_eager(self, x: PrefillInputs, terms: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The prefill, eagerly; `terms`: add the rows' runtime adapters' terms (default: when adapters are on)."""
        terms = self._terms(terms)
        assert self.base_cache is not None and self.residual_cache is not None
        return self.prefill_step.eager(x, self.base_cache, self.residual_cache, terms)

    def _prefill_forward(self, tokens: int, terms: bool = False) -> None:
        """`PrefillStep.forward` over this runner's buffers (graph body)."""
        b = self.prefill_buffers
        assert b is not None and self.base_cache is not None and self.residual_cache is not None
        self.prefill_step.forward(b, self.base_cache, self.residual_cache, tokens, terms)

    def _encode_forward(self, rows: int, terms: bool = False) -> None:
        """`PrefillStep.encode_forward` over this runner's buffers (graph body)."""
        assert self.prefill_buffers is not None
        self.prefill_step.encode_forward(self.prefill_buffers, rows, terms)

    def prefill_buffered(self, x: PrefillInputs, terms: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The prefill through the static buffers padded to a token bucket, LocEnc on its audio rows padded to a row
        bucket: graph replays where captured (the same bodies eagerly otherwise, e.g. on the CPU); `terms` as before."""
        terms = self._terms(terms)
        b = self.prefill_buffers
        assert b is not None
        n, rows, audio = len(x.token_ids), len(x.last_rows), int(x.audio_mask.sum())
        bucket = next(t for t in self.prefill_bucket_sizes if t >= n)
        audio_bucket = next(t for t in self.prefill_bucket_sizes if t >= audio) if audio else 0
        self.prefill_step.fill(b, x, bucket, audio_bucket)
        graphs = self.step_graphs
        if audio_bucket:
            graphs.replay_or_run(graphs.encode_graphs(terms), audio_bucket, self._encode_forward, terms)
        graphs.replay_or_run(graphs.prefill_graphs(terms), bucket, self._prefill_forward, terms)
        return b.lm_hidden[:rows], b.residual_hidden[:rows]

    def _can_graph_prefill(self, x: PrefillInputs, terms: bool = False) -> bool:
        return (bool(self.step_graphs.prefill_graphs(terms)) and self.prefill_buffers is not None
                and len(x.token_ids) <= self.prefill_bucket_sizes[-1] and len(x.last_rows) <= self.max_num_seqs
                and x.block_tables.shape[1] <= self.table_width)

    @torch.inference_mode()
    def prefill(self, seqs: list[Sequence]) -> None:
        """Fill both LMs' caches with each sequence's prompt (minus its prefix-cached blocks) and
        leave its slot ready for its first decode step."""
        self.assign_slots([s for s in seqs if s.slot is None])
        x = self.prefill_inputs(seqs)
        terms = self._lora_terms([s.lora_slot for s in seqs], decode=False)
        lm_h, res_h = (self.prefill_buffered(x, terms) if self._can_graph_prefill(x, terms)
                       else self.prefill_eager(x, terms))
        index = queued_copy(torch.tensor([s.slot for s in seqs], dtype=torch.long), self.device)
        self.lm_hidden[index] = lm_h
        self.residual_hidden[index] = res_h
        # The previous patch of the first decode step: the last input row's features.
        self.prev_patch[index] = queued_copy(x.last_feats, self.device).to(self.dtype)

    # --- decode step ------------------------------------------------------------------------
    def _latents(self, patches: torch.Tensor) -> torch.Tensor:
        return self.decode_step.latents(patches)

    def _decode_audio(self, index: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        return self.decode_step.decode_audio(index, latents)

    def _decode_forward(self, batch: int, width: int, vae: bool = True, terms: bool | None = None) -> None:
        """`DecodeStep.forward` over this runner's buffers; `terms` by default: when adapters are on."""
        terms = self._terms(terms)
        buf = self.buffers
        assert buf is not None and self.base_cache is not None and self.residual_cache is not None
        self.decode_step.forward(buf, self.base_cache, self.residual_cache, batch, width, vae, terms)

    def _vae_forward(self, batch: int) -> None:
        buf = self.buffers
        assert buf is not None
        self.decode_step.vae_forward(buf, batch)

    @torch.inference_mode()
    def capture_graphs(self) -> float:
        """Capture the step graphs (`StepGraphs.capture`); the seconds it took."""
        if not self.use_graphs:
            return 0.0
        assert self.buffers is not None
        return self.step_graphs.capture(self.buffers, self.vae_stream, self.lora, self.max_num_seqs, self.table_width,
                                        self.backend, self.prefill_bucket_sizes, self._decode_forward,
                                        self._vae_forward, self._prefill_forward, self._encode_forward)

    def _noise(self, seq: Sequence, ahead: int) -> torch.Tensor:
        d, p = self.cfg.feat_dim, self.cfg.patch_size
        if seq.injected_noise is not None:
            z = seq.injected_noise[seq.num_generated + ahead].reshape(d, p).float()
        else:
            assert seq.noise is not None
            z = torch.randn((d, p), generator=seq.noise)
        return z * seq.params.temperature

    def _terms(self, terms: bool | None) -> bool:
        """A forward's `terms` argument: given, or by default whether runtime adapters are on (their worst case, as
        KV sizing's dry runs and the tests of one path against another want)."""
        return self.lora is not None if terms is None else terms

    def _lora_terms(self, slots: list[int], decode: bool) -> bool:
        """Whether a step over rows of these LoRA slots (-1: none) adds the adapters' terms; otherwise it runs on the
        weights with its one adapter merged (`LoRASlots.merge`, queued here before the step). A decode step of one
        adapter merges it; a prefill merges its adapter unless the running batch mixes adapters (it then keeps the
        base weights the next decode step needs: one rewrite fewer each way)."""
        lora = self.lora
        if lora is None:
            return False
        one = slots[0] if all(s == slots[0] for s in slots) else None
        if one is not None and one != -1 and not lora.merges:
            one = None
        if one is not None and not decode and one not in (-1, lora.merged) and self.lora_mixed:
            one = None
        lora.merge(-1 if one is None else one)
        if decode:
            self.lora_mixed = one is None
        return one is None

    @torch.inference_mode()
    def launch_decode(self, seqs: list[Sequence], blocks: BlockManager, ahead: int = 0) -> LaunchedDecode:
        """Start one decode step (a patch for each sequence, fed back into both LMs in the same step) and
        queue the copies of its outputs to the host, without waiting for them. `ahead` = 1 launches it
        while the sequences' previous step is still in flight (its patch is not counted in them yet)."""
        buf = self.buffers
        assert buf is not None
        b = len(seqs)
        slots = [blocks.append_slot(s, ahead) for s in seqs]
        graph_batch = self.step_graphs.decode_bucket(b)
        rows = graph_batch or b
        width = self.table_width if graph_batch else max(len(s.block_table) for s in seqs)
        pad = rows - b
        assert self.base_cache is not None
        scratch_kv = self.base_cache.scratch_slot
        overlap = graph_batch in self.vae_stream.graphs
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        if stream is not None:
            self.vae_stream.wait_inputs_taken(stream)
        if not overlap:
            # This step decodes its audio itself (a bucket below VOXCPM_VAE_OVERLAP_MIN_BATCH, or eager): after the
            # VAE graph of a previous, larger step is done with the VAE states, the audio buffer and its copy.
            self.vae_stream.join()
        # The inputs, in the layout of `rows` rows: on CUDA written to pinned memory and moved in one copy; on the
        # CPU written in place.
        packed = self.host.inputs(buf) if stream is not None else buf.inputs
        inputs = buf.step_inputs(rows, packed)
        inputs.slot_index[:b] = torch.tensor([s.slot for s in seqs])
        inputs.positions[:b] = torch.tensor([s.num_tokens + ahead for s in seqs])
        inputs.slot_mapping[:b] = torch.tensor(slots)
        inputs.context_lens[:b] = torch.tensor([s.num_tokens + ahead + 1 for s in seqs], dtype=torch.int32)
        inputs.cfg[:b] = torch.tensor([s.params.cfg_value for s in seqs])
        inputs.block_tables[:b, :width] = host_block_tables(seqs, width)
        inputs.noise[:b] = torch.stack([self._noise(s, ahead) for s in seqs])
        inputs.lora_slots[:b] = torch.tensor([s.lora_slot for s in seqs])
        terms = self._lora_terms([s.lora_slot for s in seqs], decode=True)
        if pad:
            inputs.fill_padding(self.scratch_slot, scratch_kv, start=b)
        if stream is not None:
            self.host.send_inputs(buf, packed, rows, stream)
        if graph_batch:
            self.step_graphs.decode_graphs(terms)[graph_batch].replay()
        else:
            self._decode_forward(b, width, terms=terms)
        if stream is None:  # CPU: synchronous anyway; copies, because .cpu() would alias the buffers
            return LaunchedDecode(seqs, (buf.results[:b].clone(), buf.audio[:b].clone()), None)
        results, audio = self.host.outputs(buf)
        ready = None if overlap else self.decode_step.outputs_ready.get(rows)
        main, stream = stream, self.vae_stream.after(stream, ready)  # the copies' stream
        with torch.cuda.stream(stream):
            results[:b].copy_(buf.results[:b], non_blocking=True)
        if overlap:  # the audio copy and `done` then come after everything of this step, the VAE included
            stream = self.vae_stream.launch_behind(stream, rows, buf)
        done = torch.cuda.Event()
        with torch.cuda.stream(stream):
            audio[:b].copy_(buf.audio[:b], non_blocking=True)
            done.record(stream)
        if ready is not None:  # the next step rewrites the buffers copied
            main.wait_event(done)
        return LaunchedDecode(seqs, (results[:b], audio[:b]), done)

    def collect_decode(self, step: LaunchedDecode) -> list[StepEvent]:
        """Wait for a launched step and turn its outputs into events, advancing each sequence; sequences
        finished (or aborted) since the launch are skipped: their extra patch is dropped."""
        patch_stop, audio_buf = step.outputs
        if step.done is not None:  # pinned buffers, reused by the step after next: copy out
            step.done.synchronize()
            audio_buf = audio_buf.clone()
        # A copy (the pinned buffer is reused): the patches outlive this step in their sequences.
        patches = patch_stop[:, :-1].clone(memory_format=torch.contiguous_format).view(
            len(patch_stop), self.cfg.patch_size, self.cfg.feat_dim).unbind(0)
        stops = (patch_stop[:, -1] > 0.5).tolist()
        audio = audio_buf.numpy()
        results = []
        for i, seq in enumerate(step.seqs):
            if seq.status != Status.RUNNING:
                continue
            step_index = seq.num_generated  # index of this patch
            seq.generated.append(patches[i])
            seq.num_generated += 1
            reason = None
            if stops[i] and step_index > seq.params.min_len:
                reason = "stop"
            elif seq.num_generated >= seq.max_patches:
                reason = "length"
            results.append(StepEvent(seq.seq_id, audio[i], patches[i], reason is not None, reason))
        return results
