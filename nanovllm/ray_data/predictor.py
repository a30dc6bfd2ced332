"""LLMPredictor: one engine replica as a Ray Data callable class (`ds.map_batches(LLMPredictor, ...)`).

A batch (map_batches' default numpy format: column -> array) holds prompts in a `prompt` (text),
`prompt_token_ids` or `messages` (a conversation, rendered by the chat template as LLM.chat does)
column, or several (JSON lines of mixed kinds: Ray fills a row's other columns with None; each row
must hold exactly one; a conversation ending with the assistant's message is continued, as Ray's
chat stage does: chat_options), optionally a `cache_salt` column (vLLM V1's prompt key: a row's non-empty
str goes into its prompt dict, so its prefix-cache hits come only from prompts of the same salt;
None or no column: no salt), a row holding images in a MULTIMODAL_COLUMNS column refused (a
text-only engine) as is one whose MODEL_COLUMN names another model (vLLM's LoRA adapter), and optionally a `sampling_params` column: per row, a
dict of SamplingParams fields that override the predictor's own (None values, or a None row, leave
them as they are; `structured_outputs` as a dict of StructuredOutputsParams fields; `logit_bias` keys
may be JSON's strings; a `guided_decoding` dict, as vLLM's Ray Data rows give it, is the
structured_outputs). What Arrow made of such rows is undone first (row_overrides): numpy arrays
and scalars at any depth, None entries of nested dicts (Arrow gives every row the keys of all the
rows), integral floats (an int beside rows without it), NaN columns (a read column None in every row
of a block: null_columns_as_none). The whole batch goes to one `generate`
call, so the actor's engine batches it as one engine does; the batch comes back with every input
column unchanged plus OUTPUT_COLUMNS (vLLM's Ray Data names among them; and LOGPROB_COLUMNS when a row asks for logprobs), one row
per prompt. A prompt the engine refuses (empty, too long, ids outside the vocabulary, a cache_salt
that is not a non-empty str) or a bad override raises the engine's own ValueError / TypeError, prefixed with the row it came from, before
anything of the batch is queued: Ray Data then fails the dataset with that message instead of
hanging.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import numpy as np
import ray

from nanovllm.engine.chat import ChatOptions, render_chat
from nanovllm.inputs import TokensPrompt, tokens_prompt
from nanovllm.llm import LLM
from nanovllm.sampling_params import SamplingParams, StructuredOutputsParams, field_types

# The prompt columns a batch may carry (each row holds exactly one of them): text, token ids, or a
# conversation (a list of {"role", "content"} dicts, as vLLM's Ray Data rows hold it), rendered by the
# checkpoint's chat template as LLM.chat renders one.
TEXT_COLUMN = "prompt"
TOKEN_IDS_COLUMN = "prompt_token_ids"
MESSAGES_COLUMN = "messages"
PROMPT_COLUMNS = (TEXT_COLUMN, TOKEN_IDS_COLUMN, MESSAGES_COLUMN)
# The optional column of per-row prompt salts (vLLM V1's "cache_salt" prompt key, as vLLM's Ray Data
# rows carry it): None, or no column, gives a row no salt.
SALT_COLUMN = "cache_salt"
# Columns that vLLM's Ray Data stage feeds the model beside the prompt (images and other media:
# "multimodal_data", older Ray's "image"). The engine is text-only: a row holding one is refused
# rather than answered from its text alone. None or an empty list / dict (or a dict of Nones, Arrow's
# fill of a row without the key other rows have) is a row without media.
MULTIMODAL_COLUMNS = ("multimodal_data", "image")
# The column in which vLLM's Ray Data rows name the model to serve them: a name other than the
# stage's model is a LoRA adapter. nanovllm serves none: a row naming another model is refused
# rather than answered by the base model; the predictor's own model, or None, is served.
MODEL_COLUMN = "model"
# The optional column of per-row SamplingParams overrides (vLLM's Ray Data rows use this name).
SAMPLING_COLUMN = "sampling_params"
# The columns LLMPredictor reads, in which None means "not given" for the row.
READ_COLUMNS = (*PROMPT_COLUMNS, SALT_COLUMN, SAMPLING_COLUMN, MODEL_COLUMN, *MULTIMODAL_COLUMNS)
# Columns every output batch gains: the completion's text, its token ids, "stop" | "length", and
# (vLLM's Ray Data names) the prompt's token count as served and the completion's, and the
# completion's token ids again as `generated_tokens` (vLLM's Ray Data name of them: a postprocess
# ported from vLLM's processor reads it).
OUTPUT_COLUMNS = ("generated_text", "generated_token_ids", "finish_reason", "num_input_tokens", "num_generated_tokens",
                  "generated_tokens")
# Columns added when a row's SamplingParams.logprobs is set (None in rows that did not ask): per
# generated token, a list of {"token_id", "logprob"} (the sampled token first, then the k most
# likely: the engine's order; Arrow cannot hold dicts keyed by varying ints), and the sum of the
# sampled tokens' logprobs.
LOGPROB_COLUMNS = ("logprobs", "cumulative_logprob")
# SamplingParams fields that take ints. Arrow's numpy conversion of a struct column (the
# sampling_params column) turns an int field with nulls in other rows into floats: 2 -> 2.0.
INT_SAMPLING_FIELDS = frozenset(name for name, hint in field_types().items()
                                if hint is int or (typing.get_origin(hint) is types.UnionType and int in typing.get_args(hint)))
# vLLM's older name of SamplingParams.structured_outputs: vLLM's Ray Data takes a sampling_params dict's
# "guided_decoding" dict as the request's StructuredOutputsParams.
GUIDED_DECODING_KEY = "guided_decoding"
# Longest repr of one column value quoted in a bad row's error message.
ROW_VALUE_CHARS = 80
# A logit_bias key that JSON (or Arrow's struct field names) turned into text: "42", "-1".
TOKEN_ID_TEXT = re.compile(r"-?[0-9]+")


def token_id_keys(bias: Mapping) -> dict:
    """A logit_bias with its integer-text keys ("42": JSON's object keys) made ints; any other key as
    is, for SamplingParams to refuse by name."""
    return {int(t) if isinstance(t, str) and TOKEN_ID_TEXT.fullmatch(t) else t: b for t, b in bias.items()}


def sampling_keywords(fields: Mapping) -> dict:
    """SamplingParams keywords from a dict of its fields (JSON, the command's flags, Arrow rows): a
    `structured_outputs` dict made a StructuredOutputsParams, as is a `guided_decoding` dict (vLLM's
    Ray Data rows carry the constraint under that older name and make it their structured_outputs),
    a `logit_bias` dict keyed by token ids."""
    out = dict(fields)
    if isinstance(out.get(GUIDED_DECODING_KEY), Mapping):
        if out.get("structured_outputs") is not None:
            raise ValueError(f"sampling_params has both {GUIDED_DECODING_KEY!r} (vLLM's older name of structured_outputs) "
                             "and 'structured_outputs': give one")
        out["structured_outputs"] = out.pop(GUIDED_DECODING_KEY)
    if isinstance(out.get("structured_outputs"), Mapping):
        out["structured_outputs"] = StructuredOutputsParams(**out["structured_outputs"])
    if isinstance(out.get("logit_bias"), Mapping):
        out["logit_bias"] = token_id_keys(out["logit_bias"])
    return out


def sampling_params_of(value: SamplingParams | Mapping | None) -> SamplingParams:
    """SamplingParams from an instance, a dict of its fields, or None (its defaults). One row in,
    one row out: `n` > 1 and `prompt_logprobs` are refused (repeat a row instead of n)."""
    if value is None:
        params = SamplingParams()
    elif isinstance(value, SamplingParams):
        params = value
    elif isinstance(value, Mapping):
        params = SamplingParams(**sampling_keywords(value))
    else:
        raise TypeError(f"sampling_params must be SamplingParams, a dict of its fields or None, got {value!r}")
    if params.n != 1:
        raise ValueError(f"LLMPredictor makes one completion per row: SamplingParams.n={params.n} is not "
                         "supported (repeat the rows, with different seeds, instead)")
    if params.prompt_logprobs is not None:
        raise ValueError(f"LLMPredictor returns completions only: SamplingParams.prompt_logprobs="
                         f"{params.prompt_logprobs} is not supported")
    return params


def replica_tensor_parallel_size(num_gpus: int, requested: int | None) -> int:
    """The engine's tensor_parallel_size in an actor holding `num_gpus` GPUs (Ray's assignment):
    all of them when it holds several. `requested` (llm_kwargs' own value, if any) must agree with
    that; without GPUs (CPU engines) it is taken as given."""
    if num_gpus > 1 and requested not in (None, num_gpus):
        raise ValueError(f"llm_kwargs tensor_parallel_size={requested} but the actor holds {num_gpus} GPUs "
                         f"(map_batches' num_gpus): leave it out, or make them equal")
    if num_gpus == 1 and requested not in (None, 1):
        raise ValueError(f"llm_kwargs tensor_parallel_size={requested} but the actor holds 1 GPU: "
                         f"pass num_gpus={requested} to map_batches")
    if num_gpus > 1:
        return num_gpus
    return 1 if requested is None else requested


class LLMPredictor:
    """`ds.map_batches(LLMPredictor, fn_constructor_kwargs=dict(model=..., sampling_params=...,
    llm_kwargs=...), compute=ray.data.ActorPoolStrategy(size=N), batch_size=B, num_gpus=G)`.

    model: the checkpoint directory (every node reads it at this path). sampling_params: one
    SamplingParams (or a dict of its fields) for every row; None: the engine's defaults
    (LLM.get_default_sampling_params: the checkpoint's generation_config). llm_kwargs: LLM's keywords
    (max_model_len, dtype, ...); tensor_parallel_size is the actor's GPU count when G > 1.
    """

    def __init__(self, model: str, sampling_params: SamplingParams | Mapping | None = None,
                 llm_kwargs: Mapping | None = None):
        # checked before an engine is built; None: the engine's defaults, once it is
        params = None if sampling_params is None else sampling_params_of(sampling_params)
        if llm_kwargs is not None and not isinstance(llm_kwargs, Mapping):
            raise TypeError(f"llm_kwargs must be a dict of LLM keywords, got {llm_kwargs!r}")
        kwargs = dict(llm_kwargs or {})
        num_gpus = len(ray.get_gpu_ids()) if ray.is_initialized() else 0
        kwargs["tensor_parallel_size"] = replica_tensor_parallel_size(num_gpus, kwargs.get("tensor_parallel_size"))
        self.llm = LLM(model, **kwargs)
        self.model = model  # a row's MODEL_COLUMN value must equal it
        self.params = params if params is not None else sampling_params_of(self.llm.get_default_sampling_params())

    def __call__(self, batch: Mapping[str, np.ndarray]) -> dict[str, np.ndarray | list]:
        if not isinstance(batch, Mapping):
            raise TypeError(f"LLMPredictor takes numpy batches (column -> array: map_batches' default "
                            f"batch_format), got {type(batch).__name__}")
        given = batch
        batch = null_columns_as_none(batch)
        columns = prompt_columns(batch)
        rows = range(len(batch[columns[0]]))
        params = [self._row_params(batch, i) for i in rows] if SAMPLING_COLUMN in batch else [self.params] * len(rows)
        with_logprobs = any(p.logprobs is not None for p in params)
        clash = [c for c in OUTPUT_COLUMNS + (LOGPROB_COLUMNS if with_logprobs else ()) if c in batch]
        if clash:
            raise ValueError(f"the batch already has column(s) {clash}, which LLMPredictor writes: rename them")
        prompts = [self._row_prompt(batch, columns, i, params[i]) for i in rows]
        try:
            outputs = self.llm.generate(prompts, params, use_tqdm=False)
        except (TypeError, ValueError):
            if SAMPLING_COLUMN in batch:  # the engine's own checks of a row's overrides: name the row
                for i in rows:
                    with naming_row(batch, i):
                        self.llm.check_params(params[i])
            raise
        out: dict[str, np.ndarray | list] = dict(given)  # the input columns as they came
        out["generated_text"] = [o["text"] for o in outputs]
        out["generated_token_ids"] = [list(o["token_ids"]) for o in outputs]
        out["finish_reason"] = [o["finish_reason"] for o in outputs]
        out["num_input_tokens"] = [len(o.prompt_token_ids) for o in outputs]
        out["num_generated_tokens"] = [len(o["token_ids"]) for o in outputs]
        out["generated_tokens"] = [list(o["token_ids"]) for o in outputs]
        if with_logprobs:
            asked = [p.logprobs is not None for p in params]
            out["logprobs"] = [[[{"token_id": t, "logprob": lp} for t, lp in entry.items()] for entry in o["logprobs"]]
                               if a else None for o, a in zip(outputs, asked)]
            out["cumulative_logprob"] = [o["cumulative_logprob"] if a else None for o, a in zip(outputs, asked)]
        return out

    def _row_params(self, batch: Mapping[str, np.ndarray], i: int) -> SamplingParams:
        """The predictor's SamplingParams with row i's overrides (SamplingParams' own checks)."""
        overrides = batch[SAMPLING_COLUMN][i]
        if overrides is None:  # a row without overrides (others of the batch have some)
            return self.params
        with naming_row(batch, i):
            if not isinstance(overrides, Mapping):
                raise TypeError(f"{SAMPLING_COLUMN} must hold dicts of SamplingParams fields, got {plain(overrides)!r}")
            chosen = sampling_keywords(row_overrides(overrides))
            return sampling_params_of(dataclasses.replace(self.params, **chosen))

    def _row_prompt(self, batch: Mapping[str, np.ndarray], columns: list[str], i: int,
                    params: SamplingParams) -> TokensPrompt:
        """Row i's prompt (from its one prompt column that is not None) as a TokensPrompt, with the
        row's cache_salt when it has one, checked by the engine's own validator; a conversation
        rendered as LLM.chat renders it."""
        with naming_row(batch, i):
            given = [c for c in columns if batch[c][i] is not None]
            if len(given) != 1:
                raise ValueError(f"a row needs exactly one of {TEXT_COLUMN!r} (text), {TOKEN_IDS_COLUMN!r} and "
                                 f"{MESSAGES_COLUMN!r} (a conversation), got {given or 'none'}")
            # json_form: without the None entries Arrow gives a row for keys other rows' dicts have
            media = [c for c in MULTIMODAL_COLUMNS if c in batch and json_form(plain(batch[c][i])) not in (None, [], {})]
            if media:
                raise ValueError(f"{media[0]!r} holds the row's images or other media (vLLM's Ray Data input), "
                                 "but nanovllm's engine is text-only: drop the column, or leave the row's value None")
            model = plain(batch[MODEL_COLUMN][i]) if MODEL_COLUMN in batch else None
            if model is not None and model != self.model:
                raise ValueError(f"{MODEL_COLUMN!r} is {model!r}, not the predictor's model {self.model!r}: vLLM's Ray Data "
                                 "serves such a row with that LoRA adapter, and nanovllm serves no LoRA adapters")
            column = given[0]
            value = plain(batch[column][i])
            if column == TEXT_COLUMN and not isinstance(value, str):
                raise TypeError(f"{TEXT_COLUMN} must hold text, got {value!r}")
            if column == TOKEN_IDS_COLUMN and not isinstance(value, (list, tuple)):
                raise TypeError(f"{TOKEN_IDS_COLUMN} must hold lists of token ids, got {value!r}")
            if column == MESSAGES_COLUMN:
                if not isinstance(value, list):
                    raise TypeError(f"{MESSAGES_COLUMN} must hold conversations (lists of message dicts), got {value!r}")
                # without the None entries Arrow gives a message for keys other messages have ("name")
                conversation = [json_form(m) if isinstance(m, dict) else m for m in value]
                value = render_chat(self.llm.tokenizer, self.llm.config.tokenizer, [conversation],  # a batch of one
                                    chat_options(conversation))[0]["prompt_token_ids"]
            salt = plain(batch[SALT_COLUMN][i]) if SALT_COLUMN in batch else None
            # as a prompt dict, so that the engine checks the salt (a non-empty str) as it checks any prompt's
            prompt = {"prompt" if column == TEXT_COLUMN else "prompt_token_ids": value, "cache_salt": salt}
            checked = self.llm.validator.validate(prompt, params)
            return tokens_prompt(checked.token_ids, checked.cache_salt)


def chat_options(conversation: list) -> ChatOptions:
    """How a `messages` row is rendered: as Ray Data's chat-template stage does, a conversation that
    ends with the assistant's message (a prefill) is continued (continue_final_message), any other
    opens the assistant's turn (Ray opens it only after a user message; a system or tool message last
    would be left open there, here it is closed as LLM.chat closes it)."""
    last = conversation[-1] if conversation else None
    prefill = isinstance(last, dict) and last.get("role") == "assistant"
    return ChatOptions(add_generation_prompt=not prefill, continue_final_message=prefill)


def plain(value):
    """A column value as plain Python all the way down: numpy arrays (of numbers, or of objects such
    as Arrow's lists of strings) as lists, numpy scalars as Python ones, inside dicts and lists too."""
    if isinstance(value, np.ndarray):
        if value.dtype != object:
            return value.tolist()
        value = value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def integral(value):
    """A float with an integral value as an int (an Arrow-converted int field); anything else as is,
    for SamplingParams to check."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def json_form(value, integral_floats: bool = False):
    """Plain dicts and lists at any depth without their dicts' None entries (a struct column gives
    each row every key of the batch's rows, None where the row had none; list items stay), and with
    `integral_floats` every integral float made an int (JSON schema keywords such as minLength need
    ints; JSON Schema holds 1.0 and 1 equal)."""
    if isinstance(value, dict):
        return {k: json_form(v, integral_floats) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [json_form(v, integral_floats) for v in value]
    return integral(value) if integral_floats else value


def row_overrides(overrides: Mapping) -> dict:
    """A row's `sampling_params` dict, as Arrow's numpy batches hold it, back to its JSON form:
    numpy values as plain Python, fields that are None or {} (the row does not override them: Arrow
    gives a row without a dict field the other rows' keys, all None, when the batch spans files) left out,
    nested dicts without the None entries of other rows' keys, integral floats of int fields (and
    of structured_outputs' (or guided_decoding's) schemas) as ints. A JSON null inside a nested dict reads as absent (Arrow
    cannot tell it apart): a schema that needs one goes as JSON text (`"json": "{...}"`)."""
    chosen = {}
    for name, value in plain(overrides).items():
        value = json_form(value, integral_floats=name in ("structured_outputs", GUIDED_DECODING_KEY))
        if value is None or value == {}:  # a row without the field, in a batch of rows (or files) with it
            continue
        chosen[name] = integral(value) if name in INT_SAMPLING_FIELDS else value
    return chosen


@contextmanager
def naming_row(batch: Mapping[str, np.ndarray], i: int) -> Iterator[None]:
    """Re-raise a TypeError / ValueError (as that base class) with row i of the batch in front of
    its message."""
    try:
        yield
    except (TypeError, ValueError) as err:
        kind = TypeError if isinstance(err, TypeError) else ValueError
        raise kind(f"row {i} of the batch {describe_row(batch, i)}: {err}") from err


def null_columns_as_none(batch: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The batch with each of READ_COLUMNS that holds only NaN floats made a column of Nones: a column
    whose every row of a block is None (Arrow's null type: text rows of a file with
    "prompt_token_ids": null, a cache_salt null in every row) reaches a numpy batch as float NaNs,
    which no read column holds otherwise. Any other column as it is."""
    def null(values) -> bool:
        return isinstance(values, np.ndarray) and values.dtype.kind == "f" and bool(np.isnan(values).all())
    return {name: np.full(len(values), None, dtype=object) if name in READ_COLUMNS and null(values) else values
            for name, values in batch.items()}


def prompt_columns(batch: Mapping[str, np.ndarray]) -> list[str]:
    """The batch's prompt columns (one or more); ValueError naming the columns when it has none."""
    present = [c for c in PROMPT_COLUMNS if c in batch]
    if not present:
        raise ValueError(f"a batch needs a {TEXT_COLUMN!r} (text), {TOKEN_IDS_COLUMN!r} or {MESSAGES_COLUMN!r} "
                         f"(a conversation) column, got columns {sorted(batch)}")
    return present


def describe_row(batch: Mapping[str, np.ndarray], i: int) -> str:
    """Row i as {column: value} (each value's repr cut to ROW_VALUE_CHARS), for error messages."""
    def short(value) -> str:
        text = repr(plain(value))
        return text if len(text) <= ROW_VALUE_CHARS else text[: ROW_VALUE_CHARS - 3] + "..."
    return "{" + ", ".join(f"{name!r}: {short(values[i])}" for name, values in batch.items()) + "}"
