"""The package's imports run one way: down the layers of DESIGN.md section 2.

Every import in every module of the package (function-local ones included) is
read from the source with ast and checked against the table below: a module
may import its own layer group and the groups of lower layers, never a group
of its own layer or of a higher one; and no module reaches into another
module's private names (``from x import _name``) outside its own package.

One table says which backend runs what: ``frugal_kernels/ops/_dispatch.py``. A list,
tuple, set or dict of backend names written anywhere else in the package is a second
copy of it that drifts (the optimizers and modules ask the table instead).
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator, List, Tuple

import pytest

PACKAGE = "frugal_kernels"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE

# (layer, group): a group is a module or a package (its submodules with it).
# Groups of one layer know nothing of each other.
LAYERS = {
    "frugal_kernels._version": 0,
    "frugal_kernels._versions": 0,  # the supported torch and Triton versions
    "frugal_kernels._layout": 0,
    "frugal_kernels._shard": 0,  # row sharding: where a rank's rows of a dim-0 shard lie
    "frugal_kernels._quant": 0,
    "frugal_kernels._C": 0,  # the compiled kernels (a shared library, not a .py file)
    "frugal_kernels._extension": 1,
    "frugal_kernels.kernels": 2,
    "frugal_kernels.reference": 2,
    "frugal_kernels.ops": 3,
    "frugal_kernels.nn": 3.5,  # modules on the ops, whose weights the DQT optimizer reads
    "frugal_kernels.optim": 4,
    "frugal_kernels.governor": 4,
    "frugal_kernels.data": 4,  # online selection: the fused loss's scores, over a model
    "frugal_kernels.model": 4,
    "frugal_kernels._build_info": 4,  # what was built and which backends run: above ops
    "frugal_kernels": 5,  # the package's own __init__: the public names
    "frugal_kernels.bench": 6,  # microbenchmarks: the library, never the training application
    # The training application (model runs, corpus, demo, sweep, peers, tuned lrs): on top of
    # the library and the bench, one group whose modules use each other.
    "frugal_kernels.lab": 7,
    "frugal_kernels.__main__": 9,
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def group_of(name: str) -> str:
    """The longest group of LAYERS that ``name`` is or lies in."""
    best = None
    for group in LAYERS:
        if (name == group or name.startswith(group + ".")) and (
                best is None or len(group) > len(best)):
            best = group
    if best is None:
        raise AssertionError(f"{name} is in no layer of tests/test_layers.py: add it there")
    if best == PACKAGE and name != PACKAGE:
        raise AssertionError(f"{name} is in no layer of tests/test_layers.py: add it there")
    return best


def is_module(name: str) -> bool:
    if name == "frugal_kernels._C":
        return True
    rel = Path(*name.split("."))
    return (ROOT.parent / rel).with_suffix(".py").exists() or (ROOT.parent / rel / "__init__.py").exists()


def imports(path: Path) -> Iterator[Tuple[int, str, List[str]]]:
    """(line, imported module, names taken from it) for each import of the package."""
    this = module_name(path)
    package = this if path.name == "__init__.py" else this.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == PACKAGE:
                    yield node.lineno, alias.name, []
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if base.split(".")[0] != PACKAGE:
                continue
            plain = []
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if is_module(sub):
                    yield node.lineno, sub, []
                else:
                    plain.append(alias.name)
            if plain:
                yield node.lineno, base, plain


def violations(path: Path) -> List[str]:
    this = module_name(path)
    here = group_of(this)
    found = []
    for line, target, names in imports(path):
        there = group_of(target)
        where = f"{path.relative_to(ROOT.parent)}:{line}"
        if there != here and LAYERS[there] >= LAYERS[here]:
            found.append(f"{where}: {here} (layer {LAYERS[here]}) imports {target} "
                         f"(layer {LAYERS[there]})")
        if there != here:
            private = [n for n in names if n.startswith("_") and not n.endswith("__")]
            if private:
                found.append(f"{where}: {this} takes the private {', '.join(private)} "
                             f"from {target}")
    return found


SOURCES = sorted(ROOT.rglob("*.py"))


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT.parent)))
def test_imports_run_down_the_layers(path):
    assert violations(path) == []


@pytest.mark.parametrize("source,expected", [
    # a Triton kernel reaching up into the op layer, or into the reference
    ("kernels/triton/x.py", "from frugal_kernels.ops.frugal_step import matrix_view"),
    ("kernels/triton/x.py", "from frugal_kernels.reference import RIGHT"),
    # the extension loader importing the op layer, even inside a function
    ("_extension.py", "def f():\n    from frugal_kernels.ops import _dispatch"),
    # a private name across packages
    ("lab/train.py", "from frugal_kernels.optim.frugal import _release_freed_memory"),
    # the library reaching up into the training application
    ("optim/x.py", "from frugal_kernels.lab.train import TrainConfig"),
    ("model.py", "def f():\n    from frugal_kernels.lab import corpus"),
    # the bench importing the training loop (it measures the library, not the application)
    ("bench/x.py", "from frugal_kernels.lab.train import train"),
    ("bench/x.py", "from frugal_kernels.lab import demo"),
    # one group of a layer importing another of the same layer
    ("optim/x.py", "from frugal_kernels import governor"),
])
def test_the_check_catches_wrong_arrows(tmp_path, monkeypatch, source, expected):
    fake_root = tmp_path / PACKAGE
    for real in SOURCES:  # the real tree, so that is_module sees the real submodules
        dest = fake_root / real.relative_to(ROOT)
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(real.read_text())
    target = fake_root / source
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(expected + "\n")
    monkeypatch.setattr(__import__(__name__, fromlist=["ROOT"]), "ROOT", fake_root)
    assert violations(target), f"{source}: {expected!r} was not caught"


# ---------------------------------------------------------------- backend lists

BACKEND_NAMES = {"cpu", "cuda", "triton", "torch"}
DEVICE_TYPES = {"cpu", "cuda"}  # backend names that also name devices
CAPABILITY_TABLE = "frugal_kernels.ops._dispatch"


def backend_lists(path: Path) -> List[str]:
    """Collections written in ``path`` that list backends: every string in them a backend
    name (or ``"auto"``), two or more of them, at least one no device type (a list of
    devices is not a list of backends; a record with a "cpu" and a "torch" key among
    others is neither)."""
    if module_name(path) == CAPABILITY_TABLE:
        return []
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            items = node.elts
        elif isinstance(node, ast.Dict):
            items = [k for k in node.keys if k is not None]
        else:
            continue
        strings = {i.value for i in items
                   if isinstance(i, ast.Constant) and isinstance(i.value, str)}
        names = strings & BACKEND_NAMES
        if len(names) >= 2 and names - DEVICE_TYPES and strings <= BACKEND_NAMES | {"auto"}:
            found.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}: "
                         f"{ast.unparse(node)[:80]} lists backends outside {CAPABILITY_TABLE}")
    return found


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT.parent)))
def test_backends_are_listed_in_the_capability_table_only(path):
    assert backend_lists(path) == []


@pytest.mark.parametrize("source,planted", [
    # what the plans and projections had: the backends of an op restated
    ("optim/plan.py", '_FUSED_BACKENDS = ("auto", "cpu", "torch")'),
    ("nn/x.py", 'def f(backend):\n    return backend in {"triton", "cuda"}'),
    # an op's implementations keyed by backend instead of declared on its spec
    ("ops/x.py", '_IMPLS = {"cpu": f, "triton": g, "torch": h}'),
    ("bench/x.py", 'for backend in ["cuda", "triton"]:\n    pass'),
])
def test_the_check_catches_backend_lists(tmp_path, monkeypatch, source, planted):
    fake_root = tmp_path / PACKAGE
    target = fake_root / source
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(planted + "\n")
    monkeypatch.setattr(__import__(__name__, fromlist=["ROOT"]), "ROOT", fake_root)
    assert backend_lists(target), f"{source}: {planted!r} was not caught"


def test_the_backend_check_lets_device_lists_and_the_table_be(tmp_path, monkeypatch):
    fake_root = tmp_path / PACKAGE
    devices = fake_root / "bench" / "x.py"
    table = fake_root / "ops" / "_dispatch.py"
    for path, text in ((devices, 'DEVICES = ("cpu", "cuda")'),
                       (table, 'BACKENDS = ("cpu", "cuda", "triton", "torch")')):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    monkeypatch.setattr(__import__(__name__, fromlist=["ROOT"]), "ROOT", fake_root)
    assert backend_lists(devices) == [] and backend_lists(table) == []
