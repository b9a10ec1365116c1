"""The fused operations of a decode step, one per module: each holds its Triton kernel(s), the launcher beside
them, the check of which arguments the kernel takes, and the eager torch expression it must match (the CPU path and
the reference of the tests). Models call the dispatching function of an op (e.g. `norm.add_rms_norm`), which picks
the kernel where `platform.kernels(x)` and the op's own check allow, the eager expression otherwise.

- `norm`: RMSNorm and the residual add before it;      - `rotary`: rotary embedding, alone or with the K/V write;
- `linear`: which kernel multiplies a projection;      - `gemv`, `skinny_gemm`: the few-row projection kernels;
- `silu_mul`: the MLP's gate;                          - `paged_attention`: causal attention over the paged cache;
- `dense_attention`: the local modules' attention;     - `layer_stack`: a local module's whole stack in one kernel;
- `snake`, `vae_conv`, `upsampler`: the VAE decoder;   - `cfg_euler`: the flow sampler's guided Euler step;
- `lora`: a batch's per-row LoRA term (eager); `pdl`: when kernels are chained by programmatic dependent launch;
- `platform`: where the kernels can run.
"""
