"""When the one-row decode chain runs as weight-streaming kernels chained by programmatic dependent launch (PDL).

Why: at c=1 the base and residual LMs run one activation row through every layer, and as separate kernels each
projection pays its own ramp and tail: the HBM stream stops at each kernel boundary. With PDL a kernel starts while
the one before it still runs (`gdc_launch_dependents` at its start), and the GEMV kernel (`engine.ops.gemv`) loads
its whole weight slice into registers before it waits (`gdc_wait`) for the activations, so the next projection's
weights stream while the previous kernel finishes. Above `gemv_max_rows` rows (EngineOptions) the tensor-core GEMMs
win, so the chain stops there. The GEMVs and the add + RMSNorm let the next kernel start at once; the decode attention
does not (the o projection's weight stream would queue ahead of its own latency-bound loads) and instead prefetches its
cached keys and values into L2 while it waits. The measurements behind these choices are in docs/benchmarks.md
(`VOXCPM_PDL`, `VOXCPM_GEMV_MAX_ROWS`).

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
