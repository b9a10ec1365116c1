"""When the one-row decode chain runs as weight-streaming kernels chained by programmatic dependent launch (PDL).

Why: at c=1 the base and residual LMs run one activation row through 36 layers of ~94 MB each. As separate kernels
(cuBLAS GEMMs, the skinny gate/up kernel, add + RMSNorm, attention) every projection paid its own ramp and tail: the
HBM stream stopped at each kernel boundary. With PDL a kernel starts while the one before it still runs
(`gdc_launch_dependents` at its start), and the GEMV kernel (`triton_kernels.gemv`) loads its whole weight slice into
registers before it waits (`gdc_wait`) for the activations, so the next projection's weights stream while the
previous kernel finishes. H100, 28 LM-shaped layers without attention (`tools/bench_pdl_chain.py`): 48.6 us per layer
on the engine's kernels, 42.3 with the GEMV alone, 36.7 with the GEMV chained by PDL; at 8 rows the GEMV's fp32 FMA
reduction is slower than the tensor-core kernels (75 against 49 us), so it serves up to `gemv_max_rows` rows
(EngineOptions).

Which kernel lets the next one start at once (H100, B=1 step, `tools/profile_step.py`): the GEMVs and the add +
RMSNorm do (the norm without it: 5.73 ms against 5.69); the decode attention does not (with it: 5.73 against 5.68 ms:
the o projection's weight stream would queue ahead of the attention's own latency-bound loads), and instead prefetches
its cached keys and values into L2 while it waits for q/k/v. Tried and dropped: 8 warps per GEMV program (5.75 ms),
the DiT's and LocEnc's cooperative layer kernels chained the same way (DiT 3.42 -> 3.75 ms); the attention letting the
o projection start after its key loop (no change); and above one row (docs/benchmarks.md, session 16) the local
modules' layers as a chain of separate kernels on a tensor-core GEMV (DiT 37.7 against the layer kernel's 29.6 us per
layer) and PDL for the kernels between cuBLAS GEMMs (B=8 DiT 4.67 -> 4.92 ms).

Correctness: a kernel launched with PDL reads nothing another kernel writes before its `gdc_wait` (only its weights),
and writes nothing before it; `gdc_wait` returns once the kernel before it has completed and its writes are visible,
and that kernel waited for its own predecessor the same way, so stream order holds. A kernel before the chain that
never triggers (cuBLAS, a copy) simply lets the next one start when it ends.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.options import current

if TYPE_CHECKING:
    import torch
else:
    from engine.lazy_torch import torch  # the kernel-compiling children never load it

_capable: dict[int, bool] = {}


def _device_capable(device: torch.device) -> bool:
    """griddepcontrol is Hopper's (sm_90) and newer; ROCm has no PDL."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _capable:
        _capable[index] = torch.version.hip is None and torch.cuda.get_device_capability(index)[0] >= 9
    return _capable[index]


def launch(x: torch.Tensor, rows: int) -> bool:
    """Whether a kernel of this call over `rows` activation rows is launched with PDL (its constexpr PDL and the
    launch option): the one-row chain on a GPU that has it, never in the interpreter."""
    o = current()
    return o.pdl and 0 < rows <= o.gemv_max_rows and x.is_cuda and _device_capable(x.device)


def option(chained: bool) -> dict[str, bool]:
    """The launch option of a kernel chained by PDL, to pass beside its constexpr PDL (none otherwise: the
    interpreter takes no such option)."""
    return {"launch_pdl": True} if chained else {}
