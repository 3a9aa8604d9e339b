"""The layers the folders show, checked on the import statements of every module (no import runs).

    pallas_kernels, sharding, checkpoints_conv   depend on JAX (and file formats) alone
    jaxinfer.ops                                 operations below the model
    jaxinfer.models                              the model: ops, config, tree utilities
    jaxinfer.runtime                             the step, placement, loading
    jaxinfer.engine                              the host side
    jaxinfer.llm, jaxinfer.server, jaxinfer.cli  the APIs users call
    jaxinfer.training, jaxinfer.calibration      offline work on a model (draft heads, quantization)
and no two modules import each other, however indirectly.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("jaxinfer", "pallas_kernels", "sharding", "checkpoints_conv")
# Imports inside a function, each for a reason the module states.
LAZY_IMPORTS_ALLOWED = {
    "jaxinfer.cli",  # `jaxinfer --help` and argument errors answer without importing JAX
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in (ROOT / package).rglob("*.py")}


def imports_of(path: Path, known: set[str]) -> list[tuple[str, bool]]:
    """(imported in-project module, whether the import sits inside a function) for each import."""
    found = []

    def visit(node, in_function: bool):
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend((a.name, inner) for a in child.names if a.name.split(".")[0] in PACKAGES)
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                if child.module.split(".")[0] in PACKAGES:
                    for a in child.names:  # `from package import submodule` names the submodule
                        sub = f"{child.module}.{a.name}"
                        found.append((sub if sub in known else child.module, inner))
            visit(child, inner)

    visit(ast.parse(path.read_text()), False)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: {m for m, _ in imports_of(path, set(mods))} - {name} for name, path in mods.items()}


def test_the_graph_sees_every_module():
    g = graph()
    assert {"jaxinfer.engine.core", "jaxinfer.ops.kernels", "pallas_kernels.ragged_paged_attention.tpu", "sharding.mesh"} <= set(g)
    assert "jaxinfer.ops.kernels" in g["jaxinfer.ops.attention"]
    assert "pallas_kernels.ragged_paged_attention.split_kv" in g["jaxinfer.ops.kernels"]


def test_kernels_sharding_and_checkpoints_import_nothing_of_jaxinfer():
    g = graph()
    bad = {m: sorted(d for d in deps if d.startswith("jaxinfer")) for m, deps in g.items()
           if m.split(".")[0] in ("pallas_kernels", "sharding", "checkpoints_conv")}
    assert {m: d for m, d in bad.items() if d} == {}


def test_each_layer_imports_only_the_layers_below_it():
    above = {  # a module of the key's layer may not import these
        "jaxinfer.ops": ("jaxinfer.models", "jaxinfer.runtime", "jaxinfer.engine", "jaxinfer.llm", "jaxinfer.aot", "jaxinfer.calibration"),
        "jaxinfer.models": ("jaxinfer.runtime", "jaxinfer.engine", "jaxinfer.llm", "jaxinfer.aot", "jaxinfer.training", "jaxinfer.calibration"),
        "jaxinfer.runtime": ("jaxinfer.engine", "jaxinfer.llm", "jaxinfer.aot", "jaxinfer.training", "jaxinfer.calibration"),
        "jaxinfer.engine": ("jaxinfer.llm", "jaxinfer.aot", "jaxinfer.training", "jaxinfer.cli", "jaxinfer.server", "jaxinfer.calibration"),
        "jaxinfer.llm": ("jaxinfer.server", "jaxinfer.cli", "jaxinfer.calibration"),
        "jaxinfer.config": ("jaxinfer.",),
        "jaxinfer.tree": ("jaxinfer.",),
    }
    g = graph()
    bad = {(m, d) for m, deps in g.items() for layer, banned in above.items() if m == layer or m.startswith(layer + ".")
           for d in deps if d.startswith(banned)}
    assert sorted(bad) == []


def test_no_module_imports_inside_a_function():
    mods = modules()
    lazy = {(name, m) for name, path in mods.items() if name not in LAZY_IMPORTS_ALLOWED
            for m, inside in imports_of(path, set(mods)) if inside}
    assert sorted(lazy) == []


def test_no_import_cycles():
    g = graph()
    cycles, state = [], {}  # state: 1 = on the current path, 2 = done

    def visit(m: str, path: list[str]):
        state[m] = 1
        for d in sorted(g.get(m, ())):
            if d not in g:
                continue
            if state.get(d) == 1:
                cycles.append(path[path.index(d):] + [d])
            elif d not in state:
                visit(d, path + [d])
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m, [m])
    assert cycles == []
