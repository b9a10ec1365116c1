"""`bench.py kernels --only vae`: the streaming VAE decoder's residual units at a step's shapes, kernel by kernel.

For each decoder block's three residual units (its channels, a patch's samples at its rate, dilations 1 / 3 / 9) and
each batch: the depthwise conv kernel as the decoder runs it (both Snakes, every stream's context read and replaced in
place), without the Snake on its input (what recomputing that Snake on every tap costs), without either Snake (the
conv alone), with other time blocks and rows a program; the 1x1 conv + residual GEMM after it; and a copy of x as the
memory floor of one read and one write of the unit's activations. Times: CUDA-graph replays, microseconds.
"""

from __future__ import annotations

import json
from functools import partial
from unittest import mock

import torch

from engine.config import AudioVAEConfig, VoxCPMConfig
from engine.ops import platform, vae_conv
from tools.profiling.step import graph_ms

DILATIONS = (1, 3, 9)
KERNEL_TAPS = 7


def unit_shapes(cfg: VoxCPMConfig) -> list[tuple[int, int]]:
    """(channels, samples of one step's patch) at each decoder block's output, where its residual units run."""
    vae = AudioVAEConfig.from_dict(cfg.audio_vae, cfg.version)
    shapes, length, channels = [], cfg.patch_size, vae.decoder_dim
    for rate in vae.decoder_rates:
        length, channels = length * rate, channels // 2
        shapes.append((channels, length))
    return shapes


def bench_vae(cfg: VoxCPMConfig, batches: list[int], dev: torch.device) -> list[dict]:
    """One row per batch, block and dilation (fp32, the decoder's dtype by default); prints each batch's sums."""
    rows: list[dict] = []
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32  # the 1x1 GEMMs as the CUDA runner has them
    for b in batches:
        sums: dict[str, float] = {}
        for channels, length in unit_shapes(cfg):
            for dilation in DILATIONS:
                pad = (KERNEL_TAPS - 1) * dilation
                x = torch.randn(b, channels, length, device=dev)
                state = torch.randn(b, channels, pad, device=dev)
                slots = torch.arange(b, device=dev, dtype=torch.int32)
                weight = torch.randn(channels, 1, KERNEL_TAPS, device=dev) * 0.3
                bias = torch.randn(channels, device=dev)
                alpha1, alpha2 = (torch.rand(1, channels, 1, device=dev) + 0.5 for _ in range(2))
                conv = partial(vae_conv.causal_depthwise_conv, x, state, weight, bias, dilation, slots=slots)
                h, _ = conv(alpha2, in_alpha=alpha1)
                pointwise = torch.randn(channels, channels, 1, device=dev) * channels ** -0.5
                residual = torch.empty_like(x)
                y = torch.empty_like(x)
                runs = {"dwconv": partial(conv, alpha2, in_alpha=alpha1),
                        "dwconv_out_snake_only": partial(conv, alpha2),
                        "dwconv_no_snake": partial(conv, None),
                        "pointwise_residual": lambda h=h, w=pointwise, r=residual, x=x: (
                            r.copy_(x), vae_conv.pointwise_conv_residual(h, w, None, r)),
                        "copy_of_x": lambda x=x, y=y: y.copy_(x)}
                row: dict[str, object] = {"batch": b, "channels": channels, "samples": length, "dilation": dilation,
                                          "mb_of_x": round(x.numel() * 4 / 2 ** 20, 1)}
                for name, fn in runs.items():
                    row[f"{name}_us"] = round(1000 * graph_ms(fn, reps=50), 2)
                for time_block, tile in ((128, 1024), (256, 1024), (64, 2048), (128, 2048), (256, 4096)):
                    with (mock.patch.object(vae_conv, "DWCONV_TIME_BLOCK", time_block),
                          mock.patch.object(platform, "ROW_TILE_ELEMENTS", tile)):
                        row[f"dwconv_block_{time_block}_tile_{tile}_us"] = round(
                            1000 * graph_ms(partial(conv, alpha2, in_alpha=alpha1), reps=50), 2)
                for key, value in row.items():
                    if key.endswith("_us"):
                        sums[key] = round(sums.get(key, 0.0) + float(value), 1)  # type: ignore[arg-type]
                rows.append(row)
        print(f"vae B={b} sums over the residual units:", json.dumps(sums), flush=True)
        rows.append({"batch": b, "sums_us": sums})
    return rows
