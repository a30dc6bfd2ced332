"""Every module-level name a Triton kernel reads or calls is one compiled Triton accepts.

The interpreter (TRITON_INTERPRET=1, CI's only Triton) runs kernels as Python: it reads any global
and calls any function. The compiler refuses a plain int/float/bool/str global ("Cannot access
global variable ... from within @jit'ed function") and cannot compile a call to a plain Python
function of ours (a helper missing its @triton.jit); only a GPU run would show either. This test
finds both statically.
"""

import ast
import importlib
import inspect
import pkgutil
import textwrap

import pytest

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from triton.runtime.jit import KernelInterface  # noqa: E402

import nanovllm.kernels  # noqa: E402
import nanovllm.moe  # noqa: E402
import nanovllm.sampling  # noqa: E402

PLAIN_SCALARS = (bool, int, float, str)


def _jit_functions():
    for package in (nanovllm.kernels, nanovllm.moe, nanovllm.sampling):
        for info in pkgutil.iter_modules(package.__path__):
            module = importlib.import_module(f"{package.__name__}.{info.name}")
            for name, value in vars(module).items():
                if isinstance(value, KernelInterface):
                    fn = _python_function(value)
                    if fn.__module__ == module.__name__:
                        yield f"{module.__name__.removeprefix('nanovllm.')}.{name}", fn


def _python_function(kernel):
    """The Python function under a jit/interpreted/autotuned kernel."""
    fn = kernel
    while isinstance(fn, KernelInterface):
        fn = fn.fn
    return fn


def _local_names(fn_node: ast.FunctionDef) -> set[str]:
    names = {a.arg for a in fn_node.args.args + fn_node.args.kwonlyargs}
    for node in ast.walk(fn_node):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


def _plain_global_reads(fn) -> list[str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    fn_node = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef))
    local = _local_names(fn_node)
    module_globals = fn.__globals__
    bad = []
    for node in ast.walk(fn_node):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id not in local:
            value = module_globals.get(node.id)
            if isinstance(value, PLAIN_SCALARS) and not isinstance(value, tl.constexpr):
                bad.append(node.id)
    return sorted(set(bad))


def _plain_python_calls(fn) -> list[str]:
    """Names of our own module-level functions that `fn` calls without them being Triton kernels."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    fn_node = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef))
    bad = []
    for node in ast.walk(fn_node):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            value = fn.__globals__.get(node.func.id)
            if (inspect.isfunction(value) and value.__module__.startswith("nanovllm")
                    and not isinstance(value, KernelInterface)):
                bad.append(node.func.id)
    return sorted(set(bad))


KERNELS = sorted(_jit_functions())


def test_kernels_are_found():
    names = {name for name, _ in KERNELS}
    # One kernel of each family that once read a plain float global: the scan must reach them.
    assert "sampling.logprobs_kernel._logprobs_kernel" in names
    assert "moe.routing._route_kernel" in names


@pytest.mark.parametrize("name,fn", KERNELS, ids=[name for name, _ in KERNELS])
def test_kernel_reads_only_constexpr_globals(name, fn):
    assert _plain_global_reads(fn) == [], f"{name} reads plain Python globals; wrap them in tl.constexpr"


@pytest.mark.parametrize("name,fn", KERNELS, ids=[name for name, _ in KERNELS])
def test_kernel_calls_only_triton_functions(name, fn):
    assert _plain_python_calls(fn) == [], f"{name} calls plain Python functions; mark them @triton.jit"


def test_the_scan_catches_a_call_to_a_plain_python_helper():
    from nanovllm.sampling import logprobs_kernel as logprobs

    original = logprobs._key_value
    try:
        logprobs._key_value = _python_function(original)  # the helper without its @triton.jit
        assert _plain_python_calls(_python_function(logprobs._logprobs_kernel)) == ["_key_value"]
    finally:
        logprobs._key_value = original


def test_the_scan_catches_a_plain_float_global():
    from nanovllm.sampling import logprobs_kernel as logprobs

    original = logprobs.LOG2E
    try:
        logprobs.LOG2E = 1.4426950408889634  # what the kernel read before the fix
        assert _plain_global_reads(_python_function(logprobs._logprobs_kernel)) == ["LOG2E"]
    finally:
        logprobs.LOG2E = original
