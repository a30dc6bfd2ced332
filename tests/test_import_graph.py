"""The package's import graph: no cycle, and no arrow from a lower layer to a higher one.

Every `import` / `from ... import` of nanovllm modules counts, also those inside functions (the
lazy imports of the CUDA paths), read statically with `ast`. Layers, lowest first:

    utils, sampling_params (+ structured_outputs_params, beam_search_params), outputs, inputs -> kernels
    -> quantization -> layers -> moe, sampling -> models -> config, engine_args -> engine -> beam_search
    -> llm -> nanovllm -> ray_data

ray_data (Ray Data replicas, an optional extra) sits above the package itself, so `import nanovllm`
can never pull it (or ray) in.

Two modules sit above their package: utils/loader.py fills a built model's parameters (quantized
ones through quantization/loading.py, which splits fused MoE expert tensors as moe/layer.py does).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "nanovllm"
# A module may import only from its own layer or lower ones.
RANKS = {"utils": 0, "sampling_params": 0, "structured_outputs_params": 0, "beam_search_params": 0, "outputs": 0,
         "inputs": 0, "kernels": 1, "quantization": 1.5, "layers": 2,
         "moe": 3, "sampling": 3, "models": 4, "config": 5, "engine_args": 5,
         "engine": 6, "beam_search": 6.5, "llm": 7, "nanovllm": 8, "ray_data": 9}
# Modules ranked apart from their package (see the docstring).
MODULE_RANKS = {"nanovllm.quantization.loading": 3.5, "nanovllm.utils.loader": 3.5}


def module_names() -> dict[str, Path]:
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def import_graph() -> dict[str, set[str]]:
    """module -> the nanovllm modules it imports (a `from pkg import name` of a submodule counts
    as that submodule)."""
    modules = module_names()
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                source = ".".join(base + ([node.module] if node.module else []))
                targets.update(f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source for a in node.names)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def rank(module: str) -> float:
    return MODULE_RANKS.get(module, RANKS[layer(module)])


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_every_module_has_a_layer():
    assert {layer(m) for m in module_names()} <= set(RANKS)


def test_no_import_cycle():
    graph = import_graph()
    assert sum(map(len, graph.values())) > 100  # the scan sees the imports at all
    assert cycles(graph) == []


def test_the_cycle_check_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_arrow_points_up():
    upward = sorted((a, b) for a, targets in import_graph().items() for b in targets
                    if rank(b) > rank(a))
    assert upward == []
