"""The engine loop of one device: requests in, one patch per running sequence per step out.

Single-threaded and synchronous; the server pool runs one of these per worker process.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

import numpy as np
import torch

from engine import options
from engine.block_manager import BlockManager
from engine.config import parse_dtype
from engine.engine_config import EngineConfig
from engine.errors import LoRANotFoundError, OverloadedError, RequestError
from engine.io.checkpoint import LoadedModel, load_model
from engine.io.lora import merge_adapter, read_adapter
from engine.models.audio_vae import decoder_snr_db
from engine.ops.batch_invariant import BatchInvariantCalls
from engine.prompt import build_prompt, max_patches
from engine.runner.lora import LoRASlots
from engine.runner.model_runner import LaunchedDecode, ModelRunner
from engine.scheduler import Rejected, Scheduler
from engine.sequence import Sequence, Status, StepEvent
from engine.startup import kernel_cache
from engine.vocabulary import AdapterInfo, SamplingParams, TextIds

log = logging.getLogger(__name__)

# The least SNR (dB) of a float16 VAE decoder's audio from float32's at start-up: its rounding alone gives ~60 dB
# (H200, full-size VoxCPM2 with random weights: 62.6 from the engine's audio, 63.7 in the check), activations past
# 65504 give infinities or clipped audio.
MIN_VAE_SNR_DB = 40.0


def noise_seed(seed: int | None) -> int:
    """The noise generator's seed for a request's: torch's CPU generator keeps a seed's low 32 bits only, so a seed's
    high half is folded into them (seeds below 2^32 are their own, and s and s + 2^32 no longer share their noise);
    none: a random one."""
    if seed is None:
        return int(torch.randint(0, 2**32, ()).item())
    return (seed ^ (seed >> 32)) & 0xFFFFFFFF


class LLMEngine:
    def __init__(self, model: LoadedModel | str, config: EngineConfig | None = None,
                 device: torch.device | str = "cpu") -> None:
        self.config = cfg = config or EngineConfig()
        cfg.validate()
        self.device = torch.device(device)
        invariant = options.batch_invariant(self.device.type, cfg.options)
        # This process's kernels follow the config's switches, in exact mode less those chosen by the batch (on the CPU
        # only merged-adapter steps are such a choice: a step merged or not by its batch's adapters rounds otherwise).
        options.install(cfg.options.batch_invariant_kernels() if invariant else cfg.options)
        self.invariance = BatchInvariantCalls if invariant else contextlib.nullcontext
        t0 = time.perf_counter()
        if self.device.type == "cuda":
            kernel_cache.RECORDER.install()  # which kernels compile, from cache or not (the manifest tool reads it)
        kernels_mark = kernel_cache.RECORDER.mark()
        dtype = parse_dtype(cfg.dtype) if cfg.dtype is not None else None
        precompiler = kernel_cache.Precompiler(model, dtype, self.device,  # in parallel with the load
                                               variant=kernel_cache.manifest_variant(cfg))
        try:
            self.model = model if isinstance(model, LoadedModel) else load_model(
                model, self.device, dtype, max_positions=cfg.max_model_len)
            # The VAE first: its check may refuse the start, and a merge cannot be undone on a model loaded for reuse.
            self._set_vae_dtype(parse_dtype(cfg.vae_dtype) if cfg.vae_dtype is not None else torch.float32)
            self.lora_layers = 0  # layers a merged LoRA adapter changed
            if cfg.lora_path and cfg.lora_merge:
                self.lora_layers = merge_adapter(self.model.backbone, read_adapter(cfg.lora_path),
                                                 self.model.config.architecture)
        except BaseException:
            precompiler.close()  # its children and its lock must not outlive a failed start-up
            raise
        load_s = time.perf_counter() - t0
        kernel_stats = precompiler.wait()
        wait_s = time.perf_counter() - t0 - load_s  # for kernels still compiling when the model is in
        self.runner = ModelRunner(self.model, cfg, self.device)
        num_blocks = cfg.num_kv_blocks
        if num_blocks is None and self.device.type == "cuda":
            with self.invariance():  # the profiled step's peak is the real step's
                num_blocks = self.runner.profile_num_blocks(cfg.gpu_memory_utilization, cfg.max_model_len)
        elif num_blocks is None:
            num_blocks = self.runner.table_width * cfg.max_num_seqs
        self.runner.allocate_kv_cache(num_blocks)
        kv_s = time.perf_counter() - t0 - load_s - wait_s
        self.blocks = BlockManager(num_blocks, cfg.block_size)
        self.scheduler = Scheduler(self.blocks, cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.max_model_len,
                                   cfg.coalesce_ms / 1000.0, self._admit, cfg.running_prefill_tokens)
        self.default_lora: str | None = None  # the adapter of the requests that name none
        if cfg.lora_path and not cfg.lora_merge:
            assert self.runner.lora is not None  # validate(): max_loras >= 1
            self.runner.lora.register(cfg.lora_name, read_adapter(cfg.lora_path))
            self.default_lora = cfg.lora_name
        with self.invariance():  # the graphs hold the kernels the mode launches
            graph_s = self.runner.capture_graphs()
        self.sequences: dict[int, Sequence] = {}
        pipeline = cfg.pipeline_decode
        if pipeline is None:
            pipeline = cfg.options.pipeline_decode
        if pipeline is None:
            pipeline = self.device.type == "cuda"
        self.pipeline = pipeline
        self.in_flight: LaunchedDecode | None = None  # the launched decode step not yet read (pipelining)
        self._rejected: list[StepEvent] = []  # the requests a step refused before it failed (`after_failed_step`)
        self.startup_s = time.perf_counter() - t0
        # Where start-up goes (cold start is a performance target): load, KV sizing + allocation, capture.
        times = self.runner.capture_times.values()
        self.startup_phases = {"load_s": load_s, "precompile_wait_s": wait_s, "kv_s": kv_s, "graphs_s": graph_s,
                               "graph_warmup_s": sum(w for w, _ in times), "graph_capture_s": sum(c for _, c in times),
                               "kernels": kernel_stats}
        kernel_stats.update(self.kernel_compiles_since(kernels_mark, "start-up"))
        log.info("engine ready on %s in %.1f s (load %.1f s, KV sizing %.1f s, %s): %d KV blocks of %d tokens, "
                 "attention %s", self.device, self.startup_s, load_s, kv_s,
                 f"{len(self.runner.capture_times)} CUDA graphs in {graph_s:.1f} s"
                 if self.runner.graphs else "eager", num_blocks, cfg.block_size, self.runner.backend)

    def kernel_compiles_since(self, mark: tuple[int, int], stage: str) -> dict[str, Any]:
        """What the JIT compiled since `mark` (`kernel_cache.Recorder.since`; it listens on CUDA only, and counts real
        compiles, not kernel-cache hits). Where the precompile read kernel manifests for this model, GPU and settings,
        a compile means they lack a variant, which every start on an empty kernel cache waits for: a warning naming
        the kernels (`tools/record_kernel_manifest.py --check` lists their records; without `--check` it records
        them). Without such manifests (another GPU or model, the precompile off) compiling is expected: info."""
        since = kernel_cache.RECORDER.since(mark)
        if since["jit_compiled"]:
            names = ", ".join(sorted(set(since["jit_compiled_names"])))
            variant = kernel_cache.manifest_variant(self.config) or "(defaults)"
            if self.startup_phases["kernels"].get("manifest_records"):  # the precompile read manifests
                log.warning("%s compiled %d Triton kernel variants that the kernel manifests for this model, GPU and "
                            "settings %s lack (a manifest out of date, or kernel options away from their defaults): "
                            "%s", stage, since["jit_compiled"], variant, names)
            else:
                log.info("%s compiled %d Triton kernel variants (no kernel manifest read for this model, GPU and "
                         "settings %s): %s", stage, since["jit_compiled"], variant, names)
        return since

    def _set_vae_dtype(self, dtype: torch.dtype) -> None:
        """The VAE decoder in `dtype` (the decoder only: prompt latents keep the encoder's float32), once per loaded
        model: an engine sharing it with another of another dtype would swap the weights under the other's graphs."""
        decoder = self.model.vae.decoder
        held = getattr(decoder, "engine_dtype", None)
        if held is not None and held != dtype:
            raise ValueError(f"vae_dtype: this loaded model's VAE decoder runs in {held} for another engine: load it "
                             f"again for {dtype}")
        self.vae_check_db: float | None = getattr(decoder, "engine_check_db", None)  # the check, when there was one
        if held is None:
            if torch.finfo(dtype).max < 1e38:  # float16's 65504: another range, not only rounding (bfloat16: float32's)
                try:
                    self.vae_check_db = snr_db = decoder_snr_db(self.model.vae, dtype)
                except ValueError as e:
                    raise ValueError(f"vae_dtype: {e}") from e
                log.info("vae_dtype %s: the decoder's audio of a test clip is %.1f dB from float32's", dtype, snr_db)
                if not snr_db >= MIN_VAE_SNR_DB:
                    raise ValueError(f"vae_dtype: this model's VAE decoder in {dtype} is {snr_db:.1f} dB from its "
                                     f"float32 audio on a test clip (at least {MIN_VAE_SNR_DB:.0f} dB needed; "
                                     "its activations leave the dtype's range): use float32 or bfloat16")
            decoder.to(dtype)
            decoder.engine_dtype, decoder.engine_check_db = dtype, self.vae_check_db

    @property
    def sample_rate(self) -> int:
        return self.model.vae.out_sample_rate

    # --- runtime LoRA adapters ----------------------------------------------------------------------------------
    def _lora_slots(self, what: str) -> LoRASlots:
        if self.runner.lora is None:
            raise RequestError(f"{what}: this engine serves no runtime LoRA adapters (max_loras=0)")
        return self.runner.lora

    def register_lora(self, name: str, path: str) -> AdapterInfo:
        """Register the adapter at `path` (official format: its directory or weights file) as `name`; it becomes
        resident when a request names it. A bad adapter raises LoRAError naming the key."""
        return self._lora_slots("lora_name").register(name, read_adapter(path))

    def unregister_lora(self, name: str) -> None:
        """Forget adapter `name`; the requests using it finish with it, the long texts leasing it speak with it."""
        if name == self.default_lora:
            raise RequestError(f"lora_name: {name!r} is the start-up adapter, which every request without a "
                               "lora_name uses; it cannot be unregistered")
        self._lora_slots("lora_name").unregister(name)
        self.scheduler.changed()  # a request waiting for its slot now fails at the next admission round

    def lease_lora(self, client: int, lease: str, name: str | None, path: str | None = None) -> None:
        """Client `client`'s lease `lease` (a long text's) on the adapter registered as `name` begins; with `name`
        None it ends (`LoRASlots.lease`). `path`: where the leased adapter was registered from; a worker restarted
        since, not holding it under `name`, reads it from there for the lease alone."""
        slots = self.runner.lora
        if slots is None:
            return
        if name is not None and path is not None and not slots.holds(name, path):
            slots.lease_unregistered((client, lease), name, read_adapter(path))
        else:
            slots.lease((client, lease), name)
        self.scheduler.changed()  # a segment waiting for its slot, its lease ended, now fails at the next round

    def end_lora_leases(self, client: int) -> None:
        """Client `client` went away: its leases end."""
        if self.runner.lora is not None:
            self.runner.lora.end_leases(client)
            self.scheduler.changed()

    def list_loras(self) -> list[AdapterInfo]:
        return self.runner.lora.list() if self.runner.lora is not None else []

    def add_request(self, target_text: str, params: SamplingParams | None = None, prompt_text: str = "",
                    prompt_latents: torch.Tensor | None = None, ref_latents: torch.Tensor | None = None,
                    injected_noise: list[torch.Tensor] | None = None, lora_name: str | None = None,
                    text_ids: TextIds | None = None, continuation: bool = False,
                    lora_lease: tuple[int, str] | None = None) -> int:
        params = params or SamplingParams()
        params.validate()
        prompt = build_prompt(self.model.tokenizer, self.model.config, target_text, prompt_text,
                              prompt_latents, ref_latents, text_ids)
        seq = Sequence(prompt=prompt, params=params, max_patches=max_patches(prompt, params.max_generate_length),
                       continuation=continuation)
        # The request's own noise source, made here so that a bad seed fails this request, not a step.
        seq.noise = torch.Generator().manual_seed(noise_seed(params.seed))
        seq.injected_noise = injected_noise
        lora_name = lora_name if lora_name is not None else self.default_lora
        if lora_name is not None:  # its slot is taken at admission (`_admit`)
            self._lora_slots("lora_name").resolve(lora_name, lora_lease)
            seq.lora_name, seq.lora_lease = lora_name, lora_lease
        self.sequences[seq.seq_id] = seq
        self.scheduler.add(seq)
        return seq.seq_id

    def abort(self, seq_id: int) -> None:
        """Cancel a request: its KV blocks and slot are freed at once."""
        seq = self.sequences.pop(seq_id, None)
        if seq is not None and seq.status != Status.FINISHED:
            self._finish(seq, "aborted")

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def has_work(self) -> bool:
        """Whether step() would do something now: a step in flight, running sequences, or admissions (a request
        still inside its coalescing window is not work yet)."""
        return self.in_flight is not None or bool(self.scheduler.running) or self.scheduler.can_admit

    def idle_wait(self) -> float | None:
        """With no work now: seconds until there is some (a coalescing window closes), None = only a new request."""
        return self.scheduler.window_left() if self.scheduler.waiting else None

    def step(self) -> list[StepEvent]:
        """One engine step; the events of the patches it read. Pipelined, a step launches the next decode
        of the same running sequences first and then reads the one in flight (launched by the step before)."""
        in_flight, self.in_flight = self.in_flight, None
        try:
            with self.invariance():
                if in_flight is not None:
                    self.in_flight = self._launch_ahead(in_flight)
                    return [self._emit(r) for r in self.runner.collect_decode(in_flight)]
                return self._scheduled_step()
        except BaseException:
            # A launched step may have moved a sequence's device state (hidden states, VAE context, KV)
            # past what the host counted: nothing that was running can be continued. Prompt blocks of a
            # prefill whose error surfaced only now may hold garbage: out of the prefix cache with them.
            for launched in (in_flight, self.in_flight):
                for seq in launched.prefilled if launched is not None else []:
                    self.blocks.forget_uncomputed(seq)
            self.in_flight = None
            for seq in list(self.scheduler.running):
                self._finish(seq, "error")
            raise

    def _launch_ahead(self, in_flight: LaunchedDecode) -> LaunchedDecode | None:
        """The next decode of the in-flight step's sequences, launched before that step is read, when the
        schedule would not change: nobody new to admit, no preemption needed. Sequences that reach their
        length limit with the in-flight patch are left out; one that stops on it runs one patch more."""
        sched = self.scheduler
        if sched.can_admit:
            return None  # let the scheduler admit them
        seqs = [s for s in in_flight.seqs if s.status == Status.RUNNING and s.num_generated + 1 < s.max_patches]
        if not seqs or sum(self.blocks.needs_new_block(s, ahead=1) for s in seqs) > self.blocks.num_free:
            return None
        return self.runner.launch_decode(seqs, self.blocks, ahead=1)

    def _scheduled_step(self) -> list[StepEvent]:
        sched = self.scheduler.schedule()
        for seq in sched.preempted:
            self.runner.release_slot(seq, keep_state=True)
        rejected = [self._fail(seq, reason, kind) for seq, reason, kind in sched.rejected]
        events = list(rejected)
        t0 = time.perf_counter()
        try:
            if sched.prefill:
                self.runner.prefill(sched.prefill)
            t1 = time.perf_counter()
            if sched.decode:
                launched = self.runner.launch_decode(sched.decode, self.blocks)
                if self.pipeline:
                    launched.prefilled = sched.prefill  # their errors may surface only when it is read
                    self.in_flight = launched  # read by the next step, after it launched the one after
                else:
                    events += [self._emit(r) for r in self.runner.collect_decode(launched)]
        except BaseException:
            # The new prompt blocks are already in the prefix cache; what they hold is unknown now (on
            # CUDA an error of the prefill may only surface at the decode's sync).
            for seq in sched.prefill:
                self.blocks.forget_uncomputed(seq)
            self._rejected = rejected  # their events, for the caller: `after_failed_step`
            raise
        if sched.prefill and log.isEnabledFor(logging.DEBUG):  # prefill launch vs (prefill tail + decode)
            log.debug("step: prefill %d seqs %.1f ms (host), decode %d seqs %.1f ms", len(sched.prefill),
                      1000 * (t1 - t0), len(sched.decode), 1000 * (time.perf_counter() - t1))
        return events

    def after_failed_step(self) -> tuple[list[StepEvent], set[int]]:
        """After a step raised (its running requests ended with "error"): the events of the requests it refused before
        failing (each its own reason: its caller never got them), and the requests still queued that never started,
        which later steps serve; every other request the caller holds ended with the step."""
        rejected, self._rejected = self._rejected, []
        return rejected, {s.seq_id for s in self.scheduler.waiting if not s.num_generated}

    def _emit(self, event: StepEvent) -> StepEvent:
        if event.finished:
            self._finish(self.sequences[event.seq_id], event.finish_reason or "stop")
        return event

    def _admit(self, seq: Sequence, behind_waiter: bool = False) -> bool:
        """The scheduler's admission check: a request of a runtime adapter takes its slot now (loading it if it is
        not resident), or waits while every slot holds the adapters of running requests; one whose adapter was
        unregistered meanwhile fails. Behind a request waiting for a slot, requests of resident adapters start for
        `lora_slot_wait_s`, then those of the slot chosen to drain wait too (`LoRASlots.closed_to_new_holds`): a
        burst of more adapters than slots runs all it can at once, and a steady stream of one adapter's requests
        starves no one."""
        if seq.lora_name is None or seq.lora_slot >= 0:  # none, or held since before a preemption
            return True
        lora = self.runner.lora
        assert lora is not None
        try:
            adapter = lora.resolve(seq.lora_name, seq.lora_lease)
        except LoRANotFoundError as e:
            raise Rejected(str(e), e.kind) from e
        if behind_waiter and lora.closed_to_new_holds(adapter):
            return False
        try:
            seq.lora_slot, seq.cache_salt = lora.acquire(adapter)
        except OverloadedError:
            lora.note_waiter(seq.seq_id, at_head=not behind_waiter)
            return False
        # the round's first request to ask for a slot: none waits for one now (a continuation, queued ahead of the
        # waiter, says nothing of it: clearing its clock would let a stream of continuations starve it)
        if not behind_waiter and not seq.continuation:
            lora.note_served()
        return True

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        self.runner.release_slot(seq)
        if seq.lora_slot >= 0 and self.runner.lora is not None:
            self.runner.lora.release(seq.lora_slot)
        seq.lora_name, seq.lora_slot = None, -1
        self.sequences.pop(seq.seq_id, None)

    def _fail(self, seq: Sequence, reason: str, kind: str) -> StepEvent:
        self._finish(seq, "error")
        return StepEvent(seq.seq_id, None, None, True, "error", reason, kind)

    def generate(self, target_text: str, params: SamplingParams | None = None, **kwargs: object) -> np.ndarray:
        """Convenience for scripts and tests: run one request to completion, return its waveform."""
        return self.generate_all([dict(target_text=target_text, params=params, **kwargs)])[0]

    def generate_all(self, requests: list[dict[str, Any]]) -> list[np.ndarray]:
        """Run requests (each a dict of `add_request` arguments) together to completion; their waveforms,
        in order. Other requests in the engine keep running alongside; the first error raises."""
        ids = [self.add_request(**r) for r in requests]
        events = self.run_to_completion(ids)
        return [np.concatenate([ev.audio for ev in events[i]]) for i in ids]

    def run_to_completion(self, ids: list[int]) -> dict[int, list[StepEvent]]:
        """Step until the requests `ids` have finished; each one's events in order (other requests in the engine keep
        running alongside); the first error among them raises."""
        events: dict[int, list[StepEvent]] = {i: [] for i in ids}
        left = set(ids)
        while left:
            for ev in self.step():
                if ev.seq_id not in events:
                    continue
                if ev.error:
                    raise RuntimeError(ev.error)
                events[ev.seq_id].append(ev)
                if ev.finished:
                    left.discard(ev.seq_id)
        return events
