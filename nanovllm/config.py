"""Engine configuration: one validated dataclass built from `LLM(model, **kwargs)`.

The model's own shape comes from `config.json` (see `ModelConfig`); everything the
engine decides (budgets, cache size, device, dtype, backend) lives in `Config`.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import logging
import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from nanovllm.engine_args import HF_OVERRIDE_ARGS, RENAMED, VLLM_ONLY_ARGS, strip_vllm_only_args
from nanovllm.kernels.checks import BLOCK_SIZE_MULTIPLE, FP8_KV_DTYPE
from nanovllm.layers.kernel_path import KernelRoutes
from nanovllm.models.model_config import DTYPES, ModelConfig, read_config_json
from nanovllm.quantization.checkpoint_config import (
    calibrated_fp8_kv, checkpoint_quantization, quantization_method, resolve_quantization,
)
from nanovllm.quantization.config import QuantConfig
from nanovllm.sampling.logprobs_mode import LogprobsMode
from nanovllm.utils.checkpoint_files import checkpoint_files
from nanovllm.utils.generation_defaults import check_generation_overrides
from nanovllm.utils.ints import cdiv
from nanovllm.utils.tokenizer import TOKENIZER_FILES, has_tokenizer
from nanovllm.utils.validation import check_bool, check_int, check_number, check_seed

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# LLM(load_format=...): "auto" reads the checkpoint's files (utils/checkpoint_files.py: *.safetensors, else
# pytorch_model*.bin), "safetensors" (vLLM's) its *.safetensors files only (a directory without any is
# refused, as vLLM refuses it); "dummy" gives random weights from config.json alone.
_LOAD_FORMATS = ("auto", "safetensors", "dummy")
# LLM(kv_cache_dtype=...): "auto" keeps the model's dtype (a ModelOpt checkpoint's calibrated FP8 cache where it
# has one, as vLLM resolves it); "bfloat16" names the model's dtype where it is bfloat16 (the kernels read the
# cache in the compute dtype); the others name float8 e4m3 (vLLM's spellings).
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3")
# Those of KV_CACHE_DTYPES that name float8 e4m3.
KV_CACHE_FP8 = ("fp8", "fp8_e4m3")
_BACKENDS = ("auto", "flash_attn", "triton", "torch")
# vLLM's other names of DTYPES' dtypes.
DTYPE_ALIASES = {"half": "float16", "float": "float32"}
# dtype="auto" on CUDA runs a checkpoint of these dtypes as it is; one of any other (float32, as vLLM does:
# "Downcasting torch.float32 to torch.bfloat16"; float64 or float8, as vLLM falls back to its platform's
# dtype) in CUDA_AUTO_FALLBACK: float32 doubles every byte a step reads and the kernels are 16-bit ones.
CUDA_AUTO_DTYPES = (torch.float16, torch.bfloat16)
CUDA_AUTO_FALLBACK = torch.bfloat16
# LLM(generation_config=...) values that are not a directory (vLLM's): the checkpoint's file gives the
# defaults ("auto") or not ("vllm"); its EOS ids count either way.
GENERATION_CONFIG_SOURCES = ("auto", "vllm")


def _unknown_hint(name: str, taken: list[str]) -> str:
    """`name`, an unknown LLM() keyword, with the nearest of the keywords `taken` (nanovllm's and
    vLLM's) or, with none near, where they are listed."""
    near = difflib.get_close_matches(name, taken, n=1, cutoff=0.8)
    if near:
        return f"{name} (did you mean {near[0]}?)"
    return (f"{name} (not a setting here: nanovllm/config.py's Config lists its keywords, "
            "nanovllm/engine_args.py vLLM's it takes)")

# A Hugging Face model id ("Qwen/Qwen3-0.6B", "gpt2"), which vLLM downloads: a name that is no local path.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def _directory(name: str, value: object, what: str) -> str:
    """`value`, a str or os.PathLike naming an existing directory, as a str (TypeError / ValueError
    naming `name` otherwise: a file, a path that does not exist, or a hub id, which vLLM would download)."""
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name} must be a path to {what}, got {value!r}")
    path = os.fspath(value)
    if os.path.isdir(path):
        return path
    if os.path.exists(path):
        raise ValueError(f"{name} path {path!r} is a file, not a directory: pass {what}")
    if _HUB_ID.fullmatch(path):
        raise ValueError(f"{name} {path!r} is not a local directory (nanovllm reads checkpoints from local directories "
                         f"and downloads nothing): if it is a Hugging Face model id, download it first, e.g. "
                         f"`huggingface-cli download {path} --local-dir DIR`, and pass DIR")
    raise ValueError(f"{name} path {path!r} does not exist")


# A setting's name in messages, with vLLM's name of it beside where that differs (RENAMED): the one a caller passed.
_SHOWN = {ours: f"{ours} (vLLM's {theirs})" for theirs, ours in RENAMED.items()}


# max_model_len when none is given (nano-vllm's): the block table's width and the decode graphs'
# split plan grow with it, and longer contexts are a user's choice (vLLM takes the model's maximum).
DEFAULT_MAX_MODEL_LEN = 4096
# Most logprobs a request may ask for per token unless LLM(max_logprobs=...) says otherwise: vLLM's default
# (OpenAI's top_logprobs cap).
DEFAULT_MAX_LOGPROBS = 20
# LLM(max_logprobs=...) value for no cap: a request may ask for the whole vocabulary (vLLM's spelling).
NO_LOGPROBS_CAP = -1


# vLLM's max_seq_len_to_capture default (releases up to 0.10; lighteval's released builds read it as
# the context length when given none): CUDA graphs covered sequences up to this length.
VLLM_MAX_SEQ_LEN_TO_CAPTURE = 8192


@dataclass(frozen=True)
class ServedModel:
    """What vLLM clients read from `llm.llm_engine.model_config` (lm-eval: max_model_len; RL and
    analysis scripts: hf_config's layer and expert counts, get_num_layers, quantization): the
    checkpoint and tokenizer directories, the longest sequence served, the weights' dtype, their
    quantization method (vLLM's name: "fp8", "compressed-tensors", "fbgemm_fp8", "modelopt"; None: full precision)."""

    model: str
    tokenizer: str
    max_model_len: int
    dtype: torch.dtype
    hf_overrides: dict | None = field(default=None, compare=False)
    quantization: str | None = None  # quantization/checkpoint_config.quantization_method

    @functools.cached_property
    def hf_config(self) -> PretrainedConfig:
        """transformers' reading of the checkpoint's config.json as hf_overrides edit it (read on first
        use; as the file's own keys: from_pretrained's keyword overrides lose a published rope_theta
        beside an overriding rope_scaling)."""
        from transformers import AutoConfig  # transformers loads on first use, not with nanovllm

        if not self.hf_overrides:
            return AutoConfig.from_pretrained(self.model)
        return AutoConfig.for_model(**read_config_json(self.model, self.hf_overrides))

    @property
    def hf_text_config(self) -> PretrainedConfig:
        return self.hf_config  # text models: the same config

    def get_vocab_size(self) -> int:
        return self.hf_text_config.vocab_size

    def get_num_layers(self, parallel_config: object) -> int:
        """vLLM's ModelConfig.get_num_layers: the hidden layers of one pipeline stage of
        `parallel_config` (llm.llm_engine.vllm_config's), as vLLM counts them (hf_text_config's
        num_hidden_layers); one stage here (no pipeline parallelism): all."""
        stages = getattr(parallel_config, "pipeline_parallel_size", None)
        if stages != 1:
            raise ValueError(f"get_num_layers takes the engine's parallel_config (pipeline_parallel_size 1: no "
                             f"pipeline parallelism), got {parallel_config!r}")
        return self.hf_text_config.num_hidden_layers

    @property
    def max_seq_len_to_capture(self) -> int:
        return min(VLLM_MAX_SEQ_LEN_TO_CAPTURE, self.max_model_len)


@dataclass
class Config:
    """Validated engine settings. Field names and defaults follow nano-vllm / vLLM."""

    model: str
    max_num_batched_tokens: int = 16384
    max_num_seqs: int = 512
    # The longest sequence (prompt + output) served. None: DEFAULT_MAX_MODEL_LEN, or the model's
    # positions where fewer (max_position_embeddings, as its RoPE scaling extends it: ModelConfig.max_positions)
    # or its attention window (sliding_window) where shorter; a value above them is a ValueError.
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    enforce_eager: bool = False
    # With CUDA graphs on: also capture prefill / mixed steps, one graph per token bucket (their
    # host cost leaves the critical path; start-up +3-10 s). False: decode graphs only (vLLM's
    # FULL_DECODE_ONLY), prefill and mixed steps run eagerly at their exact token count.
    prefill_graphs: bool = True
    kvcache_block_size: int = 256
    num_kvcache_blocks: int | None = None
    # The KV cache's bytes on each GPU (vLLM's option): sizes the cache instead of gpu_memory_utilization.
    kv_cache_memory_bytes: int | None = None
    device: str | None = None
    # "auto", a DTYPES name, vLLM's other spellings of them (DTYPE_ALIASES) or a torch.dtype
    dtype: str | torch.dtype = "auto"
    # The tokenizer's directory (vLLM's option); None: the model's.
    tokenizer: str | None = None
    enable_prefix_caching: bool = True
    # The KV cache's element type (vLLM's names): "auto" = the model's dtype; "fp8" / "fp8_e4m3" =
    # float8 e4m3 with per-layer scales (engine/kv_cache.py), about twice the blocks in the same memory.
    kv_cache_dtype: str = "auto"
    # An FP8 cache's per-layer scales (vLLM's option): None, the checkpoint's, else computed from the first
    # prefill step's data; True: computed from the data always; False (vLLM's default): the checkpoint's, else 1.0.
    calculate_kv_scales: bool | None = None
    # Plan step N+1 (decode or mixed) while step N runs on the device (hides host time). Used when
    # tensor_parallel_size is 1; tensor-parallel steps run one at a time.
    overlap_scheduling: bool = True
    # One token budget per step shared by decode rows and prefill chunks (vLLM V1). False:
    # a step with admissible waiting requests prefills only (nano-vllm's policy).
    mixed_steps: bool = True
    load_format: str = "auto"
    attention_backend: str = "auto"
    # Noise of unseeded requests (and dummy weights). None is 0, as vLLM V1 reads it (its ModelConfig / EngineArgs:
    # "it is impossible to un-specify a seed", docs/usage/reproducibility.md, PR #17929): runs repeat.
    seed: int | None = 0
    # Row counts at which CUDA layers switch kernels (layers/kernel_path.py); the defaults are the
    # measured best, another value is for A/B runs.
    kernel_routes: KernelRoutes = field(default_factory=KernelRoutes)
    # None: as the checkpoint is (an FP8 checkpoint's quantization_config is read); "fp8": FP8
    # weights, quantized at load from a full-precision checkpoint (quantization/config.py).
    quantization: str | None = None
    # Where generate()'s default SamplingParams come from (vLLM's option): "auto" the checkpoint's
    # generation_config.json, "vllm" SamplingParams() alone, or a directory holding such a file.
    generation_config: str = "auto"
    # generation_config keys set over it (vLLM's option), e.g. {"temperature": 0.5, "max_new_tokens": 256}.
    override_generation_config: dict | None = None
    # What sample logprobs report (vLLM's option and names): "raw_logprobs", "raw_logits",
    # "processed_logprobs" or "processed_logits" (sampling/logprobs_mode.py).
    logprobs_mode: LogprobsMode | str = LogprobsMode.RAW_LOGPROBS
    # config.json keys replaced before it is read (vLLM's option, a dict; a shallow update), e.g.
    # {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}},
    # Qwen3's documented setting for contexts past 32,768 tokens.
    hf_overrides: dict | None = None
    # No tokenizer is loaded (vLLM's option, for callers that tokenize themselves): prompts must be token
    # ids and texts stay empty, as for a model directory without one.
    skip_tokenizer_init: bool = False
    # Most logprobs (and prompt logprobs) a request may ask for per token (vLLM's option); -1: no cap,
    # up to the whole vocabulary. A request over it is a ValueError when it is added.
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    # Filled in by __post_init__ from config.json; not user settings.
    model_config: ModelConfig = field(init=False, repr=False)
    quant_config: QuantConfig | None = field(init=False, repr=False)
    # The checkpoint's quantization config as written (config.json's, else hf_quant_config.json's; None: none).
    checkpoint_quantization: dict | None = field(init=False, repr=False)

    @classmethod
    def from_kwargs(cls, model: object, kwargs: dict) -> "Config":
        """Build a Config, raising TypeError that names an unknown keyword. vLLM's keywords
        without a setting here are checked and dropped, and its None defaults mean ours
        (engine_args.py)."""
        kwargs = strip_vllm_only_args(kwargs)
        known = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            taken = [*known, *VLLM_ONLY_ARGS, *RENAMED, *HF_OVERRIDE_ARGS]
            raise TypeError(f"LLM() got unknown keyword argument(s): "
                            f"{', '.join(_unknown_hint(name, taken) for name in unknown)}")
        return cls(model=model, **kwargs)

    def __post_init__(self) -> None:
        self.model = _directory("model", self.model, "a checkpoint directory")
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        check_int("max_num_seqs", self.max_num_seqs, 1)
        if self.max_model_len is not None:
            check_int("max_model_len", self.max_model_len, 2)
        check_int("tensor_parallel_size", self.tensor_parallel_size, 1)
        check_int(_SHOWN["kvcache_block_size"], self.kvcache_block_size, BLOCK_SIZE_MULTIPLE)
        if self.kvcache_block_size % BLOCK_SIZE_MULTIPLE:
            raise ValueError(f"{_SHOWN['kvcache_block_size']} must be a multiple of {BLOCK_SIZE_MULTIPLE}, "
                             f"got {self.kvcache_block_size}")
        if self.num_kvcache_blocks is not None:
            check_int(_SHOWN["num_kvcache_blocks"], self.num_kvcache_blocks, 1)
        check_int("max_logprobs", self.max_logprobs, NO_LOGPROBS_CAP)
        if self.hf_overrides is not None:
            if not isinstance(self.hf_overrides, dict) or not all(isinstance(k, str) for k in self.hf_overrides):
                raise TypeError(f"hf_overrides must be a dict of config.json keys (nanovllm reads config.json itself, "
                                f"so a function over transformers' config is not taken), got {self.hf_overrides!r}")
            self.hf_overrides = copy.deepcopy(self.hf_overrides)  # ours: the caller's dict stays as given
        if self.seed is None:  # vLLM V1's default: seed 0
            self.seed = 0
        check_seed("seed", self.seed)
        check_number("gpu_memory_utilization", self.gpu_memory_utilization)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        for name in ("enforce_eager", "prefill_graphs", "enable_prefix_caching", "overlap_scheduling",
                     "mixed_steps", "skip_tokenizer_init"):
            check_bool(name, getattr(self, name))
        if isinstance(self.dtype, torch.dtype):  # vLLM takes a torch.dtype too
            self.dtype = next((name for name, t in DTYPES.items() if t == self.dtype), str(self.dtype))
        if isinstance(self.dtype, str):
            self.dtype = DTYPE_ALIASES.get(self.dtype, self.dtype)
        if not isinstance(self.dtype, str) or (self.dtype != "auto" and self.dtype not in DTYPES):
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)} (or {sorted(DTYPE_ALIASES)}), "
                             f"got {self.dtype!r}")
        if self.tokenizer is None:
            self.tokenizer = self.model
        else:  # asked for by name: one without a tokenizer is a mistake (the model's may lack one)
            self.tokenizer = _directory("tokenizer", self.tokenizer, "a tokenizer directory")
            if not self.skip_tokenizer_init and not has_tokenizer(self.tokenizer):
                raise ValueError(f"tokenizer directory {self.tokenizer!r} holds no tokenizer (none of "
                                 f"{', '.join(TOKENIZER_FILES)})")
        if self.calculate_kv_scales is not None and not isinstance(self.calculate_kv_scales, bool):
            raise TypeError(f"calculate_kv_scales must be None or a bool, got {self.calculate_kv_scales!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.load_format not in _LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {_LOAD_FORMATS}, got {self.load_format!r}")
        if self.load_format == "safetensors" and not checkpoint_files(self.model, "safetensors"):
            bins = [os.path.basename(f) for f in checkpoint_files(self.model)]  # "auto"'s: its .bin files
            held = (f"PyTorch .bin weights: {', '.join(bins[:3])}{f' and {len(bins) - 3} more' if len(bins) > 3 else ''}"
                    if bins else "no weights files")
            raise ValueError(f"load_format='safetensors' but model directory {self.model!r} has no *.safetensors "
                             f"files (it holds {held}): pass load_format='auto' to read PyTorch .bin weights")
        if self.attention_backend not in _BACKENDS:
            raise ValueError(f"attention_backend must be one of {_BACKENDS}, got {self.attention_backend!r}")
        if not isinstance(self.generation_config, (str, os.PathLike)):
            raise TypeError(f"generation_config must be 'auto', 'vllm' or a directory, got {self.generation_config!r}")
        self.generation_config = os.fspath(self.generation_config)
        if self.generation_config not in GENERATION_CONFIG_SOURCES and not os.path.isdir(self.generation_config):
            raise ValueError(f"generation_config must be 'auto', 'vllm' or a directory, got {self.generation_config!r} "
                             "(not a directory)")
        if self.override_generation_config is not None:
            check_generation_overrides(self.override_generation_config)
            self.override_generation_config = dict(self.override_generation_config)  # ours, as hf_overrides
        self.logprobs_mode = LogprobsMode.parse(self.logprobs_mode)
        if not isinstance(self.kernel_routes, KernelRoutes):
            raise TypeError(f"kernel_routes must be a KernelRoutes, got {self.kernel_routes!r}")
        if self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be None, 'cpu' or 'cuda', got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' was asked for but torch sees no CUDA device")

        self.model_config = ModelConfig.from_pretrained(self.model, self.hf_overrides)
        for key in ("rope_scaling", "rope_parameters"):  # an overriding RoPE dict without a theta: the one served,
            rope = (self.hf_overrides or {}).get(key)  # for hf_config (transformers reads it from that dict alone)
            if isinstance(rope, dict):
                rope.setdefault("rope_theta", self.model_config.rope_theta)
        if self.kv_cache_dtype == "bfloat16" and self.torch_dtype != torch.bfloat16:
            raise ValueError(f"kv_cache_dtype='bfloat16' needs the model to compute in bfloat16, but it computes in "
                             f"{self.torch_dtype} (dtype={self.dtype!r}): the cache holds the compute dtype or FP8 "
                             f"(use kv_cache_dtype='auto', or dtype='bfloat16')")
        self.checkpoint_quantization, source = checkpoint_quantization(self.model,
                                                                       self.model_config.quantization_config)
        self.quant_config = resolve_quantization(self.quantization, self.checkpoint_quantization, source)
        positions = self.model_config.max_positions
        window = self.model_config.sliding_window
        if self.max_model_len is None:
            self.max_model_len = min(DEFAULT_MAX_MODEL_LEN, positions, window or positions)
        elif window is not None and self.max_model_len > window:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's attention window (sliding_window="
                             f"{window} in {os.path.join(self.model, 'config.json')}): sliding-window attention is "
                             f"not implemented, so sequences are served up to max_model_len <= {window}, where "
                             f"the window masks nothing")
        elif self.max_model_len > positions:
            scaled = "" if self.model_config.rope_scaling is None else " with its RoPE scaling"
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the {positions} positions the model serves"
                             f"{scaled} ({os.path.join(self.model, 'config.json')}'s max_position_embeddings="
                             f"{self.model_config.max_position_embeddings}): pass max_model_len <= {positions}, or "
                             f"None for min({DEFAULT_MAX_MODEL_LEN}, {positions})")
        self.model_config.check_tensor_parallel(self.tensor_parallel_size)
        if self.device == "cuda" and self.tensor_parallel_size > torch.cuda.device_count():
            raise ValueError(
                f"tensor_parallel_size={self.tensor_parallel_size} exceeds the "
                f"{torch.cuda.device_count()} visible CUDA device(s)"
            )
        if self.kv_cache_memory_bytes is not None:
            check_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes, 1)
            if self.num_kvcache_blocks is not None:
                raise ValueError("pass num_kvcache_blocks or kv_cache_memory_bytes, not both")

    @property
    def generation_dir(self) -> str:
        """The directory whose generation_config.json (if any) gives the EOS ids, and the default
        SamplingParams unless generation_config is "vllm": the checkpoint's, or the one
        `generation_config` names (vLLM's rule)."""
        return self.model if self.generation_config in GENERATION_CONFIG_SOURCES else self.generation_config

    @property
    def logprobs_limit(self) -> int:
        """The most logprobs a request may ask for per token: max_logprobs, or the vocabulary's size
        without a cap."""
        return self.model_config.vocab_size if self.max_logprobs == NO_LOGPROBS_CAP else self.max_logprobs

    @functools.cached_property
    def torch_dtype(self) -> torch.dtype:
        """Weights and activations dtype, unless set: float32 on CPU; on CUDA the checkpoint's where it is
        16-bit (CUDA_AUTO_DTYPES), else CUDA_AUTO_FALLBACK (logged once)."""
        if self.dtype != "auto":
            return DTYPES[self.dtype]
        if self.device == "cpu":
            return torch.float32
        stored = self.model_config.torch_dtype
        if stored not in CUDA_AUTO_DTYPES:
            logger.info("dtype='auto': the checkpoint's %s runs as %s (pass dtype=... to choose)", stored,
                        CUDA_AUTO_FALLBACK)
            return CUDA_AUTO_FALLBACK
        return stored

    @functools.cached_property
    def served_model(self) -> ServedModel:
        """vLLM's ModelConfig as clients read it: `llm.llm_engine.model_config`, and a collective_rpc
        worker's `model_config` (on every rank)."""
        return ServedModel(self.model, self.tokenizer, self.max_model_len, self.torch_dtype, self.hf_overrides,
                           quantization_method(self.quantization, self.checkpoint_quantization))

    @property
    def kv_cache_torch_dtype(self) -> torch.dtype:
        """The KV cache's element type: float8 e4m3 for "fp8" / "fp8_e4m3", and for "auto" on a ModelOpt
        checkpoint that calibrated an FP8 cache (checkpoint_config.calibrated_fp8_kv); else the model's."""
        fp8 = self.kv_cache_dtype in KV_CACHE_FP8 or (self.kv_cache_dtype == "auto"
                                                     and calibrated_fp8_kv(self.checkpoint_quantization))
        return FP8_KV_DTYPE if fp8 else self.torch_dtype

    @property
    def max_blocks_per_seq(self) -> int:
        """Block-table width that covers a sequence of max_model_len tokens."""
        return cdiv(self.max_model_len, self.kvcache_block_size)
