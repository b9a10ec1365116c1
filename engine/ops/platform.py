"""Where the Triton kernels can run: triton importable, a CUDA tensor (or Triton's CPU interpreter, for tests), and
fusion enabled; plus the launch helpers several kernels share."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.options import current

if TYPE_CHECKING:
    import torch
else:
    from engine.lazy_torch import torch  # the kernel-compiling children never load it

try:  # triton is absent on e.g. macOS; the package must still import there
    import triton

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - depends on the platform
    HAVE_TRITON = False

if HAVE_TRITON:
    import triton.language as tl

    @triton.jit
    def _probe() -> None:
        """Never launched: its type says whether `triton.jit` is the interpreter's (TRITON_INTERPRET=1)."""

    @triton.jit
    def row_tile_program(rows, channels, BLOCK_R: tl.constexpr, BLOCK: tl.constexpr):
        """A VAE row kernel's program (grid: `row_tile`'s row tiles x time blocks): its rows (BLOCK_R, 1) as (row,
        stream, channel, row mask) and its samples (1, BLOCK)."""
        bc = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]
        t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)[None, :]
        return bc, bc // channels, bc % channels, bc < rows, t


def interpreted() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1 set before triton was imported)."""
    return HAVE_TRITON and type(_probe).__name__ == "InterpretedFunction"


def usable(x: torch.Tensor) -> bool:
    """Whether the kernels can run on this tensor's device."""
    return HAVE_TRITON and (x.is_cuda or interpreted())


def kernels(x: torch.Tensor) -> bool:
    """Whether the fused ops take their Triton path for this tensor: CUDA, triton importable, EngineOptions.fuse."""
    return current().fuse and x.is_cuda and usable(x)


def fast_sin() -> bool:
    """Snake's sin as the hardware approximation (EngineOptions.fast_sin; its error is far below the TF32
    convolutions'): CUDA libdevice's, so not in the interpreter, not on ROCm."""
    return current().fast_sin and not interpreted() and torch.version.hip is None


MAX_TIME_BLOCK = 1024  # the VAE kernels' samples a row in a program, unless a caller's context needs more


def time_block(length: int, max_block: int = MAX_TIME_BLOCK) -> int:
    """Samples per program along time for the VAE kernels: <= max_block, but few enough blocks for grid axis 1
    (< 65536)."""
    block = min(max_block, triton.next_power_of_2(max(length, 1)))
    while triton.cdiv(length, block) > 65535:
        block *= 2
    return block


ROW_TILE_ELEMENTS = 1024  # a VAE row kernel's elements per program (8 a thread on its 4 warps)
ROW_TILE_MIN_PROGRAMS = 128  # rows per program are halved below this many programs (a B=1 step's short rows)


def row_tile(rows: int, length: int, max_block: int = MAX_TIME_BLOCK) -> tuple[int, int]:
    """(rows, samples) per program of the VAE's row kernels (one row: a stream's channel): `time_block(length,
    max_block)` samples, and as many rows as bring a program to ROW_TILE_ELEMENTS when rows are short (a program of
    one 32-sample row on 128 threads idles or replicates most of them, and a step's early stages have 1024 channels
    a stream of such rows), halved while fewer than ROW_TILE_MIN_PROGRAMS programs would run."""
    block = time_block(length, max_block)
    block_rows = max(1, ROW_TILE_ELEMENTS // block)
    while block_rows > 1 and triton.cdiv(rows, block_rows) * triton.cdiv(length, block) < ROW_TILE_MIN_PROGRAMS:
        block_rows //= 2
    return block_rows, block
