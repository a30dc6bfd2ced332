#!/usr/bin/env python
"""Train nanovllm's embedded default model: a tiny Qwen3 that completes Python code.

The corpus is the Python standard library's own source (``*.py`` under
``sysconfig.get_paths()["stdlib"]``, PSF license), so every machine already has it
and the result can be redistributed. The script:

1. collects the corpus in sorted path order (tests, GUI code, generated tables skipped),
   holding out every 50th file;
2. trains a byte-level BPE tokenizer with ``tokenizers`` and wraps it as a
   ``PreTrainedTokenizerFast`` (EOS token, chat template);
3. trains a ``Qwen3ForCausalLM`` with AdamW + warmup/cosine on random windows of the
   training tokens (CPU, single thread by default);
4. evaluates held-out cross-entropy of the model and of unigram / add-k bigram
   baselines on the same held-out targets;
5. saves everything (bfloat16 safetensors, tokenizer, generation config, model card)
   into ``nanovllm/default_model/`` (or ``--out``).

Everything is seeded; with the same Python stdlib and library versions it reproduces
the same checkpoint.

    python scripts/train_default_model.py                # full run (~30 min, 1 thread)
    python scripts/train_default_model.py --steps 5 --out /tmp/smoke   # smoke test
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import sysconfig
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAYON_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "nanovllm" / "default_model"

EOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [EOS, IM_START, IM_END]

# ChatML-style template; the model never saw chat data, so this exists for API
# completeness (engines and tests can render prompts), not for chat quality.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Directory names skipped anywhere in a path: test suites, GUI / demo code, vendored
# wheels, build config, caches.
SKIP_DIRS = {
    "test", "tests", "idlelib", "lib2to3", "tkinter", "turtledemo", "ensurepip",
    "site-packages", "dist-packages", "__pycache__", "pydoc_data", "lib-dynload",
}
HELD_OUT_EVERY = 25


def log(msg: str) -> None:
    print(msg, flush=True)


# --------------------------------------------------------------------------- corpus


def collect_corpus(max_bytes: int):
    """Return (train_texts, heldout_texts, stats) from the stdlib, deterministic order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(p for p in root.rglob("*.py") if p.is_file())
    kept = []
    skipped = 0
    total = 0
    for p in paths:
        rel = p.relative_to(root)
        if any(part in SKIP_DIRS or part.startswith("config-") for part in rel.parts[:-1]):
            skipped += 1
            continue
        if rel.name.startswith("_sysconfigdata"):  # machine-specific build variables
            skipped += 1
            continue
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            skipped += 1
            continue
        # Generated codec tables (encodings/cp*.py etc.) are mostly hex literals.
        if rel.parts[0] == "encodings" and ("decoding_table" in text or "decoding_map" in text):
            skipped += 1
            continue
        if not text.strip():
            skipped += 1
            continue
        if total + len(text.encode("utf-8")) > max_bytes:
            break
        total += len(text.encode("utf-8"))
        kept.append((str(rel), text))
    train = [t for i, (_, t) in enumerate(kept) if i % HELD_OUT_EVERY != HELD_OUT_EVERY - 1]
    held = [(r, t) for i, (r, t) in enumerate(kept) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1]
    stats = {
        "stdlib_root": str(root),
        "python_version": platform.python_version(),
        "files_kept": len(kept),
        "files_skipped": skipped,
        "files_train": len(train),
        "files_heldout": len(held),
        "heldout_files": [r for r, _ in held],
        "bytes_train": sum(len(t.encode("utf-8")) for t in train),
        "bytes_heldout": sum(len(t.encode("utf-8")) for _, t in held),
    }
    return train, [t for _, t in held], stats


# ------------------------------------------------------------------------ tokenizer


def train_tokenizer(texts, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=EOS,
        additional_special_tokens=[IM_START, IM_END],
        clean_up_tokenization_spaces=False,
        model_max_length=2048,
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


def encode_docs(tok, texts) -> np.ndarray:
    """Concatenate documents, each followed by EOS."""
    eos = tok.eos_token_id
    ids = []
    for enc in tok.backend_tokenizer.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos)
    return np.asarray(ids, dtype=np.int64)


def portable_tokenizer_config(out: Path) -> None:
    """Make tokenizer_config.json loadable by older transformers (4.x) as well.

    transformers 5 writes ``tokenizer_class: TokenizersBackend`` and keeps the chat
    template only in ``chat_template.jinja``; 4.x knows neither, so name the class
    ``PreTrainedTokenizerFast`` (an alias in 5.x) and inline the template too.
    """
    path = out / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["chat_template"] = CHAT_TEMPLATE
    path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


# -------------------------------------------------------------------------- model


def build_model(vocab_size: int, args, eos_id: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )
    return Qwen3ForCausalLM(cfg)


def lr_at(step: int, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * progress))


@torch.no_grad()
def model_heldout_ce(model, ids: np.ndarray, seq_len: int, batch: int = 16):
    """Mean CE (nats/token) over non-overlapping windows; returns (ce, n_targets).

    Targets are ids[w*seq_len + 1 : (w+1)*seq_len] for every full window w, i.e. each
    window's first token is context only. ``heldout_targets`` returns the same pairs.
    """
    model.eval()
    n_win = len(ids) // seq_len
    x = torch.from_numpy(ids[: n_win * seq_len].reshape(n_win, seq_len))
    total, count = 0.0, 0
    for i in range(0, n_win, batch):
        xb = x[i : i + batch]
        logits = model(input_ids=xb).logits.float()
        lp = torch.log_softmax(logits[:, :-1], dim=-1)
        nll = -lp.gather(-1, xb[:, 1:, None]).squeeze(-1)
        total += nll.sum().item()
        count += nll.numel()
    return total / count, count


def heldout_pairs(ids: np.ndarray, seq_len: int):
    """(prev, target) token pairs matching ``model_heldout_ce``'s targets."""
    n_win = len(ids) // seq_len
    w = ids[: n_win * seq_len].reshape(n_win, seq_len)
    return w[:, :-1].reshape(-1), w[:, 1:].reshape(-1)


def unigram_ce(train_ids: np.ndarray, targets: np.ndarray, vocab: int) -> float:
    counts = np.bincount(train_ids, minlength=vocab).astype(np.float64) + 1.0  # add-1
    logp = np.log(counts / counts.sum())
    return float(-logp[targets].mean())


def bigram_ce(train_ids: np.ndarray, prev: np.ndarray, targets: np.ndarray, vocab: int, k: float) -> float:
    pair = train_ids[:-1] * vocab + train_ids[1:]
    uniq, cnt = np.unique(pair, return_counts=True)
    ctx = np.bincount(train_ids[:-1], minlength=vocab).astype(np.float64)
    q = prev * vocab + targets
    pos = np.searchsorted(uniq, q)
    pos = np.minimum(pos, len(uniq) - 1)
    c = np.where(uniq[pos] == q, cnt[pos], 0).astype(np.float64)
    p = (c + k) / (ctx[prev] + k * vocab)
    return float(-np.log(p).mean())


# ---------------------------------------------------------------------------- main


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-bytes", type=int, default=12_000_000)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=700)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr", type=float, default=1e-4)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--log-every", type=int, default=25)
    return ap.parse_args()


def main():
    args = parse_args()
    t_start = time.time()
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)

    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    # 1. corpus
    train_texts, held_texts, cstats = collect_corpus(args.max_bytes)
    log(f"corpus: python {cstats['python_version']} stdlib at {cstats['stdlib_root']}: "
        f"{cstats['files_kept']} files kept ({cstats['files_skipped']} skipped), "
        f"train {cstats['files_train']} files / {cstats['bytes_train']:,} bytes, "
        f"held-out {cstats['files_heldout']} files / {cstats['bytes_heldout']:,} bytes")

    # 2. tokenizer
    t0 = time.time()
    tok = train_tokenizer(train_texts, args.vocab)
    vocab = len(tok)
    train_ids = encode_docs(tok, train_texts)
    held_ids = encode_docs(tok, held_texts)
    log(f"tokenizer: vocab {vocab}, eos {tok.eos_token!r}={tok.eos_token_id}, trained in {time.time() - t0:.1f}s; "
        f"train {len(train_ids):,} tokens ({cstats['bytes_train'] / len(train_ids):.2f} bytes/token), "
        f"held-out {len(held_ids):,} tokens")
    sample = held_texts[0][:2000]
    assert tok.decode(tok.encode(sample, add_special_tokens=False)) == sample, "tokenizer must round-trip"

    # 3. model + training
    model = build_model(vocab, args, tok.eos_token_id)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params:,} params ({n_params - model.model.embed_tokens.weight.numel():,} non-embedding)")
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
    )
    gen = torch.Generator().manual_seed(args.seed)
    data = torch.from_numpy(train_ids)
    T = args.seq_len
    offsets = torch.arange(T + 1)
    model.train()
    t_train = time.time()
    ema = None
    for step in range(args.steps):
        lr = lr_at(step, args)
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, len(data) - T - 1, (args.batch,), generator=gen)
        win = data[starts[:, None] + offsets]
        x, y = win[:, :-1], win[:, 1:]
        logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab).float(), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if step % args.log_every == 0 or step == args.steps - 1:
            el = time.time() - t_train
            tps = (step + 1) * args.batch * T / max(el, 1e-9)
            log(f"step {step:5d}/{args.steps} loss {loss.item():.4f} (ema {ema:.4f}) lr {lr:.2e} "
                f"gnorm {gnorm:.2f} | {el:7.1f}s {tps:6.0f} tok/s")
    train_time = time.time() - t_train
    log(f"training done: {args.steps} steps in {train_time:.1f}s "
        f"({args.steps * args.batch * T:,} tokens seen, {args.steps * args.batch * T / len(train_ids):.2f} epochs)")

    # 4. save (bfloat16 weights) and reload from disk for evaluation
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    for f in out.iterdir():
        if f.is_file():
            f.unlink()
    model.eval()
    model.to(torch.bfloat16)
    model.generation_config = GenerationConfig(
        bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id
    )
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    portable_tokenizer_config(out)
    for f in out.iterdir():
        f.chmod(0o644)
    del model

    shipped = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    tok2 = AutoTokenizer.from_pretrained(out)
    assert tok2.decode(tok2.encode(sample, add_special_tokens=False)) == sample

    # 5. evaluation on the same held-out targets
    model_ce, n_targets = model_heldout_ce(shipped, held_ids, T)
    prev, tgt = heldout_pairs(held_ids, T)
    uni = unigram_ce(train_ids, tgt, vocab)
    bigrams = {k: bigram_ce(train_ids, prev, tgt, vocab, k) for k in (1.0, 0.1, 0.01, 0.001)}
    best_k = min(bigrams, key=bigrams.get)
    log(f"held-out CE over {n_targets:,} targets (nats/token): model {model_ce:.4f} | "
        f"unigram(add-1) {uni:.4f} | bigram add-k " + ", ".join(f"k={k}: {v:.4f}" for k, v in bigrams.items()))
    bytes_per_tok = cstats["bytes_heldout"] / len(held_ids)
    log(f"model bits/byte on held-out: {model_ce / math.log(2) / bytes_per_tok:.3f}")

    samples = {}
    for prompt in ["def ", "import ", "class ", "    def __init__(self"]:
        enc = tok2(prompt, return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            o = shipped.generate(**enc, max_new_tokens=64, do_sample=False, pad_token_id=tok2.eos_token_id)
        samples[prompt] = tok2.decode(o[0], skip_special_tokens=False)
        log(f"--- greedy sample for {prompt!r}:\n{samples[prompt]}\n---")

    dir_bytes = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    total_time = time.time() - t_start
    results = {
        "corpus": {k: v for k, v in cstats.items() if k != "heldout_files"},
        "heldout_files": cstats["heldout_files"],
        "tokens_train": int(len(train_ids)),
        "tokens_heldout": int(len(held_ids)),
        "heldout_targets": int(n_targets),
        "vocab_size": vocab,
        "params": n_params,
        "train_seconds": round(train_time, 1),
        "total_seconds": round(total_time, 1),
        "heldout_ce_model": round(model_ce, 4),
        "heldout_ce_unigram_add1": round(uni, 4),
        "heldout_ce_bigram": {str(k): round(v, 4) for k, v in bigrams.items()},
        "bigram_best_k": best_k,
        "hyperparameters": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "out"},
        "versions": {
            "torch": torch.__version__, "transformers": transformers.__version__,
            "tokenizers": __import__("tokenizers").__version__, "python": platform.python_version(),
        },
    }
    write_model_card(out, results, samples)
    dir_bytes = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    log(f"wrote {out} ({dir_bytes:,} bytes): {', '.join(sorted(f.name for f in out.iterdir()))}")
    log("RESULTS " + json.dumps({k: v for k, v in results.items() if k != "heldout_files"}))
    log(f"total wall time {time.time() - t_start:.1f}s")


def write_model_card(out: Path, r: dict, samples: dict) -> None:
    hp = r["hyperparameters"]
    c = r["corpus"]
    weight_bytes = (out / "model.safetensors").stat().st_size
    bigram_rows = "\n".join(
        f"| bigram, add-k smoothing, k={k} | {v:.4f} |" for k, v in r["heldout_ce_bigram"].items()
    )
    sample_txt = "\n\n".join(f"Prompt `{p!r}`:\n\n```python\n{s}\n```" for p, s in samples.items())
    card = f"""# nanovllm default model (tiny Qwen3 for Python code)

A very small causal language model with the **Qwen3 architecture** (`Qwen3ForCausalLM`),
trained from scratch by `scripts/train_default_model.py` on the Python standard library's
source code. It ships inside the package so that nanovllm's examples and tests run
offline with nothing downloaded. It completes Python code in a loose, stdlib-flavoured
way; it is a test/demo fixture, not a useful assistant (it has never seen chat data).

## Data

- Source: `*.py` files under `sysconfig.get_paths()["stdlib"]` of CPython {c['python_version']}
  (the files every Python install has), read in sorted path order.
- Skipped: any path under a directory named {", ".join(f"`{d}`" for d in sorted(SKIP_DIRS))} or `config-*`;
  `_sysconfigdata*`; generated codec tables in `encodings/` (files defining `decoding_table`/`decoding_map`);
  files that are empty or not UTF-8. Size cap {hp['max_bytes']:,} bytes (not reached).
- {c['files_kept']} files kept ({c['files_skipped']} skipped). Every {HELD_OUT_EVERY}th kept file is held out.
- Train: {c['files_train']} files, {c['bytes_train']:,} bytes, {r['tokens_train']:,} tokens.
- Held-out: {c['files_heldout']} files, {c['bytes_heldout']:,} bytes, {r['tokens_heldout']:,} tokens
  ({r['heldout_targets']:,} scored targets). Files: {", ".join(f"`{f}`" for f in r['heldout_files'])}.
- Each file is followed by the EOS token `{EOS}`.

## Tokenizer

Byte-level BPE (`tokenizers`; GPT-2 style byte-level pre-tokenizer and decoder, so any
text round-trips exactly), vocabulary {r['vocab_size']} including the special tokens
`{EOS}` (EOS and pad, id 0), `{IM_START}`, `{IM_END}`. A ChatML-style `chat_template` is included.

## Model

- `Qwen3ForCausalLM`: hidden {hp['hidden']}, {hp['layers']} layers, {hp['heads']} query heads / {hp['kv_heads']} KV heads,
  head_dim {hp['head_dim']}, intermediate {hp['intermediate']}, vocab {r['vocab_size']}, tied input/output embeddings,
  max_position_embeddings 2048, default RoPE theta, RMSNorm incl. Qwen3's q/k norms.
- {r['params']:,} parameters; weights stored in bfloat16 (`model.safetensors`, {weight_bytes:,} bytes).

## Training

- Seed {hp['seed']}; {hp['threads']} CPU thread(s); {hp['steps']} steps of {hp['batch']} random windows x {hp['seq_len']} tokens
  ({hp['steps'] * hp['batch'] * hp['seq_len']:,} tokens seen, {hp['steps'] * hp['batch'] * hp['seq_len'] / r['tokens_train']:.2f} epochs).
- AdamW (betas 0.9/0.95, weight decay {hp['weight_decay']} on matrices), peak LR {hp['lr']}, {hp['warmup']} warmup steps,
  cosine decay to {hp['min_lr']}, grad-norm clip 1.0, float32 training.
- Training time {r['train_seconds']:.0f} s ({r['total_seconds']:.0f} s for the whole script including tokenizer and eval).
- Versions: {", ".join(f"{k} {v}" for k, v in r['versions'].items())}.

## Evaluation

Held-out cross-entropy in nats/token, all on the same held-out targets (non-overlapping
{hp['seq_len']}-token windows; the model is evaluated from the saved bfloat16 checkpoint).
Baselines are fit on the training tokens.

| model | held-out CE (nats/token) |
|---|---|
| **this model** | **{r['heldout_ce_model']:.4f}** |
| unigram, add-1 smoothing | {r['heldout_ce_unigram_add1']:.4f} |
{bigram_rows}

## Greedy samples (transformers `generate`, `do_sample=False`, 64 new tokens)

{sample_txt}

## License

- Weights and tokenizer: ours, released under the project's MIT license.
- Training data: the CPython standard library source, (c) Python Software Foundation,
  under the PSF License Agreement (see `LICENSE.txt` in the Python installation). No
  data is redistributed here beyond what the model may have memorised.
"""
    (out / "README.md").write_text(card)


if __name__ == "__main__":
    main()
