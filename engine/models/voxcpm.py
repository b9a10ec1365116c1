"""The VoxCPM backbone shared by every family: text-semantic LM, FSQ, residual acoustic LM, local
encoder (LocEnc), local DiT with a CFM Euler sampler, and the stop head.

A family subclass (voxcpm1.py, voxcpm2.py) only says how the residual LM input and the DiT condition
are formed. Everything here works on batches: `prefill` takes the flattened tokens of several
sequences; a decode step of B sequences is `sample_patch`, `stop_flags`, `encode_patches` and `advance_lms`, which the
runner composes (and places on two CUDA streams); attention goes through the `attend` functions of the paged KV
cache, so the module holds no per-request state.
Module and parameter names equal the official checkpoint's keys.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import TransformerConfig, VoxCPMConfig
from engine.models.minicpm import AttendFn, MiniCPM, rotary_table
from engine.ops import cfg_euler
from engine.ops.lora import LoRAContext

AUDIO_START_TOKEN = 101
REF_AUDIO_START_TOKEN = 103
REF_AUDIO_END_TOKEN = 104


class ScalarQuantization(nn.Module):
    """FSQ bottleneck on the base LM's audio positions: round(tanh(W h) * scale) / scale, projected back."""

    def __init__(self, hidden: int, latent: int, scale: int) -> None:
        super().__init__()
        self.in_proj = nn.Linear(hidden, latent)
        self.out_proj = nn.Linear(latent, hidden)
        self.scale = scale

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.round(torch.tanh(self.in_proj(h)) * self.scale) / self.scale)


class LocEnc(nn.Module):
    """Encodes one patch (P latent frames) into one LM embedding: a learned token is prepended and its
    output (index 0) of a small bidirectional transformer is the embedding."""

    def __init__(self, cfg: TransformerConfig, feat_dim: int) -> None:
        super().__init__()
        self.special_token = nn.Parameter(torch.zeros(1, 1, 1, cfg.hidden_size))
        self.in_proj = nn.Linear(feat_dim, cfg.hidden_size)
        self.encoder = MiniCPM(cfg)

    def forward(self, patches: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        """patches: (N, P, D) -> (N, hidden)."""
        x = self.in_proj(patches)
        x = torch.cat((self.special_token[0, 0].expand(x.shape[0], 1, -1), x), dim=1)
        return self.encoder.forward_local(x, rope)[:, 0]


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal embedding of diffusion time (scale 1000), computed in t's dtype like the official."""
    half = dim // 2
    freqs = torch.exp(torch.arange(half, dtype=t.dtype, device=t.device) * -(math.log(10000) / (half - 1)))
    arg = 1000 * t.unsqueeze(1) * freqs.unsqueeze(0)
    return torch.cat((arg.sin(), arg.cos()), dim=-1)


class TimestepMLP(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(hidden, hidden)
        self.linear_2 = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


class LocDiT(nn.Module):
    """Velocity estimator over [condition tokens, time token, previous patch, noisy patch].

    VoxCPM1 adds the time embedding to its single condition token; VoxCPM2 feeds two condition
    tokens (LM and residual LM) followed by a separate time token.
    """

    def __init__(self, cfg: TransformerConfig, feat_dim: int, condition_tokens: int) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.in_proj = nn.Linear(feat_dim, h)
        self.cond_proj = nn.Linear(feat_dim, h)
        self.out_proj = nn.Linear(h, feat_dim)
        self.time_mlp = TimestepMLP(h)
        self.delta_time_mlp = TimestepMLP(h)
        self.decoder = MiniCPM(cfg)
        self.hidden = h
        self.condition_tokens = condition_tokens

    def time_embedding(self, t: torch.Tensor, dt: torch.Tensor) -> torch.Tensor:
        """(N,) diffusion times and step sizes -> (N, hidden) time token."""
        dtype = self.in_proj.weight.dtype
        temb = self.time_mlp(timestep_embedding(t, self.hidden).to(dtype))
        return temb + self.delta_time_mlp(timestep_embedding(dt, self.hidden).to(dtype))

    def forward(self, x: torch.Tensor, mu: torch.Tensor, t: torch.Tensor, cond: torch.Tensor, dt: torch.Tensor,
                rope: torch.Tensor) -> torch.Tensor:
        """x, cond: (N, D, P); mu: (N, tokens * hidden); t, dt: (N,) -> velocity (N, D, P)."""
        return self.velocity(x, mu, self.time_embedding(t, dt), cond, rope)

    def velocity(self, x: torch.Tensor, mu: torch.Tensor, temb: torch.Tensor, cond: torch.Tensor,
                 rope: torch.Tensor) -> torch.Tensor:
        """forward() with the time token already embedded: temb (N or 1, hidden)."""
        return self.velocity_after(x, self.leading_tokens(mu, temb.unsqueeze(0), cond)[0], rope)

    def leading_tokens(self, mu: torch.Tensor, tembs: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        """The sequence before the noisy patch, for each time token: condition token(s) with the time token, then
        the previous patch. mu (N, tokens * hidden); tembs (S, hidden) (or (S, N, hidden)); cond (N, D, P) ->
        (S, N, tokens [+ 1] + P, hidden). The sampler builds them once for all its steps: only the time token
        changes from one step to the next."""
        n, steps = mu.shape[0], tembs.shape[0]
        cond = self.cond_proj(cond.transpose(1, 2)).expand(steps, -1, -1, -1)
        tembs = tembs.view(steps, -1, self.hidden).expand(steps, n, self.hidden)
        if self.condition_tokens == 1:
            prefix = (mu + tembs).unsqueeze(2)
        else:
            prefix = torch.cat((mu.view(1, n, self.condition_tokens, self.hidden).expand(steps, -1, -1, -1),
                                tembs.unsqueeze(2)), dim=2)
        return torch.cat((prefix, cond), dim=2)

    def euler_step(self, x: torch.Tensor, leading: torch.Tensor, rope: torch.Tensor, cfg: torch.Tensor,
                   dt: float) -> torch.Tensor:
        """One guided Euler step of the noisy patch x (B, D, P): the velocities of its conditional and unconditional
        copies after `leading` (2B, T, hidden), then `cfg_euler_step` (on CUDA the DiT's input and its output
        projection with the step are one kernel each)."""
        seq = cfg_euler.dit_input(x, leading, self.in_proj)
        h = self.decoder.forward_local(seq, rope[: seq.shape[1]], keep=slice(leading.shape[1], None))
        return cfg_euler.dit_output_euler(h, self.out_proj, x, cfg, dt)

    def velocity_after(self, x: torch.Tensor, leading: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        """The velocity of the noisy patch x (N, D, P) after one step's `leading_tokens` (N, T, hidden)."""
        seq = torch.cat((leading, self.in_proj(x.transpose(1, 2))), dim=1)
        h = self.decoder.forward_local(seq, rope[: seq.shape[1]], keep=slice(leading.shape[1], None))
        return self.out_proj(h).transpose(1, 2)


def _version(t: torch.Tensor) -> int:
    """A tensor's in-place modification counter (-1 for an inference tensor, which has none)."""
    return -1 if t.is_inference() else t._version


@lru_cache(maxsize=16)
def euler_schedule(n_timesteps: int, dtype: torch.dtype) -> tuple[list[tuple[float, float]], int]:
    """(t, dt) of each Euler step with the official sway schedule, rounded in `dtype` exactly as the
    official sampler's scalar tensor arithmetic rounds them; and how many first steps use zero velocity."""
    span = torch.linspace(1, 0, n_timesteps + 1, dtype=dtype)
    span = span + (torch.cos(torch.pi / 2 * span) - 1 + span)
    t, dt = span[0], span[0] - span[1]
    steps = []
    for step in range(1, n_timesteps + 1):
        steps.append((t.item(), dt.item()))
        t = t - dt
        if step < n_timesteps:
            dt = t - span[step + 1]
    return steps, max(1, int((n_timesteps + 1) * 0.04))


class FlowSampler(nn.Module):
    """CFM Euler solver with classifier-free guidance (CFG-zero* scale), batched with per-row cfg."""

    def __init__(self, estimator: LocDiT, mean_mode: bool) -> None:
        super().__init__()
        self.estimator = estimator
        self.mean_mode = mean_mode
        # The time tokens of a schedule, by (steps, dtype, device): see `time_tokens`.
        self._time_tokens: dict[tuple, tuple[tuple[int, ...], torch.Tensor]] = {}

    def time_tokens(self, n_timesteps: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """(S, hidden) time tokens of the schedule's S non-zero steps. They depend on the schedule and the time MLPs'
        weights only, so they are computed once, not in every step, where their ~25 small kernels (fills, sinusoids,
        four GEMMs) would cost a B=1 step more than many of its layers. Recomputed when a time MLP weight is replaced
        or changed in place (its version counter moves); never stored from inside a CUDA graph capture, whose memory is
        the graph's (the engine's warm-up runs every shape eagerly first)."""
        weights = [p for mlp in (self.estimator.time_mlp, self.estimator.delta_time_mlp) for p in mlp.parameters()]
        version = tuple(v for p in weights for v in (id(p), p.data_ptr(), _version(p)))
        key = (n_timesteps, dtype, device)
        cached = self._time_tokens.get(key)
        if cached is not None and cached[0] == version:
            return cached[1]
        steps, zero_steps = euler_schedule(n_timesteps, dtype)
        active = steps[zero_steps:]
        # (torch.full, not torch.tensor: no host-to-device copy inside a CUDA graph capture.)
        def scalars(values: list[float]) -> torch.Tensor:
            return torch.stack([torch.full((), v, dtype=dtype, device=device) for v in values])

        tokens = self.estimator.time_embedding(scalars([t for t, _ in active]),
                                               scalars([dt if self.mean_mode else 0.0 for _, dt in active]))
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if not capturing:
            self._time_tokens[key] = (version, tokens)
        return tokens

    def forward(self, mu: torch.Tensor, cond: torch.Tensor, noise: torch.Tensor, cfg_value: torch.Tensor,
                n_timesteps: int, rope: torch.Tensor) -> torch.Tensor:
        """mu (B, C); cond, noise (B, D, P) (noise already scaled by temperature); cfg_value (B,)."""
        b = mu.shape[0]
        x = noise
        steps, zero_steps = euler_schedule(n_timesteps, mu.dtype)
        mu_in = torch.cat((mu, torch.zeros_like(mu)))  # second half: unconditional
        cond_in = torch.cat((cond, cond))
        cfg = cfg_value.to(mu.dtype).view(b, 1, 1)
        active = steps[zero_steps:]
        # Everything before the noisy patch, for all steps at once (the condition projection once, not per step).
        leading = (self.estimator.leading_tokens(mu_in, self.time_tokens(n_timesteps, x.dtype, x.device), cond_in)
                   if active else None)
        for step, (_, dt) in enumerate(steps, start=1):
            if step > zero_steps:
                x = self.estimator.euler_step(x, leading[step - zero_steps - 1], rope, cfg, dt)
        return x


class VoxCPMBackbone(nn.Module):
    condition_tokens = 1  # DiT condition tokens; VoxCPM2 uses 2
    lora_context: LoRAContext | None = None  # set by the runner's LoRA slots when runtime adapters are enabled

    def __init__(self, cfg: VoxCPMConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h = cfg.lm.hidden_size
        self.base_lm = MiniCPM(cfg.lm)
        self.residual_lm = MiniCPM(cfg.residual_lm)
        self.feat_encoder = LocEnc(cfg.encoder, cfg.feat_dim)
        self.feat_decoder = FlowSampler(LocDiT(cfg.dit, cfg.feat_dim, self.condition_tokens), cfg.dit_mean_mode)
        self.fsq_layer = ScalarQuantization(h, cfg.fsq_latent_dim, cfg.fsq_scale)
        self.enc_to_lm_proj = nn.Linear(cfg.encoder.hidden_size, h)
        self.lm_to_dit_proj = nn.Linear(h, cfg.dit.hidden_size)
        self.res_to_dit_proj = nn.Linear(h, cfg.dit.hidden_size)
        self.stop_proj = nn.Linear(h, h)
        self.stop_head = nn.Linear(h, 2, bias=False)
        self.rope_tables: dict[str, torch.Tensor] = {}

    # --- family hooks -------------------------------------------------------------------------
    def residual_input(self, lm_out: torch.Tensor, audio_embed: torch.Tensor) -> torch.Tensor:
        """Residual LM input from the (FSQ'd) base LM output and the masked audio embedding."""
        raise NotImplementedError

    def dit_condition(self, lm_hidden: torch.Tensor, residual_hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    # --- set-up -------------------------------------------------------------------------------
    def setup_rope(self, max_positions: int, device: torch.device | str) -> None:
        """Precompute rotary rows: LM positions up to max_positions, local modules' short spans."""
        p = self.cfg.patch_size
        self.rope_tables = {
            "lm": rotary_table(self.cfg.lm, max_positions).to(device),
            "enc": rotary_table(self.cfg.encoder, p + 1).to(device),
            "dit": rotary_table(self.cfg.dit, p * 2 + 3).to(device),  # sliced to the family's length
        }

    @contextlib.contextmanager
    def lora_rows(self, slots: torch.Tensor | None) -> Iterator[None]:
        """Within it, the adapted layers' rows use the LoRA slots `slots` (one per leading row of their input, -1:
        none); without runtime adapters (or slots) nothing changes."""
        ctx = self.lora_context
        if ctx is None or slots is None:
            yield
            return
        before = ctx.mask, ctx.slots
        ctx.mask, ctx.slots = ctx.rows(slots, self.stop_head.weight.dtype), slots
        try:
            yield
        finally:
            ctx.mask, ctx.slots = before

    # --- pieces -------------------------------------------------------------------------------
    def encode_patches(self, patches: torch.Tensor, lora_slots: torch.Tensor | None = None) -> torch.Tensor:
        """(N, P, D) latent patches -> (N, H) LM input embeddings (lora_slots: (N,) each patch's adapter slot)."""
        with self.lora_rows(lora_slots):
            return self.enc_to_lm_proj(self.feat_encoder(patches.to(self.stop_head.weight.dtype),
                                                         self.rope_tables["enc"]))

    def stop_logits(self, lm_hidden: torch.Tensor) -> torch.Tensor:
        return self.stop_head(F.silu(self.stop_proj(lm_hidden)))

    def sample_patch(self, lm_hidden: torch.Tensor, residual_hidden: torch.Tensor, prev_patch: torch.Tensor,
                     noise: torch.Tensor, cfg_value: torch.Tensor, n_timesteps: int,
                     lora_slots: torch.Tensor | None = None) -> torch.Tensor:
        """One CFM solve: (B, P, D) patch conditioned on both LMs and the previous patch (lora_slots: (B,))."""
        with self.lora_rows(lora_slots):
            mu = self.dit_condition(lm_hidden, residual_hidden)
        cond = prev_patch.to(mu.dtype).transpose(1, 2)
        halves = torch.cat((lora_slots, lora_slots)) if lora_slots is not None else None  # CFG's two halves
        with self.lora_rows(halves):
            x = self.feat_decoder(mu, cond, noise.to(mu.dtype), cfg_value, n_timesteps, self.rope_tables["dit"])
        return x.transpose(1, 2)

    # --- runtime entry points -----------------------------------------------------------------
    def prefill(self, token_ids: torch.Tensor, audio_feats: torch.Tensor, audio_mask: torch.Tensor,
                positions: torch.Tensor, last_rows: torch.Tensor, base_attend: AttendFn,
                residual_attend: AttendFn, lora_slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the prompt tokens of several sequences (flattened, T rows) through both LMs, filling
        their KV caches. token_ids (T,), audio_mask (T,) bool, audio_feats (K, P, D) the features of its K
        audio rows in row order, positions (T,), last_rows (B,) index of each sequence's last token.
        Returns lm and residual hidden (B, H). lora_slots (T,): each row's adapter slot."""
        weight = self.base_lm.embed_tokens.weight
        audio_embed = torch.zeros(len(token_ids), weight.shape[1], dtype=weight.dtype, device=token_ids.device)
        audio_rows = audio_mask.nonzero().squeeze(1)
        if audio_rows.numel():
            audio_embed[audio_rows] = self.encode_patches(
                audio_feats, lora_slots[audio_rows] if lora_slots is not None else None).to(audio_embed.dtype)
        return self.prefill_lms(token_ids, audio_embed, audio_mask, positions, last_rows, base_attend,
                                residual_attend, lora_slots)

    def prefill_lms(self, token_ids: torch.Tensor, audio_embed: torch.Tensor, audio_mask: torch.Tensor,
                    positions: torch.Tensor, last_rows: torch.Tensor, base_attend: AttendFn,
                    residual_attend: AttendFn,
                    lora_slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`prefill` after LocEnc: audio_embed (T, H) holds the encoded patches at the audio rows and zeros elsewhere
        (a graphed prefill runs LocEnc on the audio rows alone, beside it)."""
        embeds = self.base_lm.embed_tokens(token_ids) * self.cfg.scale_emb
        embeds = torch.where(audio_mask[:, None], audio_embed, embeds)
        rope = self.rope_tables["lm"][positions]
        with self.lora_rows(lora_slots):
            lm_out = self.base_lm(embeds, rope, base_attend)
            lm_out = torch.where(audio_mask[:, None], self.fsq_layer(lm_out), lm_out)
            residual_out = self.residual_lm(self.residual_input(lm_out, audio_embed), rope, residual_attend)
        return lm_out[last_rows], residual_out[last_rows]

    def stop_flags(self, lm_hidden: torch.Tensor) -> torch.Tensor:
        """(B,) bool: whether the stop head fires on the hidden state the patch was sampled from."""
        return self.stop_logits(lm_hidden).argmax(-1) == 1

    def advance_lms(self, embed: torch.Tensor, positions: torch.Tensor, base_attend: AttendFn,
                    residual_attend: AttendFn,
                    lora_slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The new patches' LM embeddings (B, H, from `encode_patches`) through both LMs at `positions`: their next
        hidden states (lora_slots: (B,))."""
        rope = self.rope_tables["lm"][positions]
        with self.lora_rows(lora_slots):
            lm_next = self.fsq_layer(self.base_lm(embed, rope, base_attend))
            return lm_next, self.residual_lm(self.residual_input(lm_next, embed), rope, residual_attend)
