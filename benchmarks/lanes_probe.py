"""Does a decode step gain from running its batch as two lanes on two CUDA streams?

A batched decode step of a small model alternates memory-bound attention (all SMs, near copy
bandwidth) with latency-bound projections and norms (few SMs, a few us each). Split the batch
in two halves on two streams and one half's attention can run beside the other half's
projections. This times one layer stack's forward (no LM head, no sampling) under a CUDA graph,
whole batch vs two lanes, over the engine's real KV cache with random block tables.

    PYTHONPATH=. python3 benchmarks/lanes_probe.py --model benchmarks/configs/qwen3-0.6b
"""

from __future__ import annotations

import argparse

import torch

from graph_timing import graph_us
from nanovllm import LLM
from nanovllm.utils.context import AttentionMetadata, attention_context


def make_batch(batch: int, lo: int, hi: int, num_blocks: int, block: int, width: int, vocab: int,
               gen: torch.Generator):
    lens = torch.randint(lo, hi + 1, (batch,), generator=gen).sort(descending=True).values
    table = torch.zeros((batch, width), dtype=torch.int32)
    ids = torch.randperm(num_blocks, generator=gen)
    at = 0
    for i, n in enumerate(lens.tolist()):
        need = -(-n // block)
        table[i, :need] = ids[at: at + need]
        at += need
    tokens = torch.randint(0, vocab, (batch,), generator=gen)
    return lens, table, tokens


def lane_fn(model, rows_sets, lens, table, tokens, out, streams):
    """fn() running the rows of each set in rows_sets on its own stream (streams None: all on the
    current stream, in turn)."""
    dev = out.device
    parts = []
    for rows in rows_sets:
        idx = torch.tensor(rows, dtype=torch.long)
        meta = AttentionMetadata(is_prefill=False, slot_mapping=torch.full((len(rows),), -1, dtype=torch.int64, device=dev),
                                 context_lens=lens[idx].to(torch.int32).to(dev), block_tables=table[idx].to(dev))
        parts.append((idx.to(dev), meta, tokens[idx].to(dev), (lens[idx] - 1).to(dev)))

    def fn():
        cur = torch.cuda.current_stream()
        if streams is None:  # every part on the current stream, one after the other
            for idx, meta, ids, pos in parts:
                with attention_context(meta):
                    out[idx] = model(ids, pos)
            return
        for s in streams:
            s.wait_stream(cur)
        for s, (idx, meta, ids, pos) in zip(streams, parts):
            with torch.cuda.stream(s), attention_context(meta):
                out[idx] = model(ids, pos)
        for s in streams:
            cur.wait_stream(s)
    return fn


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="benchmarks/configs/qwen3-0.6b")
    ap.add_argument("--batches", default="64,128,192,256,384")
    ap.add_argument("--lens", default="100-1100,256-2048")
    args = ap.parse_args()
    llm = LLM(args.model, load_format="dummy", enforce_eager=True, max_model_len=4096, max_num_seqs=512)
    runner = llm.model_runner
    model, cfg = runner.model, llm.config.model_config
    gen = torch.Generator().manual_seed(0)
    streams_eq = [torch.cuda.Stream(), torch.cuda.Stream()]
    streams_pri = [torch.cuda.Stream(priority=-1), torch.cuda.Stream()]
    print(f"{args.model}: {cfg.num_hidden_layers} layers; us per forward (graph replay)", flush=True)
    with torch.inference_mode():
        for span in args.lens.split(","):
            lo, hi = map(int, span.split("-"))
            for b in map(int, args.batches.split(",")):
                lens, table, tokens = make_batch(b, lo, hi, runner.num_blocks, runner.block_size,
                                                 llm.config.max_blocks_per_seq, cfg.vocab_size, gen)
                out = torch.zeros((b, cfg.hidden_size), dtype=runner.dtype, device=runner.device)
                h = b // 2
                halves = [list(range(h)), list(range(h, b))]
                snake = [[i for i in range(b) if i % 4 in (0, 3)], [i for i in range(b) if i % 4 in (1, 2)]]
                one = graph_us(lane_fn(model, [list(range(b))], lens, table, tokens, out, None))
                res = {"one": one}
                for name, sets, streams in (("halves", halves, streams_eq), ("snake", snake, streams_eq),
                                            ("snake-pri", snake, streams_pri)):
                    res[name] = graph_us(lane_fn(model, sets, lens, table, tokens, out, streams))
                seq = graph_us(lane_fn(model, snake, lens, table, tokens, out, None))
                kv = 2 * cfg.num_hidden_layers * int(lens.sum()) * cfg.num_key_value_heads * cfg.head_dim * 2
                print(f"ctx {lo}-{hi} batch {b:4d} (KV {kv / 1e9:.2f} GB): one {one:8.1f}  "
                      + "  ".join(f"{k} {v:8.1f} ({v / one:.3f})" for k, v in res.items() if k != "one")
                      + f"  snake-sequential {seq:8.1f}", flush=True)
    llm.exit()


if __name__ == "__main__":
    main()
