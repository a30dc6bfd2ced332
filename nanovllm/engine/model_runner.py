"""Owns the model on one device: weights, KV cache, CUDA graphs, and one step's forward.

Start-up: build the model -> load weights -> warm up at the largest prefill batch ->
size and allocate the KV cache -> capture decode CUDA graphs (CUDA, unless
enforce_eager). `run(plan)` executes one scheduled step and returns the sampled
token of each sequence that completed its scheduled tokens. Tensor-parallel workers
run the same class on their own rank (see tp_workers.py).
"""

from __future__ import annotations

import gc
import time

import torch

from nanovllm.config import Config
from nanovllm.engine.cuda_graphs import DecodeGraphs
from nanovllm.engine.kv_cache import allocate_kv_cache, kv_bytes_per_block, num_blocks_from_memory
from nanovllm.engine.scheduler import StepKind
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.step_inputs import StepInputBuilder, StepInputs, StepPlan
from nanovllm.layers.attention import Attention
from nanovllm.layers.attention_backend import select_attention_backend
from nanovllm.layers.sampler import Sampler, SamplingBatch, make_generator
from nanovllm.models.qwen3 import Qwen3ForCausalLM
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.context import AttentionMetadata, attention_context
from nanovllm.utils.distributed import tp_rank, tp_size
from nanovllm.utils.loader import init_dummy_weights, load_model


class ModelRunner:
    def __init__(self, config: Config):
        self.config = config
        cfg = config.model_config
        self.rank, self.world_size = tp_rank(), tp_size()
        self.device = torch.device(config.device, self.rank) if config.device == "cuda" else torch.device("cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.dtype = config.torch_dtype
        self.block_size = config.kvcache_block_size
        self.backend = select_attention_backend(config.attention_backend, config.device, self.block_size)

        with torch.device(self.device):
            previous_dtype = torch.get_default_dtype()
            torch.set_default_dtype(self.dtype)
            try:
                self.model = Qwen3ForCausalLM(cfg)
            finally:
                torch.set_default_dtype(previous_dtype)
        if config.load_format == "dummy":
            init_dummy_weights(self.model, config.seed)
        else:
            load_model(self.model, config.model)
        self.model.eval()
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.sampler = Sampler()
        self.inputs = StepInputBuilder(self.block_size, self.device, config.max_blocks_per_seq)
        self.last_prepare_s = 0.0

        self.num_kv_heads = cfg.num_key_value_heads // self.world_size
        block_bytes = kv_bytes_per_block(cfg.num_hidden_layers, self.block_size, self.num_kv_heads, cfg.head_dim, self.dtype)
        if self.device.type == "cuda":
            self._attach_kv_cache(allocate_kv_cache(
                cfg.num_hidden_layers, 1, self.block_size, self.num_kv_heads, cfg.head_dim, self.dtype, self.device))
            self._warmup()
        num_blocks = config.num_kvcache_blocks or num_blocks_from_memory(
            self.device, config.gpu_memory_utilization, block_bytes)
        self.num_blocks = self._min_over_ranks(num_blocks)
        self.kv_cache = allocate_kv_cache(
            cfg.num_hidden_layers, self.num_blocks, self.block_size, self.num_kv_heads, cfg.head_dim,
            self.dtype, self.device)
        self._attach_kv_cache(self.kv_cache)
        self.graphs: DecodeGraphs | None = None
        if self.device.type == "cuda" and not config.enforce_eager:
            self.graphs = DecodeGraphs(self.model, config.max_num_seqs, config.max_blocks_per_seq,
                                       cfg.hidden_size, self.dtype, self.device)

    def _attach_kv_cache(self, kv_cache: torch.Tensor) -> None:
        for i, layer in enumerate(self.attention_layers):
            layer.k_cache, layer.v_cache, layer.backend = kv_cache[0, i], kv_cache[1, i], self.backend

    def _min_over_ranks(self, value: int) -> int:
        if self.world_size == 1:
            return value
        t = torch.tensor([value], device=self.device if self.device.type == "cuda" else "cpu")
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
        return int(t.item())

    @torch.inference_mode()
    def _warmup(self) -> None:
        """One prefill at the largest batch (and a sampler pass), to measure peak memory."""
        gc.collect()  # an exited engine's modules may sit in reference cycles until collected
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        cfg = self.config
        seq_len = min(cfg.max_model_len, cfg.max_num_batched_tokens)
        num_seqs = max(1, min(cfg.max_num_batched_tokens // seq_len, cfg.max_num_seqs))
        n = num_seqs * seq_len
        cu = torch.arange(0, n + 1, seq_len, dtype=torch.int32, device=self.device)
        meta = AttentionMetadata(
            is_prefill=True, slot_mapping=torch.full((n,), -1, dtype=torch.int64, device=self.device),
            cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=seq_len, max_seqlen_k=seq_len,
        )
        ids = torch.zeros(n, dtype=torch.int64, device=self.device)
        positions = torch.arange(seq_len, device=self.device).repeat(num_seqs)
        with attention_context(meta):
            hidden = self.model(ids, positions)
        # A later prefill chunk / prefix hit reads keys through the block table: compile that
        # kernel variant now, not in the middle of the first real workload.
        one = torch.tensor([0, 1], dtype=torch.int32, device=self.device)
        paged = AttentionMetadata(
            is_prefill=True, slot_mapping=torch.full((1,), -1, dtype=torch.int64, device=self.device),
            cu_seqlens_q=one, cu_seqlens_k=one * 2, max_seqlen_q=1, max_seqlen_k=2,
            block_tables=torch.zeros(1, 1, dtype=torch.int32, device=self.device),
        )
        with attention_context(paged):
            self.model(ids[:1], positions[1:2])
        rows = hidden[-1:].expand(cfg.max_num_seqs, -1)
        logits = self.model.compute_logits(rows)
        if logits is not None:
            # top-k/top-p take the sampler's most memory-hungry path (a full sort).
            params = [SamplingParams(temperature=1.0, top_k=50, top_p=0.9)] * cfg.max_num_seqs
            self.sampler(logits, SamplingBatch.build(params, [None] * len(params), self.device, logits.shape[-1]))
        torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def run(self, plan: StepPlan, sample_seqs: list[Sequence] | None = None) -> list[int]:
        """Run one step. Returns the new token of each sequence of `sample_seqs` (the
        plan's sampled sequences, in order) on rank 0; [] on tensor-parallel workers.
        `last_prepare_s` records the host time spent building the step's inputs."""
        start = time.perf_counter()
        if plan.kind is StepKind.PREFILL:
            inputs = self.inputs.prefill(plan)
            self.last_prepare_s = time.perf_counter() - start
            hidden = self._forward(inputs)[inputs.sample_indices]  # [num_sampled, hidden]
        elif self.graphs is not None and self.graphs.fits(len(plan.starts)):
            arrays = self.inputs.decode_arrays(plan)
            tables = self.inputs.block_table_array(plan.block_tables)
            self.last_prepare_s = time.perf_counter() - start
            hidden = self.graphs.run(arrays, tables)  # [batch, hidden]
        else:
            inputs = self.inputs.decode(plan)
            self.last_prepare_s = time.perf_counter() - start
            hidden = self._forward(inputs)
        if not any(plan.sampled):
            return []
        logits = self.model.compute_logits(hidden)  # [num_sampled, vocab] on rank 0, None elsewhere
        if logits is None or sample_seqs is None:
            return []
        return self.sampler(logits, self._sampling_batch(sample_seqs, logits.shape[-1])).tolist()

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        with attention_context(inputs.meta):
            return self.model(inputs.input_ids, inputs.positions)

    def _sampling_batch(self, seqs: list[Sequence], vocab_size: int) -> SamplingBatch:
        for seq in seqs:
            if seq.params.seed is not None and seq.generator is None:
                seq.generator = make_generator(seq.params.seed, self.device)
        return SamplingBatch.build([s.params for s in seqs], [s.generator for s in seqs], self.device, vocab_size)

    def exit(self) -> None:
        """Free the weights, KV cache and graphs (this object stays, without them)."""
        self.graphs = None
        for layer in self.attention_layers:
            layer.k_cache = layer.v_cache = None
        self.attention_layers = []
        self.kv_cache = None
        self.model = None
        gc.collect()  # parameters reference their modules through weight_loader: a cycle
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
