"""xgrammar against llguidance on the CPU, the measurement behind nanovllm's choice of xgrammar
(docs/structured_outputs.md): tokenizer set-up, JSON-schema compile, and token-mask fill, one row
at a time and a decode batch's worth at once, every fill on a fresh grammar state (each matcher
takes its next token between fills: a library that caches a state's mask gains nothing here).

Needs both libraries (`pip install xgrammar llguidance`; nanovllm itself needs xgrammar only).
A Qwen-sized vocabulary without downloading one: `--build-tokenizer DIR` trains a byte-level BPE
of 151,643 tokens (plus specials) on this Python's standard library and site-packages sources.

    python scripts/grammar_libraries.py --build-tokenizer /tmp/tok151k
    python scripts/grammar_libraries.py nanovllm/default_model:8192 /tmp/tok151k:151936 --rows 64,256
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sysconfig
import time

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9]+\\.[a-z]{2,4}$"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["street", "city", "zip"],
                    "additionalProperties": False},
        "role": {"enum": ["admin", "user", "guest"]},
        "scores": {"type": "array", "items": {"type": "number"}},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "tags", "address", "role", "scores", "active"],
    "additionalProperties": False,
}
INSTANCE = {"name": "Ada Lovelace of the house of def import", "age": 36, "email": "ada.lovelace@example.org",
            "tags": ["math", "engines", "poetry", "for x in range"],
            "address": {"street": "12 St James's Square", "city": "London", "zip": "12345"},
            "role": "admin", "scores": [1.5, -2.25, 3e10, 42], "active": True}
# Training text of --build-tokenizer, and the BPE's size without its special tokens (Qwen2/3's).
TRAIN_BYTES = 120_000_000
QWEN_BPE_TOKENS = 151_643
STEPS = 8  # batch fills timed, each on fresh states


def build_tokenizer(path: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    roots = sorted({sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"]})
    files, seen, budget = [], set(), TRAIN_BYTES
    for root in roots:
        for pattern in ("**/*.py", "**/*.md", "**/*.txt"):
            for f in sorted(glob.glob(os.path.join(root, pattern), recursive=True)):
                if budget > 0 and f not in seen and os.path.isfile(f) and os.path.getsize(f) < 2_000_000:
                    files.append(f)
                    seen.add(f)
                    budget -= os.path.getsize(f)

    def texts():
        for f in files:
            try:
                with open(f, encoding="utf-8") as fh:
                    yield fh.read()
            except (UnicodeDecodeError, OSError):
                continue

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [f"<|special_{i}|>" for i in range(19)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts(), trainers.BpeTrainer(
        vocab_size=QWEN_BPE_TOKENS, special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(path)
    print(f"{path}: {tok.get_vocab_size()} tokens from {len(files)} files")


def summary(seconds: list[float]) -> str:
    ms = sorted(1e3 * s for s in seconds)
    return (f"mean {statistics.mean(ms):.3f} ms, p50 {ms[len(ms) // 2]:.3f}, p90 {ms[int(len(ms) * 0.9)]:.3f}, "
            f"max {ms[-1]:.3f}")


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def measure(path: str, vocab: int, batch_rows: list[int], threads: int) -> None:
    import llguidance
    import llguidance.hf
    import llguidance.numpy as lln
    import xgrammar as xgr
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    eos = tok.eos_token_id
    ids = tok.encode(json.dumps(INSTANCE), add_special_tokens=False) + [eos]
    schema = json.dumps(SCHEMA)
    print(f"== {path}: vocabulary {vocab}, the instance is {len(ids)} tokens")

    info, info_s = timed(lambda: xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=[eos]))
    compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
    compiles = [timed(lambda: compiler.compile_json_schema(schema, any_whitespace=False)) for _ in range(3)]
    grammar = compiles[0][0]
    lt, lt_s = timed(lambda: llguidance.hf.from_tokenizer(tok, n_vocab=vocab, eos_token=eos))
    # the separators of json.dumps (and of xgrammar without any_whitespace)
    options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    ll_grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults=options)
    ll_builds = [timed(lambda: llguidance.LLMatcher(lt, ll_grammar, log_level=1)) for _ in range(3)]
    print(f"xgrammar:   tokenizer info {info_s:.3f} s; compile {1e3 * min(s for _, s in compiles):.1f} ms "
          f"(first {1e3 * compiles[0][1]:.1f})")
    print(f"llguidance: tokenizer {lt_s:.3f} s; grammar + matcher {1e3 * min(s for _, s in ll_builds):.1f} ms "
          f"(first {1e3 * ll_builds[0][1]:.1f}); its masks are computed lazily, at each fill")

    # one row: fill, check the instance's next token is allowed, take it
    xm, lm = xgr.GrammarMatcher(grammar), llguidance.LLMatcher(lt, ll_grammar, log_level=1)
    xbits, lbits = xgr.allocate_token_bitmask(1, vocab), lln.allocate_token_bitmask(1, vocab)
    xfill, lfill = [], []
    for t in ids:
        xfill.append(timed(lambda: xm.fill_next_token_bitmask(xbits, 0))[1])
        lfill.append(timed(lambda: lln.fill_next_token_bitmask(lm, lbits, 0))[1])
        if not ((xbits[0, t // 32] >> (t % 32)) & 1 and (lbits[0, t // 32] >> (t % 32)) & 1):
            raise SystemExit(f"token {t} of the instance is not allowed by a library's mask")
        if not (xm.accept_token(t) and lm.consume_token(t)):
            raise SystemExit(f"token {t} of the instance refused")
    print(f"one row, fill per token: xgrammar {summary(xfill)}; llguidance {summary(lfill)}")

    # a decode batch: `rows` matchers spread over the instance, STEPS fills on fresh states
    for rows in batch_rows:
        starts = [i * (len(ids) - 1 - STEPS) // max(rows - 1, 1) for i in range(rows)]
        xs = [xgr.GrammarMatcher(grammar) for _ in starts]
        ls = [llguidance.LLMatcher(lt, ll_grammar, log_level=1) for _ in starts]
        for x, m, start in zip(xs, ls, starts):
            for t in ids[:start]:
                x.accept_token(t)
                m.consume_token(t)
        xbatch, executor = xgr.BatchGrammarMatcher(max_threads=threads), llguidance.LLExecutor(threads)
        xb, lb = xgr.allocate_token_bitmask(rows, vocab), lln.allocate_token_bitmask(rows, vocab)
        xt, lt_ = [], []
        for k in range(STEPS):
            xt.append(timed(lambda: xbatch.batch_fill_next_token_bitmask(xs, xb))[1])
            lt_.append(timed(lambda: lln.fill_next_token_bitmask_par(executor, list(zip(ls, range(rows))), lb))[1])
            for x, m, start in zip(xs, ls, starts):
                x.accept_token(ids[start + k])
                m.consume_token(ids[start + k])
        print(f"{rows} rows, {threads} thread(s), fill per step: xgrammar {1e3 * statistics.mean(xt):.2f} ms, "
              f"llguidance {1e3 * statistics.mean(lt_):.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tokenizers", nargs="*", metavar="DIR:VOCAB", help="tokenizer directory and model vocabulary size")
    parser.add_argument("--build-tokenizer", metavar="DIR", help="train the Qwen-sized BPE into DIR, then stop")
    parser.add_argument("--rows", default="64,256", help="batch sizes of the batched fill")
    parser.add_argument("--threads", type=int, default=1, help="threads of the compile and the batched fill")
    args = parser.parse_args()
    if args.build_tokenizer:
        build_tokenizer(args.build_tokenizer)
        return
    for spec in args.tokenizers:
        path, vocab = spec.rsplit(":", 1)
        measure(path, int(vocab), [int(r) for r in args.rows.split(",")], args.threads)


if __name__ == "__main__":
    main()
