"""The model's input sequence for each conditioning mode, laid out as the official package lays it out.

zero-shot / voice design:  text(target) 101
continuation:              text(prompt_text + target) 101 [prompt patches]
reference (VoxCPM2):       103 [reference patches] 104 text(target) 101
reference + continuation:  103 [reference patches] 104 text(prompt_text + target) 101 [prompt patches]
Audio positions carry token id 0 and a latent patch; the others carry text ids and zero features.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from engine import vocabulary
from engine.config import VoxCPMConfig
from engine.errors import RequestError
from engine.io.tokenizer import TextTokenizer, text_tokens
from engine.models.voxcpm import AUDIO_START_TOKEN, REF_AUDIO_END_TOKEN, REF_AUDIO_START_TOKEN
from engine.vocabulary import TextIds


class PromptError(ValueError):
    """A request's conditioning cannot be turned into a model input; the message names the field."""


@dataclass
class Prompt:
    token_ids: list[int]  # (T,)
    feats: torch.Tensor  # (T, P, D) float32; zeros at text positions (a broadcast view for a text-only prompt)
    audio_mask: torch.Tensor  # (T,) bool
    target_tokens: int  # number of text tokens of the target text alone (caps generation length)
    context: torch.Tensor  # (C, P, D) last prompt patches, decoded as VAE left context then cut
    # The voice's tokens by the request field they came from (prompt_text, prompt_latents, ref_latents): an over-long
    # prompt's error names the longest part.
    voice_tokens: dict[str, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.token_ids)


def latents_to_patches(latents: torch.Tensor, cfg: VoxCPMConfig, field: str) -> torch.Tensor:
    """(frames, feat_dim) latents -> (frames / P, P, feat_dim) patches."""
    if latents.dim() != 2 or latents.shape[1] != cfg.feat_dim:
        raise PromptError(f"{field}: must have shape (frames, {cfg.feat_dim}), got {tuple(latents.shape)}")
    if latents.shape[0] == 0 or latents.shape[0] % cfg.patch_size:
        raise PromptError(f"{field}: must hold a positive multiple of patch_size={cfg.patch_size} frames, "
                          f"got {latents.shape[0]}")
    if not torch.isfinite(latents).all():
        raise PromptError(f"{field}: contains NaN or infinite values")
    return latents.float().reshape(-1, cfg.patch_size, cfg.feat_dim)


def build_prompt(tokenizer: TextTokenizer, cfg: VoxCPMConfig, target_text: str, prompt_text: str = "",
                 prompt_latents: torch.Tensor | None = None,
                 ref_latents: torch.Tensor | None = None, text_ids: TextIds | None = None) -> Prompt:
    """The model's input for one request. `text_ids`: the text already tokenized by the client (taken as its ids;
    checked to be ids of this vocabulary, present where the request needs them); otherwise it is tokenized here."""
    if not target_text.strip():
        raise PromptError("target_text: must contain non-space characters")
    if (prompt_latents is None) != (not prompt_text):
        raise PromptError("prompt_text: the transcript and the prompt audio/latents must be given together")
    if ref_latents is not None and cfg.version < 2:
        raise PromptError("ref_audio: reference audio is only supported by VoxCPM2 models")
    p, d = cfg.patch_size, cfg.feat_dim
    ids: list[int] = []
    feats: list[torch.Tensor] = []
    audio: list[slice] = []  # the audio positions' ranges (a mask from a list of bools costs ~1 us a token)

    def add_text(tokens: list[int]) -> None:
        ids.extend(tokens)
        # Text rows' features are zeros: one row broadcast, not a fresh (T, P, D) fill. A worker builds a burst's
        # prompts one after another before its first step, and on a GPU host's VM ~200 KB of new zeroed pages cost
        # ~45 us a request; what reads them (block hashes, the prefill's inputs) reads audio rows and the last row.
        feats.append(torch.zeros(1, p, d).expand(len(tokens), p, d))

    def add_audio(patches: torch.Tensor) -> None:
        audio.append(slice(len(ids), len(ids) + len(patches)))
        ids.extend([0] * len(patches))
        feats.append(patches)

    voice: dict[str, int] = {}
    if ref_latents is not None:
        add_text([REF_AUDIO_START_TOKEN])
        add_audio(latents_to_patches(ref_latents, cfg, "ref_audio_latents"))
        add_text([REF_AUDIO_END_TOKEN])
        voice["ref_latents"] = len(feats[-2])
    if text_ids is None:
        target_ids, both = text_tokens(tokenizer, target_text, prompt_text, prompt_latents is not None)
    else:
        target_ids, both = text_ids.target, text_ids.text
        given = (*target_ids, *(both or ()))
        # Each an int (not a bool or a float) of the vocabulary, checked at C speed: a worker checks a burst's requests
        # one after another before its first step (a 230-token request: 31 us as a generator, 15 us so; CI VM).
        if ((prompt_latents is not None) != (both is not None) or not target_ids or set(map(type, given)) != {int}
                or min(given) < 0 or max(given) >= cfg.lm.vocab_size):
            raise PromptError("text_ids: not this request's text tokenized for this model")
    add_text((both if both is not None else target_ids) + [AUDIO_START_TOKEN])
    context = torch.zeros(0, p, d)
    if prompt_latents is not None:
        patches = latents_to_patches(prompt_latents, cfg, "prompt_latents")
        add_audio(patches)
        context = patches[-cfg.decode_context_patches:]
        voice["prompt_text"] = max(0, len(both or ()) - len(target_ids))  # (tokenized together: about its share)
        voice["prompt_latents"] = len(patches)
    audio_mask = torch.zeros(len(ids), dtype=torch.bool)
    for rows in audio:
        audio_mask[rows] = True
    return Prompt(token_ids=ids, feats=feats[0] if len(feats) == 1 else torch.cat(feats), audio_mask=audio_mask,
                  target_tokens=len(target_ids), context=context, voice_tokens=voice)


def max_patches(prompt: Prompt, max_generate_length: int) -> int:
    """The official cap (`vocabulary.max_patches`) for this prompt's target text."""
    return vocabulary.max_patches(prompt.target_tokens, max_generate_length)


def latents_tensor(latents: np.ndarray | bytes | None, feat_dim: int, field_name: str) -> torch.Tensor | None:
    """Latents as float32 bytes or a (frames, feat_dim) array -> float32 tensor (a RequestError naming the field
    otherwise)."""
    if latents is None:
        return None
    if isinstance(latents, bytes | bytearray | memoryview):
        raw = bytes(latents)
        if not raw or len(raw) % (4 * feat_dim):
            raise RequestError(f"{field_name}: float32 bytes must be a positive multiple of 4 * feat_dim = "
                               f"{4 * feat_dim} bytes, got {len(raw)}")
        latents = np.frombuffer(raw, dtype=np.float32).reshape(-1, feat_dim)
    if not isinstance(latents, np.ndarray) or latents.ndim != 2 or latents.shape[1] != feat_dim or not len(latents):
        shape = getattr(latents, "shape", type(latents).__name__)
        raise RequestError(f"{field_name}: must be float32 latents shaped (frames, {feat_dim}), got {shape}")
    return torch.from_numpy(np.array(latents, dtype=np.float32))  # a copy: the message buffer is not ours
