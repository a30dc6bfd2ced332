"""Every module-level name a Triton kernel reads or calls is one compiled Triton accepts.

The interpreter (TRITON_INTERPRET=1, CI's only Triton) runs kernels as Python: it reads any global
and calls any function. The compiler refuses a plain int/float/bool/str global ("Cannot access
global variable ... from within @jit'ed function") and cannot compile a call to a plain Python
function of ours (a helper missing its @triton.jit); only a GPU run would show either. This test
finds both statically.
"""

import ast
import importlib
import importlib.util
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
    """Names of module-level functions of fn's own package (nanovllm for the kernels) that `fn`
    calls without them being Triton kernels."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    fn_node = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef))
    package = fn.__module__.split(".")[0]
    bad = []
    for node in ast.walk(fn_node):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            value = fn.__globals__.get(node.func.id)
            if (inspect.isfunction(value) and value.__module__.split(".")[0] == package
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


# A kernel module with both mistakes beside their correct forms: a helper missing its
# @triton.jit, and a plain float global (the bug once in sampling/logprobs_kernel.py).
FIXTURE = """
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
SCALE = tl.constexpr(0.5)


def plain_helper(x):
    return x * 2


@triton.jit
def jit_helper(x):
    return x + 1


@triton.jit
def bad_kernel(x_ptr):
    x = tl.load(x_ptr)
    tl.store(x_ptr, plain_helper(jit_helper(x)) * LOG2E)


@triton.jit
def good_kernel(x_ptr):
    tl.store(x_ptr, jit_helper(tl.load(x_ptr)) * SCALE)
"""


@pytest.fixture(scope="module")
def fixture_module(tmp_path_factory):
    """FIXTURE imported from a file of its own (the scans read a kernel's source)."""
    path = tmp_path_factory.mktemp("scan") / "scan_fixture.py"
    path.write_text(FIXTURE)
    spec = importlib.util.spec_from_file_location("scan_fixture", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_scan_catches_a_call_to_a_plain_python_helper(fixture_module):
    assert _plain_python_calls(_python_function(fixture_module.bad_kernel)) == ["plain_helper"]
    assert _plain_python_calls(_python_function(fixture_module.good_kernel)) == []


def test_the_scan_catches_a_plain_float_global(fixture_module):
    assert _plain_global_reads(_python_function(fixture_module.bad_kernel)) == ["LOG2E"]
    assert _plain_global_reads(_python_function(fixture_module.good_kernel)) == []
