"""Owns the model on one device: weights, KV cache, CUDA graphs, and one step's forward.

Start-up: build the model -> load weights -> warm up at the largest prefill batch (CUDA:
engine/warmup.py) -> size and allocate the KV cache (engine/kv_cache.py, the same block count on
every rank) -> capture CUDA graphs (CUDA, unless enforce_eager):
decode graphs per batch size, and prefill / mixed-step graphs per token bucket when the
attention backend is ours and `prefill_graphs` is on (varlen_graphs.py). A scheduled step goes
through `prepare` (its inputs built on the host), `queue` (its forward) and `sample`, which returns a
handle whose `tokens()` waits for the sampled token of each sequence that completed its scheduled
tokens; rank 0's StepPipeline calls the three apart. Tensor-parallel workers run the same class on
their own rank and take each step whole (`run(plan)`, see tp_workers.py). `sleep(level)` gives the device memory
back and `wake_up(tags)` restores it, capturing the graphs again (engine/sleep.py).

The cache's element type is the config's (`kv_cache_dtype`, engine/kv_cache.py). An FP8 cache
also has each layer's scales (`kv_scales`, engine/kv_cache.KvScales): the checkpoint's, or set by
the first step on an empty cache (`StepPlan.fresh_cache`) after start-up and after each weight
change, which then runs eagerly (no graph replay) with `calibrate_kv_scales` in its metadata. Rank 0 logs the cache's size and dtype
at start-up (logger "nanovllm.engine.model_runner", INFO).

Invariants: from start-up to `exit` every attention layer holds its views of `kv_cache` and its
scales (the same tensors across sleep, which resizes their storages); `graphs` / `varlen_graphs`
are None while anything sleeps, and where none are captured; `prepare` queues nothing on the device.
"""

from __future__ import annotations

import gc
import logging
import random
import time
from dataclasses import replace

import torch

from nanovllm.config import Config
from nanovllm.engine.cuda_graphs import DecodeGraphs
from nanovllm.engine.kv_cache import (KvScales, allocate_kv_cache, copy_blocks, kv_block_bytes, kv_cache_shape,
                                      num_blocks_on_every_rank)
from nanovllm.engine.launched_step import LaunchedStep, PreparedStep, StepLogits, launched
from nanovllm.engine.rules_builder import RulesBuilder
from nanovllm.engine.scheduled_batch import StepKind
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.sleep import FreedStorages, SleepLevel, free_for_sleep, wake
from nanovllm.engine.step_inputs import HostCopy, StepInputBuilder, StepInputs
from nanovllm.engine.step_plan import StepPlan, sampled_positions
from nanovllm.engine.varlen_graphs import MAX_VARLEN_GRAPH_TOKENS, VarlenGraphs
from nanovllm.engine.warmup import warm_up
from nanovllm.kernels.checks import FP8_KV_DTYPE, sm_count
from nanovllm.kernels.decode_group_plan import GroupLimits
from nanovllm.kernels.decode_plan import heads_per_program
from nanovllm.kernels.prefill_plan import query_tile_rows
from nanovllm.layers.attention import Attention
from nanovllm.layers.attention_backend import select_attention_backend
from nanovllm.layers.kernel_path import kernel_routes
from nanovllm.models.registry import build_model
from nanovllm.quantization.config import quantization
from nanovllm.sampling.batch import KEY_BITS, SamplingPack, row_key
from nanovllm.sampling.row_logprobs import RowLogprobs
from nanovllm.sampling.sampler import Sampler
from nanovllm.sampling.token_mask import TokenMask
from nanovllm.utils.context import attention_context
from nanovllm.utils.distributed import TensorParallel, tensor_parallel
from nanovllm.utils.host_to_device import to_device
from nanovllm.utils.loader import init_dummy_weights, load_model

logger = logging.getLogger(__name__)

# Prompt-logprob rows scored per LM-head call: bounds the [rows, vocab] float32 logits
# (1,024 x 151,936 x 4 B = 0.6 GB) whatever the step's token budget.
PROMPT_LOGPROB_CHUNK_ROWS = 1024


class ModelRunner:
    def __init__(self, config: Config, rank: int = 0):
        """`rank`: this process's tensor-parallel rank (0: the scheduling process; workers: theirs)."""
        self.config = config
        cfg = config.model_config
        layout = TensorParallel(rank, config.tensor_parallel_size)
        self.rank, self.world_size = layout.rank, layout.size
        self.device = torch.device("cpu")
        if config.device == "cuda":
            # One rank: the caller's current device (torchrun's cuda.set_device(local_rank)); ranks: theirs.
            self.device = torch.device("cuda", torch.cuda.current_device() if layout.size == 1 else rank)
        allocated_before = 0
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            gc.collect()  # an exited engine's modules may sit in reference cycles until collected
            allocated_before = torch.cuda.memory_allocated(self.device)
        self.dtype = config.torch_dtype
        self.kv_dtype = config.kv_cache_torch_dtype
        fp8_kv = self.kv_dtype == FP8_KV_DTYPE
        self.block_size = config.kvcache_block_size
        self.backend = select_attention_backend(config.attention_backend, config.device, self.block_size, fp8_kv,
                                                cfg.head_dim)

        with (torch.device(self.device), kernel_routes(config.kernel_routes), quantization(config.quant_config),
              tensor_parallel(layout)):
            previous_dtype = torch.get_default_dtype()
            torch.set_default_dtype(self.dtype)
            try:
                self.model = build_model(cfg)  # layers choose kernels and weight formats here
            finally:
                torch.set_default_dtype(previous_dtype)
            self.sampler = Sampler(config.logprobs_mode)  # its noise implementation follows the device, as the layers' kernels
        self._load_weights()
        self.model.eval()
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        # An FP8 cache's (k_scale, v_scale) per layer (none for another cache): the checkpoint's, or
        # set by the first prefill step after start-up and after each weight change
        self.kv_scales = KvScales(config, self.device)
        self.model.on_weights_loaded = self.kv_scales.weights_changed  # load_weights through apply_model too
        self._key_rng = random.Random(config.seed)  # noise keys of unseeded requests
        # Logits rules of the requests that use them (penalties' counts live on the device; rank 0)
        self.rules = RulesBuilder(cfg.vocab_size, self.device)
        self.inputs = StepInputBuilder(self.block_size, self.device, config.max_blocks_per_seq,
                                       self._query_tile_rows(cfg.head_dim), self._group_limits(),
                                       self._query_tile_rows(cfg.head_dim, long=True))

        block_bytes = kv_block_bytes(config, self.world_size)
        if self.device.type == "cuda":
            self._attach_kv_cache(allocate_kv_cache(config, self.world_size, 1, self.device))
            warm_up(self.model, self.sampler, self.inputs, config, self.device)
        self.num_blocks = num_blocks_on_every_rank(config, self.world_size, block_bytes, self.device, allocated_before)
        self.kv_cache = allocate_kv_cache(config, self.world_size, self.num_blocks, self.device)
        self._attach_kv_cache(self.kv_cache)
        if self.rank == 0:
            scales = ("" if not fp8_kv else ", scales from the checkpoint" if self.kv_scales.from_checkpoint
                      else ", scales from the first prefill step")
            logger.info("KV cache: %d blocks of %d tokens (%d tokens), %s%s, %.2f GiB", self.num_blocks,
                        self.block_size, self.num_blocks * self.block_size, str(self.kv_dtype).removeprefix("torch."),
                        scales, self.num_blocks * block_bytes / 2**30)
        self.graphs: DecodeGraphs | None = None
        self.varlen_graphs: VarlenGraphs | None = None
        self._capture_graphs()
        # What sleep() gave back, by wake_up tag (engine/sleep.py); empty while awake.
        self.sleeping: dict[str, FreedStorages] = {}

    def _capture_graphs(self) -> None:
        """Capture the CUDA graphs (CUDA, unless enforce_eager): at start-up, and at wake_up,
        since the graphs hold the addresses of the weights and KV cache, which sleep gives back."""
        config = self.config
        if self.device.type != "cuda" or config.enforce_eager:
            return
        torch.cuda.empty_cache()  # the warm-up's activations: the graphs' pool takes their place
        row_limits = config.kernel_routes.linear_row_limits(fp8=config.quant_config is not None)
        self.graphs = DecodeGraphs(self.model, config.max_num_seqs, config.max_blocks_per_seq,
                                   config.model_config.hidden_size, self.dtype, self.device,
                                   config.kernel_routes.gemv_max_rows, row_limits,
                                   grouped=self.inputs.group_limits is not None)
        if config.prefill_graphs and self.inputs.query_tile_rows is not None:
            self.varlen_graphs = VarlenGraphs(self.model, self.inputs, min(config.max_num_batched_tokens,
                                              MAX_VARLEN_GRAPH_TOKENS), config.max_num_seqs,
                                              config.model_config.hidden_size, self.dtype, self.device, row_limits)

    @property
    def fill_sizes(self) -> tuple[int, ...]:
        """The compute-bound token buckets of the prefill / mixed-step graphs, where padding a
        step costs real FLOPs (the scheduler's `fill_sizes`); () without prefill graphs."""
        return self.varlen_graphs.fill_sizes if self.varlen_graphs is not None else ()

    def _group_limits(self) -> GroupLimits | None:
        """What bounds decode steps' groups of rows sharing a prefix (our decode kernel reads a group's
        prefix once: kernels/decode_groups.py); None for other backends."""
        if self.backend.name != "triton":
            return None
        cfg = self.config.model_config
        *_, kv_heads, head_dim = kv_cache_shape(self.config, self.world_size, 1)
        return GroupLimits(cfg.num_attention_heads // cfg.num_key_value_heads, kv_heads, sm_count(self.device),
                           heads_per_program(self.kv_dtype == FP8_KV_DTYPE, head_dim, kv_heads))

    def _query_tile_rows(self, head_dim: int, long: bool = False) -> int | None:
        """The Triton prefill kernel's query tile height (it takes a tile table), or with `long` its
        long-context tile's, where steps may take it: a 16-bit cache (the kernel's `long_tiles`) and a
        long tile other than the 64-row one (prefill_plan.prefill_tile: 16-bit, head_dim 128); None for
        other backends."""
        if self.backend.name != "triton":
            return None
        rows = query_tile_rows(head_dim, self.dtype)
        if not long:
            return rows
        long_rows = query_tile_rows(head_dim, self.dtype, long=True)
        return long_rows if long_rows != rows and self.kv_dtype != FP8_KV_DTYPE else None

    def _attach_kv_cache(self, kv_cache: torch.Tensor) -> None:
        for i, layer in enumerate(self.attention_layers):
            layer.attach(kv_cache[0, i], kv_cache[1, i], self.backend, self.kv_scales.of_layer(i))

    def prepare(self, plan: StepPlan, sample_seqs: list[Sequence] | None = None) -> PreparedStep:
        """Build a step's inputs on the host, queuing nothing on the device (`queue` does that), so
        the host can prepare a step while the one before it waits for its token masks. Steps are
        prepared and queued in turn: prepare(N), queue(N), prepare(N + 1), queue(N + 1)."""
        start = time.perf_counter()
        # The step's sampling values travel in its input copy (rank 0; workers sample nothing).
        pack = rules = words = None
        if sample_seqs:
            positions = sampled_positions(plan)
            pack = self._sampling_pack(sample_seqs, positions)
            words = pack.words
            # penalties, biases, masks of the rows that ask (none: no work)
            rules = self.rules.build(sample_seqs, positions, plan.carried_rows)
        if plan.kind is StepKind.DECODE:
            batch_size = len(plan.starts)
            graph = self.graphs.padded_size(batch_size) if self.graphs is not None else None
            copy = HostCopy.of(self.inputs.decode_rows(plan, batch_size if graph is None else graph), words)
            return PreparedStep(plan, time.perf_counter() - start, copy, pack, rules, graph)
        # The FP8 scales are set only in a step no KV written under the old ones outlives; eagerly
        calibrate = self.kv_scales.calibrate and plan.fresh_cache
        # Long-tile steps run eagerly: >= 2,048 query rows over >= 6,144 keys keep the device busier
        # than the host's launches, and the graphs keep the one tile
        eager = calibrate or self.inputs.long_tiles(plan)
        graph = self.varlen_graphs.bucket(plan.num_tokens) if self.varlen_graphs is not None and not eager else None
        layout = self.inputs.exact_layout(plan) if graph is None else self.varlen_graphs.layouts[graph]
        copy = self.inputs.varlen_copy(plan, layout, words)
        return PreparedStep(plan, time.perf_counter() - start, copy, pack, rules, graph, calibrate)

    @torch.inference_mode()
    def queue(self, step: PreparedStep, previous: LaunchedStep | None = None) -> StepLogits:
        """Queue a prepared step's forward and LM head on the device (its input copy first).
        `previous`: the step launched just before, whose device tokens a carried plan reads."""
        plan = step.plan
        prompt_logprobs: RowLogprobs | None = None
        carried_from = None
        if plan.carried_rows:
            if previous is None or previous.device_tokens is None:
                raise ValueError("a step with carried rows needs the previous step's sampled tokens")
            carried_from = previous.device_tokens
        rules = self.rules.upload(step.rules, carried_from) if step.rules is not None else None
        if plan.kind is StepKind.DECODE:
            if step.graph is not None:
                hidden, device_words = self.graphs.run(step.copy, len(plan.starts), carried_from,
                                                       len(plan.carried_rows))  # [batch, hidden]
            else:
                inputs = self.inputs.decode(plan, step.copy, carried_from)
                hidden, device_words = self._forward(inputs), inputs.sampling_words
        elif step.graph is not None:
            hidden, device_words = self.varlen_graphs.run(plan, step.graph, step.copy, carried_from)  # [num_sampled, hidden]
            if plan.prompt_logprob_rows:  # read from the graph's output before the next replay (same stream)
                prompt_logprobs = self._prompt_logprobs(plan, self.varlen_graphs.every_hidden(step.graph))
        else:
            inputs = self.inputs.varlen(plan, step.copy, carried_from)
            if step.calibrate_kv:  # the first step on an empty cache after start-up or a weight change
                inputs = replace(inputs, meta=replace(inputs.meta, calibrate_kv_scales=True))
            every = self._forward(inputs)  # [num_tokens, hidden]
            if step.calibrate_kv:  # set only once every layer has (a step that raised calibrates nothing)
                self.kv_scales.calibrated()
            hidden, device_words = every[inputs.sample_indices], inputs.sampling_words  # [num_sampled, hidden]
            if plan.prompt_logprob_rows:
                prompt_logprobs = self._prompt_logprobs(plan, every)
        if plan.block_copies:  # forked samples' copies of their parents' partial blocks, now written
            copy_blocks(self.kv_cache, plan.block_copies, self.device)
        # [num_sampled, vocab] on rank 0, None elsewhere (every rank takes part in the LM head)
        logits = self.model.compute_logits(hidden) if any(plan.sampled) else None
        if logits is None or step.sampling is None:
            return StepLogits(step.prepare_s, None, None, prompt_logprobs)
        if plan.fork_rows:  # forked samples draw from their parents' rows: [num_sampled + forks, vocab]
            logits = torch.cat([logits, logits[to_device(plan.fork_rows, self.device, torch.int64)]])
        return StepLogits(step.prepare_s, logits, step.sampling.unpack(device_words), prompt_logprobs, rules)

    @torch.inference_mode()
    def sample(self, step: StepLogits, token_mask: TokenMask | None = None) -> LaunchedStep:
        """Queue the sampling of a step whose forward `queue` queued, its constrained rows
        masked by `token_mask` (structured outputs) and its logits rules applied (penalties, biases,
        masks); records the sampled tokens in the penalties' counts; returns the step's handle."""
        if step.logits is None:
            return launched(step.prepare_s, None, None, step.prompt_logprobs, self.device)
        out = self.sampler(step.logits, step.sampling, step.rules, token_mask)  # tokens [num_sampled] int64, logprobs
        if step.rules is not None:
            step.rules.record(out.tokens)  # the penalties' counts include this step's tokens from now on
        return launched(step.prepare_s, out.tokens, out.logprobs, step.prompt_logprobs, self.device)

    def _prompt_logprobs(self, plan: StepPlan, hidden: torch.Tensor) -> RowLogprobs | None:
        """The RowLogprobs of the plan's prompt-logprob rows, scored from
        `hidden` [num_tokens, hidden] in chunks of PROMPT_LOGPROB_CHUNK_ROWS (every rank takes
        part in the LM head; rank 0 gets the result, the others None)."""
        rows = to_device(plan.prompt_logprob_rows, self.device, torch.int64)  # [R]
        targets = to_device(plan.prompt_logprob_targets, self.device, torch.int64)  # [R]
        parts = []
        for a in range(0, rows.shape[0], PROMPT_LOGPROB_CHUNK_ROWS):
            logits = self.model.compute_logits(hidden[rows[a : a + PROMPT_LOGPROB_CHUNK_ROWS]])  # [r, vocab]
            if logits is not None:
                parts.append(self.sampler.logprobs_of(logits, targets[a : a + PROMPT_LOGPROB_CHUNK_ROWS],
                                                      plan.prompt_logprobs_k))
        if not parts:
            return None
        return RowLogprobs._make(torch.cat(p) for p in zip(*parts))

    def get_model(self) -> torch.nn.Module:
        """This rank's model (vLLM's GPUModelRunner.get_model, which worker functions call)."""
        return self.model

    @torch.inference_mode()
    def update_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint-named full tensors into this rank's parameters in place (every name
        and shape checked first; see loader.update_weights)."""
        self.model.load_weights(weights)

    def reload_weights(self) -> None:
        """The checkpoint's weights again, in place, as at start-up (vLLM's worker reload_weights,
        which a level-2 sleep asks for); FP8 KV scales computed from the data are set anew."""
        self._load_weights()
        self.kv_scales.weights_changed()

    def _load_weights(self) -> None:
        """The checkpoint's weights (load_format "dummy": random ones from the seed) into the model."""
        if self.config.load_format == "dummy":
            init_dummy_weights(self.model, self.config.seed)
        else:
            load_model(self.model, self.config.model, self.config.load_format)

    def sleep(self, level: SleepLevel) -> None:
        """Give the device memory back: the KV cache and the weights (engine/sleep.free_for_sleep: should
        the host copies fail, nothing has changed), the CUDA graphs (they hold the old addresses) and
        the penalties' counts. The engine checked that nothing is pending and nothing sleeps already."""
        self.sleeping = free_for_sleep(self.model, self.kv_cache, level, self.device)
        self.graphs = self.varlen_graphs = None
        self.rules = RulesBuilder(self.config.model_config.vocab_size, self.device)  # no sequence holds a slot
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake_up(self, tags: list[str]) -> None:
        """Restore the sleeping parts among `tags` (engine/sleep.wake: a part whose restore fails, out
        of device memory while a trainer holds it, sleeps on and wake_up can be called again); once
        nothing sleeps, capture the CUDA graphs again."""
        wake(self.sleeping, tags)
        if not self.sleeping and self.graphs is None:
            self._capture_graphs()

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> list[int]:
        """A tensor-parallel worker's step (rank 0 sends the plan: engine/tp_workers.py): prepare,
        queue and sample it as rank 0's StepPipeline does, and wait for it (no sampled rows here: [])."""
        return self.sample(self.queue(self.prepare(plan))).tokens()

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        with attention_context(inputs.meta):
            return self.model(inputs.input_ids, inputs.positions)

    def _sampling_pack(self, seqs: list[Sequence], positions: list[int]) -> SamplingPack:
        """The sampling values of `seqs` (the step's sampled rows), for the step's input copy.
        Each row's noise comes from a key, on every device: seeded rows' from (the sample's
        seed, position of the sampled token), the others' from this runner's RNG."""
        keys = [row_key(s.seed, pos) if s.seed is not None else self._key_rng.getrandbits(KEY_BITS)
                for s, pos in zip(seqs, positions)]
        return SamplingPack.of([s.params for s in seqs], keys, self.config.model_config.vocab_size)

    def exit(self) -> None:
        """Free the weights, KV cache and graphs (this object stays, without them)."""
        self.graphs = self.varlen_graphs = None
        self.sleeping = {}  # a sleeping engine's host copies of its weights
        for layer in self.attention_layers:
            layer.k_cache = layer.v_cache = None
            layer.scale_args = {}
        self.attention_layers = []
        self.kv_cache = self.kv_scales = None
        self.model = None
        gc.collect()  # parameters reference their modules through weight_slice: a cycle
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
