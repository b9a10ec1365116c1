"""The causal layers of the audio VAE, shared by its encoder and decoder, and the stream states they carry.

Every layer takes `(x, states=None)`: with states=None it is the plain full-sequence forward; with stream states,
stateful layers read and replace their slot (causal context), which makes a chunk-wise decode equal the
full-sequence one. On CUDA the upsampler and each residual unit run as the kernels of `engine.ops` where those apply
(the modules' own convolutions are the eager path).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.ops import platform, upsampler, vae_conv
from engine.ops.snake import snake
from engine.options import batch_invariant


class SlotStates:
    """A batch's stream states kept in per-slot buffers: buffers[i] is (slots, channels, context) for stateful layer
    i, and batch row b's stream is slot index[b]. Layers read and replace a layer's states as with a list (a gather,
    then a scatter of the new context); the fused depthwise conv reads and writes its buffer in place instead."""

    def __init__(self, buffers: list[Tensor], index: Tensor) -> None:
        self.buffers, self.index = buffers, index

    def __getitem__(self, i: int) -> Tensor:
        return self.buffers[i][self.index]

    def __setitem__(self, i: int, value: Tensor) -> None:
        self.buffers[i][self.index] = value


# Stream state: one tensor per stateful decoder layer, indexed by that layer's `state_slot`. Every
# tensor is [batch, channels, context] with batch first, so several streams can later be decoded
# together by concatenating / indexing the per-slot tensors along dim 0 (or `SlotStates`: the same, read from and
# written to per-slot buffers).
StreamStates = list[Tensor] | SlotStates


def layer_context(states: StreamStates | None, slot: int | None) -> tuple[Tensor | None, Tensor | None]:
    """A stateful layer's (context, slots) for a kernel: with per-slot buffers the layer's whole buffer and the
    batch's slots (the kernel reads and replaces those rows in place), else the batch's contexts and None; (None,
    None) when not streaming."""
    if states is None or slot is None:
        return None, None
    if isinstance(states, SlotStates):
        return states.buffers[slot], states.index
    return states[slot], None


def derived_weight(module: nn.Module, layout: str, make: Callable[[Tensor], Tensor], dtype: torch.dtype) -> Tensor:
    """`make(module.weight)` (named `layout`) in `dtype`, contiguous and detached, made once per weight version,
    layout and dtype (a kernel path's layout or GEMM operand dtype of the weight; the last one made is kept)."""
    key = (module.weight.data_ptr(), module.weight._version, layout, dtype)
    cached = module.__dict__.get("_derived_weight")
    if cached is None or cached[0] != key:
        cached = (key, make(module.weight.detach()).to(dtype).contiguous())
        module.__dict__["_derived_weight"] = cached
    return cached[1]


class CausalConv1d(nn.Conv1d):
    """Conv1d left-padded by `left_pad` zeros; in streaming the zeros are replaced by the carried tail
    of the previous input, which makes chunked output identical to the full-sequence output."""

    def __init__(self, in_ch: int, out_ch: int, kernel_size: int, *, left_pad: int, stride: int = 1,
                 dilation: int = 1, groups: int = 1, bias: bool = True) -> None:
        super().__init__(in_ch, out_ch, kernel_size, stride=stride, dilation=dilation, groups=groups,
                         bias=bias)
        self.left_pad = left_pad
        self.state_slot: int | None = None  # assigned by the decoder for stateful layers

    def state_shape(self) -> tuple[int, int] | None:
        return (self.in_channels, self.left_pad) if self.left_pad > 0 else None

    def forward(self, x: Tensor, states: StreamStates | None = None) -> Tensor:
        if states is None or self.state_slot is None:
            x = F.pad(x, (self.left_pad, 0))
        else:
            assert self.stride[0] == 1, "streaming assumes stride-1 convs (true for every decoder conv)"
            x = torch.cat([states[self.state_slot], x], dim=-1)
            states[self.state_slot] = x[..., x.shape[-1] - self.left_pad:]
        return F.conv1d(x, self.weight, self.bias, self.stride, 0, self.dilation, self.groups)


class CausalConvTranspose1d(nn.ConvTranspose1d):
    """Upsampling transposed conv whose right `right_trim` outputs are cut so output = T * stride.

    Output frame t depends on input frames t - ctx .. t with ctx = (kernel - 1) // stride, so the
    streaming state is the last `ctx` input frames (zeros at start, which equals no contribution).
    """

    def __init__(self, in_ch: int, out_ch: int, kernel_size: int, stride: int, right_trim: int) -> None:
        super().__init__(in_ch, out_ch, kernel_size, stride=stride)
        # Streaming slices [ctx*s, ctx*s + T*s); that equals the trimmed full output only if the trim
        # removes exactly the kernel overhang. Holds for the official kernel=2*stride layout.
        assert right_trim == kernel_size - stride, "unsupported transposed-conv geometry"
        self.right_trim = right_trim
        self.context = (kernel_size - 1) // stride
        self.state_slot: int | None = None

    def state_shape(self) -> tuple[int, int] | None:
        return (self.in_channels, self.context) if self.context > 0 else None

    def tap_weight(self, dtype: torch.dtype) -> Tensor:
        """The weight as (K * C_out, C_in) in `dtype`, rows ordered (tap, channel), for
        `upsampler.causal_conv_transpose` (beside VoxCPM2's own fp32 upsamplers, ~165 MB: ~83 MB as fp16 operands,
        ~165 MB in fp32)."""
        c_in = self.in_channels
        return derived_weight(self, "taps", lambda w: w.permute(2, 1, 0).reshape(-1, c_in), dtype)

    def forward(self, x: Tensor, states: StreamStates | None = None) -> Tensor:  # type: ignore[override]
        stride = self.stride[0]
        streaming = states is not None and self.state_slot is not None
        # The kernel path's GEMM carries the batch in its columns: in CUDA's batch-invariant mode the conv runs per
        # sample instead.
        if platform.kernels(x) and not (x.is_cuda and batch_invariant("cuda")):
            state, slots = layer_context(states, self.state_slot)
            out = upsampler.causal_conv_transpose(x, state, self.tap_weight(vae_conv.gemm_operand_dtype(x)),
                                                  self.bias, stride, self.kernel_size[0], slots)
            if out is not None:
                y, new_state = out
                if streaming and slots is None:  # (per-slot buffers: the kernel replaced the context in place)
                    states[self.state_slot] = new_state
                return y
        if not streaming:
            y = F.conv_transpose1d(x, self.weight, self.bias, stride)
            return y[..., : y.shape[-1] - self.right_trim]
        n_new = x.shape[-1]
        x = torch.cat([states[self.state_slot], x], dim=-1)
        states[self.state_slot] = x[..., x.shape[-1] - self.context:]
        y = F.conv_transpose1d(x, self.weight, self.bias, stride)
        start = self.context * stride
        return y[..., start: start + n_new * stride]


class Snake1d(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1, channels, 1))

    def forward(self, x: Tensor, states: StreamStates | None = None) -> Tensor:
        return snake(x, self.alpha)


class Chain(nn.ModuleList):
    """Sequential that forwards the stream states; names children 0..n like nn.Sequential."""

    def forward(self, x: Tensor, states: StreamStates | None = None) -> Tensor:
        for layer in self:
            x = layer(x, states)
        return x


class ResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int, groups: int, fp16_gemm: bool = False) -> None:
        super().__init__()
        self.fp16_gemm = fp16_gemm  # the decoder's: its 1x1 conv may take fp16 operands (`gemm_operand_dtype`)
        self.block = Chain([
            Snake1d(dim),
            CausalConv1d(dim, dim, 7, left_pad=6 * dilation, dilation=dilation, groups=groups),
            Snake1d(dim),
            CausalConv1d(dim, dim, 1, left_pad=0),
        ])
        snake1, conv, snake2, pointwise = self.block
        # On CUDA the block runs as two kernels: the depthwise conv with both Snakes, the GEMM + residual.
        self.fusable = (isinstance(snake1, Snake1d) and isinstance(conv, CausalConv1d) and isinstance(snake2, Snake1d)
                        and conv.groups == conv.in_channels == conv.out_channels and conv.stride == (1,)
                        and conv.padding == (0,) and conv.left_pad == (conv.kernel_size[0] - 1) * conv.dilation[0])

    def forward(self, x: Tensor, states: StreamStates | None = None) -> Tensor:
        if self.fusable and platform.kernels(x):
            y = self.forward_deferred(x, states)
            if y is not None:
                out, bias = y
                return out if bias is None else out.add_(bias[:, None])
        return x + self.block(x, states)

    def forward_deferred(self, x: Tensor, states: StreamStates | None,
                         pending: Tensor | None = None) -> tuple[Tensor, Tensor | None] | None:
        """The block in two kernels (see `fusable`) with its output bias left out: for the input x + pending
        (pending: a per-channel bias (C,) not yet added to x, or None), (y, bias) with output = y + bias. None where
        the conv kernel does not apply (nothing consumed). Consumes x (the GEMM adds into it in place): a residual
        unit's input is always an intermediate of the VAE."""
        snake1, conv, snake2, pointwise = self.block
        streaming = states is not None and conv.state_slot is not None
        state, slots = layer_context(states, conv.state_slot)
        if not vae_conv.depthwise_conv_supported(x, state, conv.weight, conv.bias, conv.dilation[0], slots):
            return None
        # the conv writes h as the GEMM reads it
        operand = vae_conv.gemm_operand_dtype(x, pointwise.in_channels) if self.fp16_gemm else x.dtype
        h, new_state = vae_conv.causal_depthwise_conv(x, state, conv.weight, conv.bias, conv.dilation[0], snake2.alpha,
                                                   slots, in_alpha=snake1.alpha, in_shift=pending, out_dtype=operand)
        if streaming and slots is None:
            states[conv.state_slot] = new_state
        weight = (pointwise.weight if operand == pointwise.weight.dtype
                  else derived_weight(pointwise, "cast", lambda w: w, operand))
        out = vae_conv.pointwise_conv_residual(h, weight, None, x)
        bias = pointwise.bias
        return out, (bias if pending is None else pending if bias is None else pending + bias)
