"""Structured outputs, the host side: grammars compiled by xgrammar, one matcher per constrained
sample, and the token masks of a step's constrained rows (the sampler applies them:
sampling/token_mask.py).

xgrammar is an optional dependency (`pip install 'nanovllm[structured]'`), imported when an engine
meets its first request with `structured_outputs`, never by `import nanovllm`. Why xgrammar rather
than llguidance: docs/structured_outputs.md (measured).

Per step (engine/step_pipeline.py): the forward is queued first, then the masks of the step's
constrained rows are filled on the host while the device runs it, copied up, and the sampling
queued. Under overlap scheduling the fill of step N+1's masks, which needs step N's tokens
accepted, runs on the backend's worker thread (`filling`: xgrammar's own threads, the GIL
released) while the engine's thread records step N and prepares step N+2; without it the fill
runs on the engine's thread (`token_mask`).

    request with structured_outputs ─> GrammarBackend.compile (once per distinct grammar: cached)
    each of its n samples ─> SampleGrammar (a matcher at the grammar's start)
    a step's kept tokens ─> accept_tokens (Scheduler.advance_grammars)
    each step ─> GrammarBackend.token_mask / filling(rows, grammars) ─> sampler: -inf where not allowed
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from functools import partial

import torch

from nanovllm.sampling.token_mask import TokenMask, mask_words
from nanovllm.structured_outputs_params import StructuredOutputsParams

INSTALL_HINT = "pip install 'nanovllm[structured]' (or: pip install xgrammar)"
# CPU threads a step's masks are filled with: xgrammar's "auto" is half the machine's hardware threads.
MASK_FILL_THREADS = "auto"
# Bytes of compiled grammars the compiler keeps (vLLM's VLLM_XGRAMMAR_CACHE_MB default): least recently
# used ones go past it. Unbounded, a distinct schema a request kept ~310 KiB each at a 151,936-token vocabulary.
GRAMMAR_CACHE_BYTES = 512 * 1024 * 1024
# vLLM's json_object: any JSON object.
JSON_OBJECT_SCHEMA = '{"type": "object"}'
# JSON schema keywords whose values are schemas, lists of schemas, or maps of names to schemas (walked to
# find keywords xgrammar does not enforce; other values, such as enum's or const's, are data).
SCHEMA_KEYWORDS = ("items", "additionalItems", "additionalProperties", "unevaluatedItems", "unevaluatedProperties",
                   "propertyNames", "contains", "not", "if", "then", "else")
SCHEMA_LIST_KEYWORDS = ("items", "prefixItems", "allOf", "anyOf", "oneOf")
SCHEMA_MAP_KEYWORDS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# Keywords xgrammar (0.2.9) compiles without enforcing them: its grammar accepts instances that break them
# (tests/test_structured_outputs.py shows each). vLLM's xgrammar backend refuses them too.
UNENFORCED_KEYWORDS = ("contains", "minContains", "maxContains", "not", "if", "then", "else",
                       "dependentRequired", "dependentSchemas")
# String formats xgrammar enforces (its JSON schema converter's list, as vLLM's STRING_SUPPORTED_FORMATS).
XGRAMMAR_FORMATS = frozenset({"email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid",
                              "uri", "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"})
# Keywords beside a $ref that constrain nothing (xgrammar drops every sibling of a $ref).
REF_NEUTRAL_KEYWORDS = frozenset({"$ref", "$defs", "definitions", "$schema", "$id", "$comment", "title",
                                  "description", "default", "examples"})
# Keywords xgrammar compiles alone, dropping their siblings as of a $ref: a constraint beside one is not enforced.
COMBINATOR_KEYWORDS = ("anyOf", "oneOf", "allOf")
# Beside a combinator, also neutral: OpenAPI's discriminator (pydantic's discriminated unions) names the
# property that tells the branches apart, which the branches' own consts already enforce.
COMBINATOR_NEUTRAL_KEYWORDS = REF_NEUTRAL_KEYWORDS - {"$ref"} | {"discriminator"}
# Escaped ASCII letters xgrammar (0.2.9) reads as the letter itself, outside and inside a [...] class, where
# Python's re reads an anchor (\A, \Z) and PCRE an anchor (\z, \G), a class (\h, \R, \X) or a quote
# (\Q...\E), or both fail: a completion would hold the letter (tests/test_structured_outputs.py shows some).
XGRAMMAR_LITERAL_ESCAPES = frozenset("ghijlmoqyzACEFGHIJKLMNOQRTVXYZ")
XGRAMMAR_LITERAL_CLASS_ESCAPES = XGRAMMAR_LITERAL_ESCAPES | frozenset("kpBP")
# A comment of a grammar line (Lark's // and EBNF's #), dropped before looking for EBNF's `::=`.
GRAMMAR_COMMENT = re.compile(r"(#|//).*$")


def import_xgrammar():
    """The xgrammar module, or an ImportError that says how to install it."""
    try:
        import xgrammar
    except ImportError as e:
        raise ImportError(f"structured outputs need the xgrammar package, which is not installed: {INSTALL_HINT}") from e
    return xgrammar


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly `choices` (JSON string escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def is_lark(grammar: str) -> bool:
    """Whether `grammar` is in Lark syntax (start rule `start`) rather than xgrammar's EBNF (`root ::= ...`):
    vLLM's xgrammar backend reads a grammar with no `::=` outside comments as Lark, and so does this one."""
    return not any("::=" in GRAMMAR_COMMENT.sub("", line) for line in grammar.splitlines())


def literal_escape(regex: str) -> str | None:
    """The first escape of `regex` (as "\\L") that xgrammar reads as the escaped letter L itself
    (XGRAMMAR_LITERAL_ESCAPES), None if there is none."""
    in_class, i = False, 0
    while i < len(regex):
        char = regex[i]
        if char == "\\" and i + 1 < len(regex):
            if regex[i + 1] in (XGRAMMAR_LITERAL_CLASS_ESCAPES if in_class else XGRAMMAR_LITERAL_ESCAPES):
                return regex[i : i + 2]
            i += 2  # the escaped character is taken whatever it is (an escaped backslash too)
            continue
        if char == "[" and not in_class:
            in_class = True
            i += 2 if regex[i + 1 : i + 2] == "^" else 1
            i += 1 if regex[i : i + 1] == "]" else 0  # a ] first in a class is one of its characters
            continue
        in_class = in_class and char != "]"
        i += 1
    return None


def unenforced_keyword(schema: object, path: str = "#") -> str | None:
    """The first keyword of JSON schema `schema` that xgrammar would compile without enforcing, as
    "keyword at path" (None: every constraint is enforced). vLLM's xgrammar backend refuses most such
    schemas (its auto mode hands them to another backend); this engine has only xgrammar, and refuses
    also what vLLM serves unchecked: a non-local $ref, a required name properties do not declare, a
    constraint beside anyOf / oneOf / allOf."""
    if not isinstance(schema, dict):
        return None
    found = next((k for k in UNENFORCED_KEYWORDS if k in schema), None)
    types = schema.get("type")
    types = {types} if isinstance(types, str) else set(types) if isinstance(types, list) else None  # None: any
    if schema.get("uniqueItems", False) is not False:
        found = "uniqueItems"
    elif "multipleOf" in schema and not (types == {"integer"} and type(schema["multipleOf"]) is int):
        found = "multipleOf"  # xgrammar enforces it on integers only
    elif types is None or "string" in types:
        if "format" in schema and schema["format"] not in XGRAMMAR_FORMATS:
            found = f"format {schema['format']!r}"
        elif ("pattern" in schema or "format" in schema) and ("minLength" in schema or "maxLength" in schema):
            found = "minLength" if "minLength" in schema else "maxLength"  # dropped beside a pattern or format
        elif isinstance(schema.get("pattern"), str) and (escape := literal_escape(schema["pattern"])) is not None:
            found = f"pattern escape {escape!r}"
    if (types is None or "object" in types) and isinstance(schema.get("required"), list):
        declared = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        undeclared = next((name for name in schema["required"] if name not in declared), None)
        if undeclared is not None:  # xgrammar drops a required name its properties do not declare
            found = f"required {undeclared!r} (not in properties)"
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        found = "allOf"  # xgrammar does not intersect its subschemas
    if "$ref" in schema:
        found = next((k for k in schema if k not in REF_NEUTRAL_KEYWORDS), found)
        ref = schema["$ref"]
        if not (isinstance(ref, str) and (ref == "#" or ref.startswith("#/"))):  # another xgrammar reads as any value
            found = f"$ref {ref!r} (xgrammar resolves only '#' and '#/...')"
    combinator = next((k for k in COMBINATOR_KEYWORDS if k in schema), None)
    if combinator is not None and "$ref" not in schema:
        beside = next((k for k in schema if k != combinator and k not in COMBINATOR_NEUTRAL_KEYWORDS), None)
        if beside is not None:
            found = f"{beside} beside {combinator}"
    if found is not None:
        return f"{found} at {path}"
    for key in SCHEMA_KEYWORDS:
        if (inner := unenforced_keyword(schema.get(key), f"{path}/{key}")) is not None:
            return inner
    for key in SCHEMA_LIST_KEYWORDS:
        value = schema.get(key)
        for i, sub in enumerate(value if isinstance(value, list) else ()):
            if (inner := unenforced_keyword(sub, f"{path}/{key}/{i}")) is not None:
                return inner
    for key in SCHEMA_MAP_KEYWORDS:
        value = schema.get(key)
        for name, sub in (value.items() if isinstance(value, dict) else ()):
            if (inner := unenforced_keyword(sub, f"{path}/{key}/{name}")) is not None:
                return inner
    return None


class SampleGrammar:
    """Where one sample stands in its grammar (an xgrammar matcher). Once the grammar has ended
    (it accepted an EOS: only a request with ignore_eos goes on) the sample is unconstrained, as
    in vLLM. `rejected`: its last token was not one the grammar allows, which happens only where the
    request's other rules (allowed_token_ids, bad_words, min_tokens' ban of EOS) left no token of
    the mask allowed: the sample ends before that token (Scheduler.postprocess), the rest of the
    batch goes on."""

    __slots__ = ("matcher", "rejected")

    def __init__(self, matcher):
        self.matcher = matcher
        self.rejected = False

    @property
    def ended(self) -> bool:
        return self.matcher.is_terminated()


def accept_tokens(grammars: list[SampleGrammar], tokens: list[int]) -> None:
    """Advance each of `grammars` past its sample's kept token (drawn under its mask), in one call
    into xgrammar for the batch (half the time of a call per row); grammars that ended stay so. A
    token the grammar refuses (nothing of its mask was left allowed) marks the grammar `rejected`."""
    live = [(g, t) for g, t in zip(grammars, tokens) if not g.ended]
    if not live:
        return
    accepted = import_xgrammar().BatchGrammarMatcher.batch_accept_token([g.matcher for g, _ in live],
                                                                         [t for _, t in live])
    for (grammar, _), ok in zip(live, accepted):
        grammar.rejected = not ok


class MaskFill:
    """Token masks being filled on the backend's worker thread into pinned host memory (`filling`).
    `mask()` waits for them and queues their copy to the device; an error of the fill is raised
    there, in the step that uses them."""

    def __init__(self, rows: list[int], host: torch.Tensor, done: Future, device: torch.device):
        self.rows = rows
        self.host = host  # [len(rows), mask_words(V)] int32, written by the worker thread
        self.done = done
        self.device = device

    def mask(self) -> TokenMask:
        try:
            self.done.result()
        except Exception as e:
            raise RuntimeError(f"filling the token masks of {len(self.rows)} constrained rows (batch rows "
                               f"{self.rows[:8]}{'...' if len(self.rows) > 8 else ''}) failed: {e}") from e
        return upload_mask(self.rows, self.host, self.device)


def upload_mask(rows: list[int], host: torch.Tensor, device: torch.device) -> TokenMask:
    """The filled host bitmask of batch rows `rows`, copied to `device` (asynchronously from pinned memory)."""
    host_rows = torch.tensor(rows, dtype=torch.int64, pin_memory=host.is_pinned())
    return TokenMask(host_rows.to(device, non_blocking=True), host.to(device, non_blocking=True))


class GrammarBackend:
    """One engine's xgrammar state, built at its first constrained request (xgrammar imported
    then): the vocabulary as xgrammar reads it (the model's vocabulary size, the engine's EOS ids
    as the grammar's end tokens), a compiler that caches compiled grammars by their source (up to
    GRAMMAR_CACHE_BYTES), and the
    batch mask filler, and the worker thread that runs it beside the engine's (started at the first
    overlapped fill, shut down by `close`)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: frozenset[int], device: torch.device):
        self.tokenizer = tokenizer  # None: a model directory without one (no structured outputs then)
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.device = device
        self._xgr = self.compiler = self.filler = None
        self._worker: ThreadPoolExecutor | None = None

    def _start(self) -> None:
        if self.tokenizer is None:
            raise ValueError("structured outputs need the model's tokenizer, and none is loaded (the model directory "
                             "has none, or skip_tokenizer_init=True)")
        xgr = import_xgrammar()
        info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                  stop_token_ids=sorted(self.eos_token_ids))
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=True, cache_limit_bytes=GRAMMAR_CACHE_BYTES)
        self.filler = xgr.BatchGrammarMatcher(MASK_FILL_THREADS)
        self._xgr = xgr

    def compile(self, spec: StructuredOutputsParams):
        """spec's grammar, compiled (xgrammar's CompiledGrammar). Raises ImportError (how to install
        xgrammar) without it, ValueError naming a regex, schema or grammar that does not compile."""
        if self._xgr is None:
            self._start()
        c, any_whitespace = self.compiler, not spec.disable_any_whitespace
        if spec.json is not None:
            schema = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
            # checked as the JSON xgrammar compiles (a dict's tuples are its arrays, its keys strings)
            unenforced = unenforced_keyword(json.loads(schema))
            if unenforced is not None:
                raise ValueError(f"StructuredOutputsParams.json {spec.json!r:.200}: {unenforced} is not enforced by "
                                 "xgrammar (the output could break it unnoticed; vLLM's xgrammar backend refuses "
                                 "most such keywords too): drop it, or check the outputs against the schema yourself")
            name, build = "json", partial(c.compile_json_schema, schema, any_whitespace=any_whitespace)
        elif spec.json_object:
            name, build = "json_object", partial(c.compile_json_schema, JSON_OBJECT_SCHEMA, any_whitespace=any_whitespace)
        elif spec.regex is not None:
            if (escape := literal_escape(spec.regex)) is not None:
                raise ValueError(f"StructuredOutputsParams.regex {spec.regex!r:.200}: {escape} is no escape xgrammar "
                                 f"knows: it would match the letter {escape[1]!r} (vLLM's xgrammar backend serves it "
                                 "so). Anchors are not needed: the whole completion matches the regex (^ and $ are "
                                 "taken)")
            name, build = "regex", partial(c.compile_regex, spec.regex)
        elif spec.choice is not None:
            name, build = "choice", partial(c.compile_grammar, choice_grammar(spec.choice))
        elif is_lark(spec.grammar):
            name, build = "grammar", partial(c.compile_lark, spec.grammar)
        else:
            name, build = "grammar", partial(c.compile_grammar, spec.grammar)
        try:
            return build()
        except RuntimeError as e:  # xgrammar's parse and conversion errors
            # the line naming the error: a Lark error's first (its source line and caret follow), others' last
            lines = str(e).strip().splitlines() or [type(e).__name__]
            reason = next((line for line in lines if line.startswith("Lark error")), lines[-1])
            syntax = " (as Lark: no rule is written with ::=)" if name == "grammar" and is_lark(spec.grammar) else ""
            raise ValueError(f"StructuredOutputsParams.{name} {getattr(spec, name)!r:.200} cannot be compiled"
                             f"{syntax}: {reason}") from e

    def sample_grammar(self, compiled) -> SampleGrammar:
        """A fresh matcher of `compiled`, at the start of its language."""
        return SampleGrammar(self._xgr.GrammarMatcher(compiled))

    def _host_mask(self, num_rows: int) -> torch.Tensor:
        """An unfilled [num_rows, mask_words(V)] int32 bitmask in host memory (pinned on CUDA)."""
        return torch.empty((num_rows, mask_words(self.vocab_size)), dtype=torch.int32,
                           pin_memory=self.device.type == "cuda")

    def token_mask(self, rows: list[int], grammars: list[SampleGrammar]) -> TokenMask:
        """The allowed next tokens of `grammars` (none ended), for batch rows `rows`, on the device:
        filled here (xgrammar's threads) into pinned memory on CUDA, copied asynchronously."""
        host = self._host_mask(len(rows))
        self.filler.batch_fill_next_token_bitmask([g.matcher for g in grammars], host.numpy())
        return upload_mask(rows, host, self.device)

    @contextlib.contextmanager
    def filling(self, rows: list[int], grammars: list[SampleGrammar]) -> Iterator[MaskFill]:
        """`token_mask`'s fill started on the worker thread; the block does other host work (not
        touching these grammars) and takes the masks with `mask()`. Leaving the block waits for the
        fill to end, however the block ends: no fill outlives it to touch grammars that later
        calls advance, abort or free."""
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nanovllm-mask-fill")
        host = self._host_mask(len(rows))
        matchers, started = [g.matcher for g in grammars], threading.Event()

        def fill() -> None:
            started.set()
            self.filler.batch_fill_next_token_bitmask(matchers, host.numpy())

        done = self._worker.submit(fill)
        # Wait until the worker runs: from there it holds the GIL only until xgrammar's call releases
        # it. Without this, the worker would wait for the GIL as long as this thread runs Python
        # (up to sys.getswitchinterval(), 5 ms), and the fill would start after the work it should hide.
        started.wait()
        try:
            yield MaskFill(rows, host, done, self.device)
        finally:
            wait([done])

    def set_tokenizer(self, tokenizer, eos_token_ids: frozenset[int]) -> None:
        """A new vocabulary (LLM.set_tokenizer): the compiler built from the old one is dropped
        (`close`), and the next constrained request starts one from this tokenizer."""
        self.close()
        self.tokenizer, self.eos_token_ids = tokenizer, eos_token_ids

    def close(self) -> None:
        """Stop the worker thread and drop the compiler and its cache (the engine's exit: an exited
        engine the caller still holds keeps none of it); a later request would start them again."""
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
        self._xgr = self.compiler = self.filler = None
