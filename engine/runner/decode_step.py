"""The decode step's body: a pure function of a few small index tensors over persistent device buffers.

Per-sequence step state (both LMs' last hidden states, the previous patch, the streaming VAE's conv context) lives in
device buffers indexed by a *slot*, one per running sequence. A step gathers the batch's states, samples the patch
(all Euler steps with CFG), decides stop, feeds the patch back through both LMs, decodes it to audio and scatters the
states back, with no host synchronisation inside it: on CUDA it is captured once per batch bucket as a CUDA graph
(`cuda_graphs`) and replayed; on CPU (or with `enforce_eager`) the same function runs eagerly.
"""

from __future__ import annotations

import contextlib

import torch

from engine.io.checkpoint import LoadedModel
from engine.models.vae_layers import SlotStates
from engine.options import current
from engine.runner.attention import AttentionMetadata, PagedKVCache
from engine.runner.buffers import DecodeBuffers
from engine.runner.vae_stream import VaeStream


class DecodeStep:
    """The step over the runner's slot-state buffers (one row per slot); the step's static buffers and the KV caches
    come with each call (they are replaced with the KV cache)."""

    def __init__(self, model: LoadedModel, lm_hidden: torch.Tensor, residual_hidden: torch.Tensor,
                 prev_patch: torch.Tensor, vae_states: list[torch.Tensor], inference_timesteps: int,
                 vae_stream: VaeStream, device: torch.device) -> None:
        self.model = model
        self.lm_hidden, self.residual_hidden, self.prev_patch = lm_hidden, residual_hidden, prev_patch
        self.vae_states = vae_states
        self.vae_sr_idx = model.vae._sr_idx(None)
        self.inference_timesteps = inference_timesteps
        self.vae_stream = vae_stream
        self.device = device
        # by batch: recorded (in the step's graph) once the step's audio, patch and stop flags are written, where the
        # VAE runs beside the LMs and EngineOptions.early_outputs holds: their copies to the host wait for it alone
        self.outputs_ready: dict[int, torch.cuda.Event] = {}

    def latents(self, patches: torch.Tensor) -> torch.Tensor:
        """(B, N, P, D) patches -> (B, D, N * P) VAE input."""
        vae_dtype = self.vae_states[0].dtype if self.vae_states else torch.float32
        return patches.to(vae_dtype).flatten(1, 2).transpose(1, 2)

    def decode_audio(self, index: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        """Streaming VAE decode of new latents for the streams in `index`; their states move on (read and replaced
        at their slots' rows of the state buffers, in place where a kernel can)."""
        audio = self.model.vae.decoder(latents, self.vae_sr_idx, SlotStates(self.vae_states, index))
        return audio.flatten(1)

    def forward(self, buf: DecodeBuffers, base_cache: PagedKVCache, residual_cache: PagedKVCache, batch: int,
                width: int, vae: bool, terms: bool) -> None:
        """One decode step over the first `batch` rows of the static buffers (graph body); without `vae`, the
        patch is left for `vae_forward`; `terms`: add the rows' runtime adapters' terms."""
        inputs = buf.step_inputs(batch)
        index = inputs.slot_index
        meta = AttentionMetadata(False, inputs.slot_mapping, inputs.block_tables[:, :width], buf.row_index[:batch],
                                 inputs.context_lens)
        backbone = self.model.backbone
        lm_hidden = self.lm_hidden[index]
        lora = inputs.lora_slots if terms else None
        patch = backbone.sample_patch(lm_hidden, self.residual_hidden[index], self.prev_patch[index],
                                      inputs.noise, inputs.cfg, self.inference_timesteps, lora)
        # The stop head and the VAE need only the old hidden state and the patch, the LMs only the encoded patch,
        # so on CUDA they run side by side: the stop head and the VAE on a second stream (forked and joined inside
        # the captured graph), LocEnc and the LMs on this one. The fork comes after LocEnc: its layer kernel's grid
        # barriers wait for the slowest program, which the VAE's kernels beside it would slow.
        # `patch` and `lm_hidden` stay referenced until after the join, so their memory is not reused under it.
        side = self.vae_stream.stream if vae else None
        main = torch.cuda.current_stream(self.device) if side is not None else None

        embed = backbone.encode_patches(patch, lora)
        if side is not None:
            side.wait_stream(main)
        early = side is not None and current().early_outputs
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            buf.stop(batch).copy_(backbone.stop_flags(lm_hidden))
            if vae:
                buf.audio[:batch] = self.decode_audio(index, self.latents(patch[:, None]))
            if early:  # an event record node of the graph: the outputs' copies need not wait for the LMs
                buf.patch(batch).copy_(patch)
                self.outputs_ready.setdefault(batch, torch.cuda.Event(external=True)).record(side)
        lm_next, residual_next = backbone.advance_lms(embed, inputs.positions, base_cache.attend_fn(meta),
                                                      residual_cache.attend_fn(meta), lora)
        self.lm_hidden[index] = lm_next
        self.residual_hidden[index] = residual_next
        self.prev_patch[index] = patch
        if not early:
            buf.patch(batch).copy_(patch)
        if side is not None:
            main.wait_stream(side)

    def vae_forward(self, buf: DecodeBuffers, batch: int) -> None:
        """The VAE decode of the patches in the VAE's input buffers (graph body, replayed on the VAE stream)."""
        buf.audio[:batch] = self.decode_audio(buf.vae_index[:batch], self.latents(buf.vae_patch[:batch, None]))
