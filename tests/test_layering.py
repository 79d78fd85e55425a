"""The package's layers: every module imports only its own layer and the layers below it.

    leaf (config, config_sched, sampling_params, request, outputs, tensor_utils)
    kernels -> attention -> models            core (no torch: the scheduler and the KV manager)
                              \\                /
                               worker -> engine -----------------------------> entrypoints
                                           \\-> disagg (prefill/decode engine processes) -/

Imports under `if TYPE_CHECKING:` name types for annotations only and are not counted there;
no module reaches itself through imports of any kind (top level, `TYPE_CHECKING`, inside a
function, relative).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import vllm_rlt

PACKAGE = Path(vllm_rlt.__file__).parent
LEAF = {
    "config",
    "config_fields",
    "config_sched",
    "serve_config",
    "sampling_params",
    "request",
    "outputs",
    "tensor_utils",
}
TOOLS = {"config_docs"}  # top-level tools, at the entrypoints' layer
BELOW = {
    "leaf": set(),
    "kernels": {"leaf"},
    "attention": {"leaf", "kernels"},
    "models": {"leaf", "kernels", "attention"},
    "core": {"leaf"},
    "worker": {"leaf", "kernels", "attention", "models", "core"},
    "engine": {"leaf", "kernels", "attention", "models", "core", "worker"},
}
BELOW["disagg"] = BELOW["engine"] | {"engine"}
BELOW["entrypoints"] = BELOW["disagg"] | {"disagg"}
# modules that must not need torch (or Triton) at run time
TORCH_FREE = ("core", "config", "config_sched", "sampling_params", "request", "outputs")


def layer(module: str) -> str | None:
    """The layer of a `vllm_rlt.*` module name (None: the package itself)."""
    parts = module.split(".")
    if len(parts) < 2:
        return None
    name = parts[1]
    found = "leaf" if name in LEAF else "entrypoints" if name in TOOLS else name
    assert found in BELOW, f"{module}: a module in no layer (add it to LEAF, TOOLS or BELOW)"
    return found


def all_imports(name: str, source: str, known: set[str]) -> set[str]:
    """The `known` modules that module `name` imports anywhere in `source` (an imported name
    that is a module counts as that module)."""
    package = name if f"{name}.__init__" in known else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, *([node.module] if node.module else [])])
            found |= {base, *(f"{base}.{alias.name}" for alias in node.names)}
    return {m for m in found if m in known and m != name}


def import_loops(sources: dict[str, str]) -> list[list[str]]:
    """The import loops (strongly connected groups of two or more modules) among `sources`
    (module name -> source; a package as its name, with `NAME.__init__` also a key)."""
    known = set(sources)
    graph = {name: all_imports(name, src, known) for name, src in sources.items()}
    order, low, stack, on_stack, loops = {}, {}, [], set(), []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        order[v] = low[v] = len(order)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in order:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], order[w])
        if low[v] == order[v]:
            group = []
            while not group or group[-1] != v:
                group.append(stack.pop())
                on_stack.discard(group[-1])
            if len(group) > 1:
                loops.append(sorted(group))

    for v in sorted(graph):
        if v not in order:
            visit(v)
    return loops


def runtime_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in `path`, outside `if TYPE_CHECKING:` blocks."""
    tree = ast.parse(path.read_text())
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return found


def modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        yield path, ".".join(rel.parts).removesuffix(".__init__")


def test_every_import_points_down_the_layers():
    wrong = []
    for path, name in modules():
        own = layer(name)
        if own is None:
            continue
        for line, imported in runtime_imports(path):
            target = layer(imported) if imported.startswith("vllm_rlt.") else None
            if target is not None and target != own and target not in BELOW[own]:
                wrong.append(f"{name}:{line} ({own}) imports {imported} ({target})")
    assert not wrong, "\n".join(wrong)


def package_sources() -> dict[str, str]:
    sources = {}
    for path, name in modules():
        sources[name] = path.read_text()
        if path.name == "__init__.py":
            sources[f"{name}.__init__"] = ""
    return sources


def test_no_import_loops():
    assert import_loops(package_sources()) == []


def test_a_planted_loop_is_found():
    """The check finds loops through a lazy import, a TYPE_CHECKING import and a relative one."""
    planted = {
        "pkg": "",
        "pkg.__init__": "",
        "pkg.a": "def f():\n    from pkg.b import g\n",
        "pkg.b": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import c\n",
        "pkg.c": "import pkg.a\n",
        "pkg.d": "from pkg import a\n",
    }
    assert import_loops(planted) == [["pkg.a", "pkg.b", "pkg.c"]]
    sources = package_sources()
    sources["vllm_rlt.core.block_pool"] += "\ndef f():\n    import vllm_rlt.core.kv_cache_manager\n"
    assert ["vllm_rlt.core.block_pool", "vllm_rlt.core.kv_cache_manager"] in import_loops(sources)


def test_the_plan_depends_on_nothing_of_the_scheduler():
    """Only the plan crosses from scheduler to runner: `execution_batch` (the plan's types)
    imports no module of the package, so none of the scheduler's state comes with it."""
    path = PACKAGE / "core" / "sched" / "execution_batch.py"
    known = set(package_sources())
    assert all_imports("vllm_rlt.core.sched.execution_batch", path.read_text(), known) == set()


def test_the_runner_side_takes_only_the_plan_from_core():
    """Only the plan crosses from scheduler to runner: of `core`, the runner side (`worker`, its
    `plan_driver` too, which tests and `vllm-rlt inspect` run the runner through) imports the
    plan's types alone, never the scheduler or the KV manager (imports of any kind)."""
    sources = package_sources()
    known = set(sources)
    plan = "vllm_rlt.core.sched.execution_batch"
    wrong = [
        f"{name} imports {m}"
        for _, name in modules()
        if layer(name) == "worker"
        for m in sorted(all_imports(name, sources[name], known))
        if layer(m) == "core" and m != plan
    ]
    assert not wrong, "\n".join(wrong)


def test_the_scheduler_side_imports_no_torch():
    wrong = []
    for path, name in modules():
        if name.split(".")[1:2] and name.split(".")[1] in TORCH_FREE:
            heavy = [m for _, m in runtime_imports(path) if m.split(".")[0] in ("torch", "triton")]
            wrong += [f"{name} imports {m}" for m in heavy]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize(
    "statement",
    [
        "import vllm_rlt.core.sched.scheduler, vllm_rlt.core.kv_cache_manager",
        "import vllm_rlt.models.registry",
    ],
)
def test_imports_run_without_torch(statement):
    """With torch and Triton unimportable, the scheduler side imports, and so does the model
    registry, which imports a model's module only when that model is asked for."""
    code = f"import sys; sys.modules['torch'] = sys.modules['triton'] = None; {statement}"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
