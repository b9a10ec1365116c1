"""FP8 weights (`engine/ops/fp8.py`, EngineConfig.quantization = "fp8"): the e4m3 rounding within its bound, the CPU
engine on its dequantised weights close to the unquantised one and not equal to it, runtime LoRA merges requantising
the companions, the setting from the service to the engine. On CUDA: the FP8 GEMM against its dequantised eager
reference, the activation quantiser against torch, and the engine in CUDA graphs against eager FP8.

The bounds: e4m3 keeps 3 mantissa bits and rounds to nearest, so a value scaled into its normal range is off by at most
half an ulp, 2^-4 of its size, and one below it (under 2^-6, where the ulps stop shrinking) by at most 2^-10 of the
row's scale (amax / 448)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any
from unittest import mock

import pytest
import torch

from engine.engine_config import EngineConfig
from engine.io.checkpoint import load_model
from engine.llm_engine import LLMEngine
from engine.ops import fp8
from engine.options import EngineOptions
from engine.sequence import SamplingParams
from tests.conftest import relative_error

HALF_ULP = 2.0**-4  # e4m3's rounding error relative to a normal value
SUBNORMAL_STEP = 2.0**-10  # its rounding error below the normal range, relative to the row's scale
REQUESTS = [("A first request to quantise.", 1), ("Another one, a little longer than the first.", 2)]
CUDA = torch.cuda.is_available()


def _rows_of_every_size(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows spanning six decades of magnitude, one of them zero, each with values far below its amax (subnormal)."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-3, 3, rows)[:, None]
    x[:, :4] *= 1e-6
    x[1] = 0.0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_rounding_is_within_half_an_e4m3_ulp(dtype):
    w = _rows_of_every_size(12, 96, dtype)
    q = fp8.quantize_weight(w)
    assert q.data.dtype == torch.float8_e4m3fn and q.data.shape == w.shape and q.scale.shape == (1, 12)
    w32, scale = w.float(), q.scale.view(-1, 1)
    # Each row's largest element lands on 448 exactly (its scale is amax / 448); a zero row stays zero.
    amax = w32.abs().amax(-1)
    assert torch.equal(q.data.float().abs().amax(-1)[amax > 0], torch.full_like(amax[amax > 0], fp8.E4M3_MAX))
    assert q.dequantized(torch.float32)[1].abs().max() == 0
    err = (q.dequantized(torch.float32) - w32).abs()
    bound = torch.maximum(HALF_ULP * w32.abs(), SUBNORMAL_STEP * scale) * (1 + 1e-6)  # + fp32's product rounding
    assert (err <= bound).all(), f"worst error / bound {(err / bound.clamp_min(1e-30)).max():.3f}"
    # The bound is tight: some element in the normal range does round by more than half of it.
    assert (err / w32.abs().clamp_min(1e-30))[w32.abs() > 2 * scale].max() > 0.5 * HALF_ULP


def test_the_reference_gemm_is_within_both_operands_rounding():
    """|x_q w_q - x w| <= sum_k |x_k||w_k| (2 * 2^-4 + 2^-8) plus the subnormal steps of both operands."""
    x, w = _rows_of_every_size(6, 64, torch.float32), _rows_of_every_size(10, 64, torch.float32).flip(0)
    q = fp8.quantize_weight(w)
    out = fp8.fp8_linear_reference(x, q)
    _, x_scale = fp8.quantize_rows_reference(x)
    k_dim = x.shape[1]
    bound = ((2 * HALF_ULP + HALF_ULP**2) * (x.abs() @ w.abs().t())
             + SUBNORMAL_STEP * (1 + HALF_ULP) * (x_scale * w.abs().sum(-1) + x.abs().sum(-1, keepdim=True) * q.scale)
             + SUBNORMAL_STEP**2 * k_dim * x_scale * q.scale)
    err = (out.double() - x.double() @ w.double().t()).abs()
    assert (err <= bound + 1e-6 * (x.abs() @ w.abs().t())).all()  # + the fp32 reference's own rounding


def test_batch_invariant_mode_tiles_the_fp8_gemm_without_changing_it(monkeypatch):
    """`aten._scaled_mm` inside BatchInvariantMode runs as zero-padded fixed-shape row tiles (the CPU has tensor-wise
    scaling only: the rows' scales are checked on CUDA)."""
    from engine.ops import batch_invariant
    from engine.ops.batch_invariant import BatchInvariantMode

    tiled_calls = []
    handler = batch_invariant.HANDLERS[torch.ops.aten._scaled_mm.default]

    def spy(*args, **kwargs):
        tiled_calls.append(args[1].shape)
        return handler(*args, **kwargs)

    monkeypatch.setitem(batch_invariant.HANDLERS, torch.ops.aten._scaled_mm.default, spy)

    g = torch.Generator().manual_seed(3)
    a = torch.randn(21, 32, generator=g).to(torch.float8_e4m3fn)
    b = torch.randn(48, 32, generator=g).to(torch.float8_e4m3fn).t()
    one = torch.tensor(0.5)
    plain = torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.float32)
    with BatchInvariantMode():
        tiled = torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.float32)
    assert tiled_calls == [(21, 32)]  # the mode's handler ran it
    assert tiled.shape == plain.shape and relative_error(tiled, plain) <= 1e-6


@pytest.fixture(scope="module")
def cpu_patches(checkpoint_factory) -> dict[str | None, Any]:
    """The first patches of the same seeded requests from an unquantised and an FP8 engine (CPU), each on its own
    load of one tiny checkpoint; and the FP8 engine's model."""
    ckpt = checkpoint_factory("tiny-voxcpm2", stop="never")
    out = {}
    for quantization in (None, "fp8"):
        model = load_model(ckpt)
        engine = LLMEngine(model, EngineConfig(max_num_seqs=2, max_model_len=128, quantization=quantization))
        ids = [engine.add_request(text, SamplingParams(seed=seed, max_generate_length=2)) for text, seed in REQUESTS]
        first: dict[int, torch.Tensor] = {}
        while engine.has_unfinished():
            for event in engine.step():
                assert event.error is None, event.error
                first.setdefault(event.seq_id, event.patch.float())
        out[quantization] = [first[i] for i in ids]
        out[f"model-{quantization}"] = model
    return out


def _series_projections(model) -> int:
    """Quantised projections a first patch passes through in series: four per layer of the base LM, the residual LM
    and the DiT (whose ten Euler steps integrate one velocity error, they do not compound it)."""
    bb = model.backbone
    return 4 * sum(len(s.layers) for s in (bb.base_lm, bb.residual_lm, bb.feat_decoder.estimator.decoder))


def test_cpu_fp8_first_patch_is_close_to_the_unquantised_one_and_differs(cpu_patches):
    """Each quantised weight is off by at most half an ulp (2^-4) per element, uniformly within it, so by 2^-4/sqrt(3)
    of its size in RMS; independent roundings along n projections in series add in quadrature: sqrt(n) 2^-4/sqrt(3)
    of the patch's size. The FP8 engine must also differ by far more than the CPU's rounding noise (none at all: the
    same weights give the same bytes here), proof that it computes with other weights."""
    model = cpu_patches["model-fp8"]
    bound = math.sqrt(_series_projections(model)) * HALF_ULP / math.sqrt(3)
    for plain, quantised in zip(cpu_patches[None], cpu_patches["fp8"], strict=True):
        err = float((quantised - plain).norm() / plain.norm())
        assert 1e-3 < err <= bound, f"first patch relative error {err:.4f}, bound {bound:.4f}"
    # The CPU runs the FP8 model's weights: each projection weight is the checkpoint's, dequantised.
    for stack in ("base_lm", "feat_decoder.estimator.decoder"):
        weight = model.backbone.get_submodule(stack).layers[0].mlp.down_proj.weight
        original = cpu_patches["model-None"].backbone.get_submodule(stack).layers[0].mlp.down_proj.weight
        assert fp8.companion_of(weight) is None and not torch.equal(weight, original)
        assert torch.equal(weight, fp8.quantize_weight(original).dequantized(weight.dtype))
    assert model.backbone.quantization == "fp8" and getattr(cpu_patches["model-None"].backbone, "quantization",
                                                            None) is None


def test_a_model_serves_engines_of_one_quantization_only(cpu_patches):
    """Either way round: an FP8 engine would rewrite (CPU) or shadow the weights an unquantised engine reads."""
    with pytest.raises(ValueError, match="quantization: another engine serves this model's weights"):
        LLMEngine(cpu_patches["model-fp8"], EngineConfig(max_num_seqs=2, max_model_len=128))
    with pytest.raises(ValueError, match="quantization: another engine serves this model's weights"):
        LLMEngine(cpu_patches["model-None"], EngineConfig(max_num_seqs=2, max_model_len=128, quantization="fp8"))


def test_runtime_lora_merges_requantise_the_companions(checkpoint_factory, tmp_path):
    """A merged step's weights are base + adapter: their FP8 companions are rewritten with them (in the merge graphs
    on CUDA), and merging the base back restores the base's exactly."""
    from engine.io.lora import LoRAConfig, random_adapter, read_adapter
    from engine.models.minicpm import fuse_projections
    from engine.runner.lora import LoRASlots

    model = load_model(checkpoint_factory("tiny-voxcpm2", stop="never"))
    bb = model.backbone
    fuse_projections(bb)
    attention = bb.base_lm.layers[0].self_attn
    for weight in (attention.qkv_weight, attention.o_proj.weight, bb.base_lm.layers[0].mlp.down_proj.weight):
        fp8.attach(weight)  # as on a GPU with the FP8 GEMM
    slots = LoRASlots(bb, model.config.architecture, 1, 4, torch.device("cpu"), torch.float32, True, 0.5)
    assert [id(w) for w in slots.quantized] == [id(attention.qkv_weight), id(attention.o_proj.weight)]  # adapted
    adapter = random_adapter(bb, tmp_path / "adapter", LoRAConfig(r=4, alpha=8), seed=1, std=0.2)
    slots.register("a", read_adapter(adapter))
    slot, _ = slots.acquire(slots.resolve("a"))
    base = fp8.companion_of(attention.qkv_weight).data.clone()
    slots.merge(slot)
    merged = fp8.companion_of(attention.qkv_weight)
    assert not torch.equal(merged.data.view(torch.uint8), base.view(torch.uint8))
    expected = fp8.quantize_weight(attention.qkv_weight)
    assert torch.equal(merged.data.view(torch.uint8), expected.data.view(torch.uint8))
    assert torch.equal(merged.scale, expected.scale)
    slots.merge(-1)
    assert torch.equal(fp8.companion_of(attention.qkv_weight).data.view(torch.uint8), base.view(torch.uint8))


def test_the_setting_reaches_the_engine_and_a_bad_value_names_it(monkeypatch):
    from pydantic import ValidationError

    from engine.engine_config import ENGINE_FIELDS
    from engine.serving.voxcpm import engine_config
    from service.engine_setup import engine_arguments
    from service.settings import Settings, describe_error

    monkeypatch.setenv("NANOVLLM_QUANTIZATION", "fp8")
    arguments = engine_arguments(Settings(), demo=False)  # the supervisor's pool keywords
    assert engine_config(**{k: v for k, v in arguments.items() if k in ENGINE_FIELDS}).quantization == "fp8"
    monkeypatch.setenv("NANOVLLM_QUANTIZATION", "int4")
    with pytest.raises(ValidationError) as refused:
        Settings()
    assert describe_error(refused.value).endswith("NANOVLLM_QUANTIZATION: Input should be 'fp8'")
    with pytest.raises(ValueError, match=r"^quantization: 'int4' is not one of \['fp8'\]"):
        engine_config(quantization="int4")


@pytest.mark.parametrize("fast", [False, True])
def test_the_fast_accumulation_setting_reaches_the_gemm(fast):
    """VOXCPM_FP8_FAST_ACCUM is what `_scaled_mm` is asked for (its numbers: the CUDA test below)."""
    q = fp8.quantize_weight(torch.randn(32, 16))
    x_q, x_scale = fp8.quantize_rows(torch.randn(4, 16))
    with mock.patch.object(fp8, "current", return_value=EngineOptions(fp8_fast_accum=fast)), \
            mock.patch.object(torch, "_scaled_mm") as gemm:
        fp8.scaled_matmul(x_q, x_scale, q, torch.bfloat16)
    assert gemm.call_args.kwargs["use_fast_accum"] is fast


@pytest.mark.parametrize("fast", [False, True])
def test_the_fast_accumulation_setting_reaches_the_triton_fp8_gemm(fast):
    """VOXCPM_FP8_FAST_ACCUM also decides how often the Triton FP8 GEMM's dots promote their partial sums (never, or
    every K tile), and on Hopper, where promoted it is slower than cuBLAS + the gated quantiser, whether the gated
    FP8 GEMM runs at all; on Blackwell it runs either way."""
    from engine.ops import fp8_gemm

    x_q, x_scale = fp8.quantize_rows(torch.randn(4, 256))
    q = fp8.quantize_weight(torch.randn(256, 256))
    with mock.patch.object(fp8_gemm, "current", return_value=EngineOptions(fp8_fast_accum=fast)):
        with mock.patch.object(fp8_gemm, "_fp8_gemm_kernel") as kernel:
            fp8_gemm.fp8_matmul(x_q, x_scale, q.data, q.scale, torch.bfloat16)
        assert kernel.__getitem__.return_value.call_args.kwargs["IMPRECISE"] == (None if fast else 128)
        cuda = torch.device("cuda")
        for capability, runs in (((9, 0), fast), ((10, 0), True), ((8, 9), False)):
            with mock.patch.object(torch.cuda, "get_device_capability", return_value=capability):
                assert fp8_gemm.gated_supported(cuda, 1024, 8192) is runs, capability


# --- CUDA -------------------------------------------------------------------------------------------------------------
def fp8_mlp_module(seed: int) -> torch.nn.Module:
    """A small bf16 MLP on CUDA (hidden 256, intermediate 512), its projections fused, with their FP8 companions."""
    from engine.config import TransformerConfig
    from engine.models.minicpm import MLP

    torch.manual_seed(seed)
    mlp = MLP(TransformerConfig(hidden_size=256, intermediate_size=512, num_attention_heads=2, num_key_value_heads=1,
                                num_hidden_layers=1, rms_norm_eps=1e-6)).to("cuda", torch.bfloat16)
    mlp.fuse_projections()
    fp8.attach(mlp.gate_up_weight)
    fp8.attach(mlp.down_proj.weight)
    return mlp


needs_fp8_gpu = pytest.mark.skipif(not (CUDA and torch.cuda.get_device_capability() >= (8, 9)),
                                   reason="needs CUDA with FP8 GEMMs (sm89+)")


@needs_fp8_gpu
@pytest.mark.parametrize("fast_accum", [False, True])
@pytest.mark.parametrize("shape", [(1, 64, 128), (128, 2048, 2560), (300, 1024, 8192), (2000, 6144, 2048)])
def test_fp8_gemm_matches_its_dequantised_reference_cuda(shape, fast_accum):
    """The same e4m3 operands either way: only the accumulation order and the bf16 output's rounding differ (with
    the fast accumulation also the tensor cores' narrower partial sums: a looser bound)."""
    rows, k_dim, n = shape
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, k_dim, device="cuda", generator=g).bfloat16()
    q = fp8.quantize_weight(torch.randn(n, k_dim, device="cuda", generator=g).bfloat16() * k_dim**-0.5)
    with mock.patch.object(fp8, "current", return_value=EngineOptions(fp8_fast_accum=fast_accum)):
        out = fp8.fp8_linear(x, q)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
    assert relative_error(out, fp8.fp8_linear_reference(x, q)) <= (2.0**-5 if fast_accum else 2.0**-7)


@pytest.mark.skipif(not (CUDA and torch.cuda.get_device_capability()[0] == 9),
                    reason="needs CUDA on Hopper (sm90: its FP8 accumulator)")
def test_the_triton_fp8_gemm_promotes_its_partial_sums_as_cublas_does_cuda():
    """K=4096, the DiT's down projection: with the fast accumulation off the Triton FP8 GEMM's error against the exact
    product of its e4m3 operands is cuBLAS's without it (its partial sums promoted every K tile), several times
    smaller than with it on (never promoted; an H200: 1.7e-3 against 2.0e-4)."""
    from engine import options
    from engine.ops import fp8_gemm

    g = torch.Generator(device="cuda").manual_seed(5)
    x_q, x_scale = fp8.quantize_rows(torch.randn(512, 4096, device="cuda", generator=g).bfloat16())
    q = fp8.quantize_weight(torch.randn(1024, 4096, device="cuda", generator=g).bfloat16() * 4096**-0.5)
    exact = (x_q.double() * x_scale.double()) @ (q.data.double() * q.scale.double().view(-1, 1)).t()
    errs = {}
    for fast in (False, True):
        with options.override(fp8_fast_accum=fast):
            errs[fast] = relative_error(fp8_gemm.fp8_matmul(x_q, x_scale, q.data, q.scale, torch.float32), exact)
    cublas = relative_error(torch._scaled_mm(x_q, q.data.t(), scale_a=x_scale, scale_b=q.scale,
                                             out_dtype=torch.float32, use_fast_accum=False), exact)
    assert errs[False] <= 1.25 * cublas
    assert errs[False] * 3 <= errs[True]


@needs_fp8_gpu
@pytest.mark.parametrize("half", [100, 4096, 6144])
def test_the_fused_gated_quantiser_is_silu_mul_then_the_quantiser_cuda(half):
    """One kernel for the SiLU-gated product and its quantisation: the same scales and e4m3 codes as `silu_mul`'s
    kernel followed by the quantiser's, also for a strided view (the row stride of a wider tensor)."""
    from engine.ops.silu_mul import silu_mul_triton

    g = torch.Generator(device="cuda").manual_seed(half)
    gate_up = (torch.randn(48, 3 * half, device="cuda", generator=g) * 3).bfloat16()[:, :2 * half]
    gate_up[5] = 0.0
    q, scale = fp8.silu_mul_quantized_triton(gate_up)
    ref_q, ref_scale = fp8.quantize_rows_triton(silu_mul_triton(gate_up[:, :half], gate_up[:, half:]))
    assert q.shape == (48, half) and scale.shape == (48, 1)
    assert torch.equal(scale, ref_scale)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))


@needs_fp8_gpu
def test_the_fp8_mlp_matches_its_dequantised_reference_cuda():
    """`fp8.fp8_mlp` (the fused gated quantiser between the two FP8 GEMMs) against the same chain in eager fp32 on
    the dequantised operands: the gate/up output's rounding moves a few of the product's e4m3 codes by one step, so
    the bound is looser than one GEMM's."""
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(300, 1024, device="cuda", generator=g).bfloat16()
    gate_up = fp8.quantize_weight(torch.randn(2 * 4096, 1024, device="cuda", generator=g).bfloat16() * 1024**-0.5)
    down = fp8.quantize_weight(torch.randn(1024, 4096, device="cuda", generator=g).bfloat16() * 4096**-0.5)
    out = fp8.fp8_mlp(x, gate_up, down)
    h = fp8.fp8_linear_reference(x, gate_up)
    ref = fp8.fp8_linear_reference(torch.nn.functional.silu(h[:, :4096]) * h[:, 4096:], down)
    assert out.shape == (300, 1024) and out.dtype == torch.bfloat16
    assert relative_error(out, ref) <= 2.0**-5


@pytest.mark.skipif(not (CUDA and torch.cuda.get_device_capability() >= (9, 0)),
                    reason="needs CUDA with tensor descriptors (sm90+): the gated FP8 GEMM")
def test_the_dit_mlp_runs_the_gated_fp8_gemm_cuda():
    """With the fast accumulation (on Hopper the gated FP8 GEMM runs only with it; without it there the MLP keeps no
    gated companion), `attach_gated_gemm` gives an FP8 MLP's fused gate/up weight the gated FP8 companion (not the
    bf16 one); the MLP then runs the FP8 GEMM with the gate in its epilogue instead of the gated quantiser, within the
    FP8 chain's bound of its dequantised reference and of the chain itself; with the gated GEMMs off (as the
    batch-invariant mode turns them) the chain runs."""
    from engine import options
    from engine.models.minicpm import attach_gated_gemm
    from engine.ops import fp8_gemm, gated_gemm

    mlp = fp8_mlp_module(seed=11)
    if torch.cuda.get_device_capability()[0] == 9:
        with options.override(fp8_fast_accum=False):
            assert attach_gated_gemm(mlp) == 0 and fp8.gated_companion_of(mlp.gate_up_weight) is None
    with options.override(fp8_fast_accum=True):
        assert attach_gated_gemm(mlp) == 1 and fp8.gated_companion_of(mlp.gate_up_weight) is not None
    assert gated_gemm.companion_of(mlp.gate_up_weight) is None
    x = torch.randn(300, 256, device="cuda").bfloat16()
    runs = {}
    for gated_rows in (2048, 0):
        with options.override(fp8_min_rows=256, gated_gemm_min_rows=gated_rows, fp8_fast_accum=True), \
                mock.patch.object(fp8_gemm, "fp8_matmul", wraps=fp8_gemm.fp8_matmul) as gemm, \
                mock.patch.object(fp8, "silu_mul_quantized", wraps=fp8.silu_mul_quantized) as chain:
            runs[gated_rows] = mlp(x)
        assert (gemm.call_count, chain.call_count) == ((1, 0) if gated_rows else (0, 1))
    h = fp8.fp8_linear_reference(x, fp8.companion_of(mlp.gate_up_weight))
    ref = fp8.fp8_linear_reference(torch.nn.functional.silu(h[:, :512]) * h[:, 512:],
                                   fp8.companion_of(mlp.down_proj.weight))
    assert relative_error(runs[2048], ref) <= 2.0**-5
    assert relative_error(runs[2048], runs[0]) <= 2.0**-5


def test_gate_up_calls_below_fp8_min_rows_take_the_gated_fp8_gemm_from_its_row_count():
    """`fp8_gated_min_rows` <= rows < `fp8_min_rows` on a weight with the gated companion, where the kernels run: the
    gated FP8 GEMM (the norm before it quantises its rows), over narrow tiles up to FEW_ROWS rows; elsewhere, with
    the setting 0, without the companion or without the kernels, the bf16 kernels; the batch-invariant mode never."""
    from engine.ops import fp8_gemm, platform

    weight = torch.randn(256, 128)
    fp8.attach(weight)
    fp8.attach_gated(weight)
    gated = fp8.gated_companion_of(weight)
    opts = EngineOptions(fp8_min_rows=1024, fp8_gated_min_rows=64)
    with mock.patch.object(fp8, "current", return_value=opts), \
            mock.patch.object(platform, "kernels", return_value=True):
        for lead, runs in (((63,), False), ((64,), True), ((2, 32), True), ((1023,), True), ((1024,), False)):
            x = torch.zeros(*lead, 128)
            assert (fp8.gated_few_rows(x, weight) is gated) is runs, lead
            assert fp8.reads_quantized(x, weight) is (runs or x.numel() >= 1024 * 128), lead
        assert fp8.gated_few_rows(torch.zeros(100, 128), torch.randn(256, 128)) is None  # no gated companion
        for rows, tiles in ((64, fp8_gemm.FEW_ROWS_GATED_TILES), (fp8_gemm.FEW_ROWS, fp8_gemm.FEW_ROWS_GATED_TILES),
                            (fp8_gemm.FEW_ROWS + 1, fp8_gemm.GATED_TILES)):
            x = torch.randn(rows, 128)
            fp8.attach_rows(x, *fp8.quantize_rows_reference(x))  # as the norm before it hands them on
            with mock.patch.object(fp8_gemm, "fp8_matmul", return_value=torch.zeros(rows, 128)) as gemm:
                assert fp8.gated_linear(x, gated).shape == (rows, 128)
            assert gemm.call_args.args[5] == tiles and gemm.call_args.kwargs["gated"] is True
    few_rows, down = torch.randn(256, 128), torch.randn(128, 128)  # a gate/up with the gated companion for few rows
    fp8.attach(few_rows)  # only (the LMs'), and a down projection
    fp8.attach_gated(few_rows, few_rows_only=True)
    fp8.attach(down)
    assert fp8.gated_companion_of(few_rows) is None  # so from fp8_min_rows on: cuBLAS + the gated quantiser
    with mock.patch.object(fp8, "current", return_value=opts), \
            mock.patch.object(platform, "kernels", return_value=True):
        assert fp8.gated_few_rows(torch.zeros(100, 128), few_rows) is fp8.few_rows_gated_companion_of(few_rows)
        with mock.patch.object(fp8, "current", return_value=dataclasses.replace(opts, gated_gemm_min_rows=2048)):
            assert fp8.mlp_companions(torch.zeros(1024, 128), few_rows, down)[2] is None
            assert fp8.mlp_companions(torch.zeros(1024, 128), weight, down)[2] is gated  # any row count's
    for other in (dataclasses.replace(opts, fp8_gated_min_rows=0), opts.batch_invariant_kernels(),
                  dataclasses.replace(opts, gated_gemm_min_rows=0)):
        with mock.patch.object(fp8, "current", return_value=other), \
                mock.patch.object(platform, "kernels", return_value=True):
            assert fp8.gated_few_rows(torch.zeros(100, 128), weight) is None
    with mock.patch.object(fp8, "current", return_value=opts):
        assert fp8.gated_few_rows(torch.zeros(100, 128), weight) is None  # the CPU: no kernels


@pytest.mark.skipif(not (CUDA and torch.cuda.get_device_capability() >= (9, 0)),
                    reason="needs CUDA with tensor descriptors (sm90+): the gated FP8 GEMM")
def test_an_fp8_mlp_below_fp8_min_rows_runs_the_gated_fp8_gemm_and_a_bf16_down_cuda():
    """The LMs' decode rows with FP8 weights and the fast accumulation: from `fp8_gated_min_rows` rows the gate/up
    projection is the gated FP8 GEMM (narrow tiles up to FEW_ROWS rows, the default ones above), its bf16 product
    read by the bf16 down projection, within the FP8 GEMM's bound of that chain on the dequantised gate/up weight;
    below it, the bf16 path alone."""
    from engine import options
    from engine.models.minicpm import attach_gated_companions
    from engine.ops import fp8_gemm

    mlp = fp8_mlp_module(seed=12)
    with options.override(fp8_fast_accum=True, fp8_min_rows=1024, fp8_gated_min_rows=64):
        assert attach_gated_companions(mlp, torch.nn.Module(), 0, fp8_weights=True) == 1
        for rows in (64, 128, 300, 32):
            x = torch.randn(rows, 256, device="cuda").bfloat16()
            with mock.patch.object(fp8_gemm, "fp8_matmul", wraps=fp8_gemm.fp8_matmul) as gemm:
                out = mlp(x)
            assert gemm.call_count == (rows >= 64), rows
            if rows >= 64:  # the e4m3 gate/up weight
                h = fp8.fp8_linear_reference(x, fp8.companion_of(mlp.gate_up_weight))
            else:  # the bf16 one
                h = (x.float() @ mlp.gate_up_weight.float().t()).bfloat16()
            product = (torch.nn.functional.silu(h[:, :512].float()) * h[:, 512:].float()).bfloat16()
            ref = product @ mlp.down_proj.weight.t()
            assert relative_error(out, ref) <= (2.0**-5 if rows >= 64 else 2.0**-7), rows


@pytest.mark.parametrize("few_rows_only", [False, True])
def test_requantize_rewrites_the_gated_companion_in_place(few_rows_only):
    """A merge that rewrites a fused gate/up weight also rewrites its gated companion (the FP8 companion's rows and
    scales as (gate_i, up_i) pairs), in the memory the captured graphs read; the few-rows one too."""
    weight = torch.randn(64, 32)
    fp8.attach(weight)
    fp8.attach_gated(weight, few_rows_only)
    gated = fp8.few_rows_gated_companion_of(weight)
    assert gated is not None
    weight.mul_(3.0).add_(1.0)
    fp8.requantize(weight)
    companion = fp8.companion_of(weight)
    assert companion is not None and fp8.few_rows_gated_companion_of(weight) is gated
    for half, rows in ((0, slice(None, 32)), (1, slice(32, None))):  # even rows: gate_i, odd rows: up_i
        assert torch.equal(gated.data[half::2].view(torch.uint8), companion.data[rows].view(torch.uint8))
        assert torch.equal(gated.scale.view(-1)[half::2], companion.scale.view(-1)[rows])


@needs_fp8_gpu
def test_the_norms_quantise_the_rows_the_fp8_gemms_read_cuda():
    """On FP8 weights the add + RMSNorm before gate/up and before the next layer's q/k/v also quantises its rows (one
    kernel): the stack's output is bitwise the one where every FP8 GEMM quantises its rows itself, with two quantiser
    launches fewer per layer (one fewer in the last: the final norm feeds no FP8 GEMM)."""
    from engine import options
    from engine.config import TransformerConfig
    from engine.models.minicpm import MiniCPM, quantize_projections

    torch.manual_seed(12)
    layers = 3
    stack = MiniCPM(TransformerConfig(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                      num_key_value_heads=2, num_hidden_layers=layers, rms_norm_eps=1e-6,
                                      no_rope=True)).to("cuda", torch.bfloat16)
    assert quantize_projections(stack, "fp8", torch.device("cuda"))["fp8_gemm"] == 4 * layers
    x = torch.randn(64, 11, 256, device="cuda").bfloat16()  # 704 rows: 64 short sequences, as the DiT's
    runs, launches = {}, {}
    for fused in (True, False):
        with options.override(fp8_min_rows=256), \
                mock.patch.object(fp8, "quantize_rows_triton", wraps=fp8.quantize_rows_triton) as quantiser, \
                mock.patch.object(fp8, "attach_rows", wraps=fp8.attach_rows if fused else lambda *a: None):
            runs[fused] = stack.forward_local(x, None)
        launches[fused] = quantiser.call_count
    assert torch.equal(runs[True], runs[False])
    assert launches[False] - launches[True] == 2 * layers - 1, launches


@needs_fp8_gpu
@pytest.mark.parametrize("cols", [16, 100, 2048, 6144])
def test_triton_activation_quantiser_matches_torch_cuda(cols):
    """IEEE division and round-to-nearest-even on both sides: the same scales and the same e4m3 codes, also for a
    strided view and a zero row."""
    x = _rows_of_every_size(40, 2 * cols, torch.float32).cuda().bfloat16()[:, :cols]  # row stride 2 * cols
    q, scale = fp8.quantize_rows_triton(x)
    ref_q, ref_scale = fp8.quantize_rows_reference(x)
    assert torch.equal(scale, ref_scale)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))


@needs_fp8_gpu
def test_fp8_gemm_is_batch_invariant_in_the_exact_mode_cuda():
    from engine.ops.batch_invariant import BatchInvariantMode

    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(300, 1024, device="cuda", generator=g).bfloat16()
    q = fp8.quantize_weight(torch.randn(2048, 1024, device="cuda", generator=g).bfloat16())
    with BatchInvariantMode():
        batch, alone = fp8.fp8_linear(x, q), fp8.fp8_linear(x[137:138], q)
    assert torch.equal(batch[137:138], alone)


@needs_fp8_gpu
@pytest.mark.parametrize("min_rows", [1, 1024])
def test_engine_in_cuda_graphs_matches_eager_fp8_cuda(checkpoint_factory, min_rows):
    """The tiny model's projections on FP8 weights, captured in the step graphs and eager: with fp8_min_rows 1 every
    one on the FP8 GEMM (the first patch compared), with the default (1024) the one-row decode chain's GEMVs reading
    the e4m3 weights (one sequence at a time; the second patch compared, the first one's prefill has too few rows
    for FP8). The two agree far better than FP8 and bf16 do (the quantisation dominates any difference of bucket
    padding or kernel choice)."""
    from engine.ops import gemv

    ckpt = checkpoint_factory("tiny-voxcpm2", dtype="bfloat16", stop="never")
    compared = 0 if min_rows == 1 else 1  # which patch of each request

    def patches(quantization: str | None, eager: bool) -> list[torch.Tensor]:
        config = EngineConfig(max_num_seqs=4 if min_rows == 1 else 1, max_model_len=256, num_kv_blocks=128,
                              enforce_eager=eager, quantization=quantization,
                              options=EngineOptions(fp8_min_rows=min_rows))
        with mock.patch.object(fp8, "scaled_matmul", wraps=fp8.scaled_matmul) as spy, \
                mock.patch.object(gemv, "gemv", wraps=gemv.gemv) as gemv_spy:
            engine = LLMEngine(load_model(ckpt, "cuda"), config, "cuda")
            assert bool(engine.runner.graphs) != eager
            ids = [engine.add_request(text, SamplingParams(seed=seed, max_generate_length=3))
                   for text, seed in REQUESTS]
            made: dict[int, list[torch.Tensor]] = {}
            while engine.has_unfinished():
                for event in engine.step():
                    assert event.error is None, event.error
                    made.setdefault(event.seq_id, []).append(event.patch.float())
        if min_rows == 1:
            assert (spy.call_count > 0) == (quantization == "fp8")
        else:
            scaled = sum(c.kwargs.get("scale") is not None for c in gemv_spy.call_args_list)
            assert (scaled > 0) == (quantization == "fp8"), scaled
        return [made[i][compared] for i in ids]

    graphed, eager, plain = patches("fp8", False), patches("fp8", True), patches(None, True)
    for g, e, p in zip(graphed, eager, plain, strict=True):
        quantisation = float((e - p).norm() / p.norm())
        assert quantisation > 1e-3
        assert float((g - e).norm() / e.norm()) <= 0.5 * quantisation


def test_companions_follow_the_fused_weight_objects():
    """`stack_layer_weights` moves the fused weights' storage by `.data`; the companion is an attribute of the tensor
    object, which the projection calls keep passing."""
    weight = torch.randn(32, 16)
    fp8.attach(weight)
    companion = fp8.companion_of(weight)
    weight.data = torch.stack([weight.detach().clone()])[0]
    assert fp8.companion_of(weight) is companion
    with mock.patch.object(fp8, "current", return_value=EngineOptions(fp8_min_rows=4)):
        assert fp8.companion(torch.zeros(3, 16), weight) is None
        assert fp8.companion(torch.zeros(2, 2, 16), weight) is companion
    assert fp8.companion(torch.zeros(300, 16), torch.zeros(32, 16)) is None  # a weight without one
