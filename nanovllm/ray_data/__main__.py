"""Batch generation from the shell: JSON lines in, JSON lines out, over N engine replicas on Ray Data.

    python -m nanovllm.ray_data --model DIR --input prompts.jsonl --output out.jsonl --replicas 4 \\
        --temperature 0 --max-tokens 128

Each input line is an object with a "prompt" (text), "prompt_token_ids" or "messages" (a chat) field
and optionally a "cache_salt" (its prompt's vLLM cache_salt); its fields are copied to the output line,
which adds generated_text, generated_token_ids, finish_reason, num_input_tokens,
num_generated_tokens and generated_tokens (predictor.py). Every SamplingParams field is a flag (--max-tokens, --stop A B, --ignore-eos, ...);
--llm-kwargs takes LLM's keywords as JSON. Ray's progress is shown while it runs.

Output layout: an --output path ending in .jsonl or .json is one file, its lines in the input's
order (the driver writes the rows as they arrive, to a temporary file beside it that replaces it
once all are written: a failed run leaves an earlier file as it was; NaN and infinities as null,
as write_json writes them); any other path (a
directory, a cloud URI) gets Ray Data's write_json layout: a directory of JSON-lines files, one
per block, in no set order.
Ray: `ray.init()` joins the cluster that `ray start` made on this node (or RAY_ADDRESS names), else
starts one on this machine; replicas that its live nodes' CPUs and GPUs cannot hold are refused at once
(--gpus-per-replica 0: CPU engines), unless --wait-for-nodes says an autoscaler will add the nodes.
Run the same command on a multi-node cluster's head node,
with an --input (and a directory --output) that every node sees: Ray Data reads and writes them
from whichever node runs the task.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import types
import typing
from dataclasses import dataclass, fields

import numpy as np
import ray
import ray.data

from nanovllm.ray_data.predictor import LLMPredictor, sampling_params_of
from nanovllm.sampling_params import SamplingParams, StructuredOutputsParams, field_types

# --output suffixes that mean one JSON-lines file (anything else: Ray Data's directory of files).
SINGLE_FILE_SUFFIXES = (".jsonl", ".json")
# --output suffixes of other formats: refused (the output is JSON lines only; such a path would be a directory
# of JSON-lines files under a name that says otherwise).
OTHER_FORMAT_SUFFIXES = (".parquet", ".csv", ".tsv", ".arrow", ".feather")
# Rows per generate call of a replica: enough to fill an engine's batch (bench's default workload).
DEFAULT_BATCH_SIZE = 256
# CPUs each replica's actor holds (Ray Data's default for an actor, set explicitly: check_resources counts it).
REPLICA_CPUS = 1
# SamplingParams fields without a flag: output_kind is what llm_engine.step() streams (replicas generate).
NO_FLAG_FIELDS = frozenset({"output_kind"})


def json_object(text: str) -> dict:
    """A flag's JSON object (logit_bias, structured_outputs)."""
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, got {text!r}")
    return value


def add_sampling_flags(ap: argparse.ArgumentParser) -> None:
    """One flag per SamplingParams field (--max-tokens ...), typed by the field's annotation: bools as
    --flag / --no-flag, lists as several values, dicts (logit_bias: token ids as JSON keys) and
    structured_outputs (StructuredOutputsParams fields) as JSON objects. With no flag at all the
    replicas sample with the engine's defaults (the checkpoint's generation_config); with some, with
    SamplingParams of those fields (the rest at SamplingParams' defaults, as generate takes them)."""
    group = ap.add_argument_group("sampling (SamplingParams fields)")
    for name, hint in field_types().items():
        if name in NO_FLAG_FIELDS:
            continue
        flag = "--" + name.replace("_", "-")
        kind = hint  # X | None: X (every optional field has one other kind)
        if isinstance(hint, types.UnionType):
            kind = next(k for k in typing.get_args(hint) if k is not type(None))
        if kind is bool:
            group.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None)
        elif typing.get_origin(kind) is list:
            group.add_argument(flag, dest=name, type=typing.get_args(kind)[0], nargs="+", default=None)
        elif typing.get_origin(kind) is dict or kind is StructuredOutputsParams:
            group.add_argument(flag, dest=name, type=json_object, default=None, metavar="JSON")
        else:  # int or float
            group.add_argument(flag, dest=name, type=kind, default=None)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m nanovllm.ray_data", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="checkpoint directory (the same path on every node)")
    ap.add_argument("--input", required=True, help="JSON-lines file (or directory, or URI) that read_json takes")
    ap.add_argument("--output", required=True, help="out.jsonl: one file in input order; else a directory")
    ap.add_argument("--replicas", type=int, default=1, help="engine replicas (Ray actors)")
    ap.add_argument("--gpus-per-replica", type=float, default=1,
                    help="GPUs of each replica (tensor-parallel over them when > 1); 0: CPU engines")
    ap.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE, help="rows per generate call")
    ap.add_argument("--wait-for-nodes", action="store_true",
                    help="an autoscaling cluster: let the replicas wait for nodes its live ones cannot hold")
    ap.add_argument("--llm-kwargs", default="{}", metavar="JSON", help='LLM keywords, e.g. \'{"max_model_len": 2048}\'')
    add_sampling_flags(ap)
    return ap


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Flags checked here, before Ray starts: bad sampling values, counts and JSON exit with usage."""
    ap = build_parser()
    args = ap.parse_args(argv)
    chosen = {f.name: getattr(args, f.name) for f in fields(SamplingParams)
              if f.name not in NO_FLAG_FIELDS and getattr(args, f.name) is not None}
    try:  # sampling_params_of takes logit_bias' JSON keys ("42") as token ids
        args.sampling_params = sampling_params_of(chosen) if chosen else None
        args.llm_kwargs = json.loads(args.llm_kwargs)
    except (TypeError, ValueError) as exc:
        ap.error(str(exc))
    if not isinstance(args.llm_kwargs, dict):
        ap.error(f"--llm-kwargs must be a JSON object, got {args.llm_kwargs!r}")
    if args.output.lower().endswith(OTHER_FORMAT_SUFFIXES):
        ap.error(f"--output {args.output!r}: the output is JSON lines (a path ending in .jsonl / .json for one file, "
                 f"else a directory of JSON-lines files), not {os.path.splitext(args.output)[1]!r}")
    folder = os.path.dirname(os.path.abspath(args.output))
    if args.output.endswith(SINGLE_FILE_SUFFIXES) and not os.path.isdir(folder):
        ap.error(f"--output {args.output!r}: its folder {folder!r} does not exist")
    if args.replicas < 1 or args.batch_size < 1 or args.gpus_per_replica < 0:
        ap.error(f"--replicas and --batch-size must be >= 1 and --gpus-per-replica >= 0, got "
                 f"{args.replicas}, {args.batch_size}, {args.gpus_per_replica}")
    return args


def json_value(value):
    """json.dumps' fallback for what Ray rows hold: numpy arrays and scalars."""
    if isinstance(value, (np.ndarray, np.generic)):
        return value.tolist()
    raise TypeError(f"cannot write {type(value).__name__} as JSON")


def finite_or_null(value):
    """`value` (a row's plain Python or numpy values) with every NaN and infinity, at any depth, as
    None: JSON has no such numbers, and a number column that some input lines lack comes out of
    map_batches' numpy batches as NaN. Ray Data's write_json (pandas') writes them as null too."""
    if isinstance(value, (np.ndarray, np.generic)):
        value = value.tolist()
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(v) for v in value]
    return value


def json_line(row: dict) -> str:
    """One row as a line of strict JSON (non-finite numbers as null: finite_or_null)."""
    try:  # the common row has no NaN: written without walking it
        return json.dumps(row, ensure_ascii=False, allow_nan=False, default=json_value)
    except ValueError:
        return json.dumps(finite_or_null(row), ensure_ascii=False, allow_nan=False, default=json_value)


def write_jsonl(ds: ray.data.Dataset, path: str) -> int:
    """Every row of `ds` as one JSON line of `path`, in the dataset's order; returns the row count.
    The lines go to a new temporary file beside `path`, which replaces it once the last row is
    written: a run that fails (a bad row, Ctrl-C) leaves an existing `path` as it was and no partial file."""
    fd, partial = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=os.path.basename(path) + ".",
                                   suffix=".partial")
    rows = 0
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for row in ds.iter_rows():
                f.write(json_line(dict(row)) + "\n")
                rows += 1
        os.chmod(partial, 0o666 & ~current_umask())  # mkstemp's file is private: the output is as open() makes it
        os.replace(partial, path)
    except BaseException:
        os.remove(partial)
        raise
    return rows


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@dataclass(frozen=True)
class NodeResources:
    cpus: float
    gpus: float


def check_resources(replicas: int, gpus_per_replica: float, nodes: list[NodeResources]) -> None:
    """ValueError, naming the flags and the cluster's CPUs and GPUs, when `replicas` actors of
    REPLICA_CPUS CPU and `gpus_per_replica` GPUs each (all on one node), and one CPU more for Ray
    Data's read and write tasks, do not fit the live nodes: Ray would wait for them forever."""
    def room(node: NodeResources) -> int:
        by_cpus = math.floor(node.cpus / REPLICA_CPUS + 1e-9)
        return by_cpus if gpus_per_replica == 0 else min(by_cpus, math.floor(node.gpus / gpus_per_replica + 1e-9))

    fit = sum(map(room, nodes))
    cpus, gpus = sum(n.cpus for n in nodes), sum(n.gpus for n in nodes)
    if fit < replicas or cpus < replicas * REPLICA_CPUS + 1:
        cpu_hint = "" if gpus_per_replica else f" ({REPLICA_CPUS} CPU each, one more for reading and writing)"
        # CPU engines (--gpus-per-replica 0): only fewer replicas fit
        lower = "--replicas or --gpus-per-replica, or pass --gpus-per-replica 0 to run the engines on CPUs" \
            if gpus_per_replica else "--replicas"
        raise ValueError(
            f"--replicas {replicas} --gpus-per-replica {gpus_per_replica:g} needs {replicas} replica(s) of "
            f"{REPLICA_CPUS} CPU and {gpus_per_replica:g} GPU(s) on one node each{cpu_hint}, but the Ray cluster's "
            f"{len(nodes)} live node(s) have {cpus:g} CPU(s) and {gpus:g} GPU(s): room for {min(fit, int(cpus) - 1)} "
            f"replica(s). Lower {lower} (on an autoscaling cluster that adds the "
            f"nodes on demand: --wait-for-nodes)")


def cluster_nodes() -> list[NodeResources]:
    """The CPUs and GPUs of each live node of the Ray cluster this process joined."""
    return [NodeResources(node["Resources"].get("CPU", 0.0), node["Resources"].get("GPU", 0.0))
            for node in ray.nodes() if node["Alive"]]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    ray.init()
    if not args.wait_for_nodes:
        check_resources(args.replicas, args.gpus_per_replica, cluster_nodes())
    single_file = args.output.endswith(SINGLE_FILE_SUFFIXES)
    if single_file:
        ray.data.DataContext.get_current().execution_options.preserve_order = True
    ds = ray.data.read_json(args.input).map_batches(
        LLMPredictor,
        fn_constructor_kwargs=dict(model=args.model, sampling_params=args.sampling_params, llm_kwargs=args.llm_kwargs),
        compute=ray.data.ActorPoolStrategy(size=args.replicas),
        batch_size=args.batch_size,
        num_cpus=REPLICA_CPUS,
        num_gpus=args.gpus_per_replica,
    )
    if single_file:
        rows = write_jsonl(ds, args.output)
        print(f"wrote {rows} rows to {args.output}")
    else:
        ds.write_json(args.output)
        print(f"wrote JSON-lines files under {args.output}")


if __name__ == "__main__":
    main()
