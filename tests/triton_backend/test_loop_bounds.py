"""Every loop in a Triton kernel runs to a compile-time bound.

The interpreter of Triton 3.6 (the oldest supported, tools/test_matrix.sh) turns a
runtime loop bound into an int with int() of a 1-element array, which numpy >= 2.4
refuses: ``for k in range(0, K, BLOCK_K)`` with K a kernel argument fails there while
passing under the newest Triton that CI runs. This reads the kernels' source, so CI
catches such a loop without the old pair installed.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator, Set

import pytest

KERNELS = Path(__file__).resolve().parents[2] / "frugal_kernels" / "kernels" / "triton"
LOOP_CALLS = {"range", "static_range"}  # range, tl.range, tl.static_range


def jitted(tree: ast.Module) -> Iterator[ast.FunctionDef]:
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and any(
                "jit" in ast.unparse(d) for d in node.decorator_list):
            yield node


def runtime_arguments(fn: ast.FunctionDef) -> Set[str]:
    """The arguments not annotated tl.constexpr: values known only at launch."""
    return {a.arg for a in fn.args.args
            if a.annotation is None or "constexpr" not in ast.unparse(a.annotation)}


def runtime_bounds(source: str) -> Iterator[str]:
    for fn in jitted(ast.parse(source)):
        runtime = runtime_arguments(fn)
        for node in ast.walk(fn):
            if not (isinstance(node, ast.For) and isinstance(node.iter, ast.Call)):
                continue
            call = node.iter.func
            name = call.attr if isinstance(call, ast.Attribute) else getattr(call, "id", "")
            if name not in LOOP_CALLS:
                continue
            used = {n.id for a in node.iter.args for n in ast.walk(a) if isinstance(n, ast.Name)}
            if used & runtime:
                yield f"{fn.name} line {node.lineno}: {ast.unparse(node.iter)}"


@pytest.mark.parametrize("path", sorted(KERNELS.glob("*.py")), ids=lambda p: p.name)
def test_loops_run_to_constexpr_bounds(path):
    assert list(runtime_bounds(path.read_text())) == []


def test_a_runtime_bound_is_found():
    """The check itself: the loop that Triton 3.6's interpreter refused."""
    source = ("@triton.jit\n"
              "def k(x_ptr, R, BLOCK_K: tl.constexpr, STEPS: tl.constexpr):\n"
              "    for k0 in range(0, R, BLOCK_K):\n        pass\n"
              "    for s in tl.range(STEPS):\n        pass\n")
    assert list(runtime_bounds(source)) == ["k line 3: range(0, R, BLOCK_K)"]
