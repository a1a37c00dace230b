"""The import structure of shardkit's packages, read from the source (ast, nothing imported): no import cycle between
modules, whether the imports are at module level or inside functions (a lazy import hides a cycle, it does not remove
it; `if TYPE_CHECKING:` imports, which never run, are not counted); train/parallel/ (the parallelism primitives)
imports nothing of the trainer above it; and the packages are layers, each importing only the ones below it:
checkpoint/ (the format) < train/ < verify/ (the proof engine, which never imports the converters) < plan/ <
convert/ (whose default proof calls verify) < shardkit/ (the command line)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("checkpoint", "convert", "verify", "train", "plan", "shardkit")

# bottom to top: a module imports modules of its own package and of the packages before it, never one after it
LAYERS = ("checkpoint", "train", "verify", "plan", "convert", "shardkit")


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(f.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = f
    return out


def statements(body: list):
    """Every statement in `body` and the statement lists nested in it (imports are statements: expressions, where
    most of a module's nodes are, need no visit)."""
    for node in body:
        yield node
        for field in ("body", "orelse", "finalbody", "handlers", "cases"):
            inner = getattr(node, field, None)
            if isinstance(inner, list):
                yield from statements(inner)


def import_edges(mods: dict[str, Path]) -> dict[str, dict[str, str]]:
    """importer -> {imported module: "top" (at module level) or "fn" (inside a function or class body)}, our modules
    only; `from pkg import name` counts as importing pkg.name where that is a module."""

    def owner(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, dict[str, str]] = {}
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        top = {id(n) for n in tree.body}
        typing_only = set()  # `if TYPE_CHECKING:` imports: annotations only, never run
        # module-level also inside a top-level if/try (e.g. an optional dependency)
        for n in tree.body:
            if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test):
                typing_only |= {id(x) for x in statements([n])}
            elif isinstance(n, (ast.If, ast.Try)):
                top |= {id(x) for x in statements([n]) if isinstance(x, (ast.Import, ast.ImportFrom))}
        package = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        out: dict[str, str] = {}
        for node in statements(tree.body):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package[:len(package) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                targets = [f"{target}.{a.name}" if f"{target}.{a.name}" in mods else target for a in node.names]
            else:
                continue
            for t in targets:
                t = owner(t)
                if t and t != mod and out.get(t) != "top":
                    out[t] = "top" if id(node) in top else "fn"
        edges[mod] = out
    return edges


def cycles(edges: dict[str, dict[str, str]], keep=lambda a, b, how: True) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), over the edges `keep` accepts."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w, how in edges[v].items():
            if not keep(v, w, how):
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    return found


def describe(edges, comp: list[str]) -> str:
    return "; ".join(f"{a} -> {b} ({edges[a][b]})" for a in comp for b in comp if b in edges[a])


def reach(edges, start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for w in edges[todo.pop()]:
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return seen


EDGES = import_edges(modules())


def test_the_graph_is_read():
    # the reader sees relative, absolute, `from pkg import module` and lazy imports
    assert EDGES["verify.against"]["verify.streamed"] == "top"
    assert EDGES["train.parallel.interleaved"]["train.parallel.pipeline"] == "top"
    assert EDGES["train.parallel.tensor"]["train.model"] == "top"
    assert EDGES["shardkit.cli"]["verify.run"] == "fn"
    assert len(EDGES) > 80


def test_no_module_level_import_cycle():
    found = cycles(EDGES, lambda a, b, how: how == "top")
    assert not found, "module-level import cycles: " + " | ".join(describe(EDGES, c) for c in found)


def test_no_import_cycle_even_through_function_level_imports():
    found = cycles(EDGES)
    assert not found, "import cycles: " + " | ".join(describe(EDGES, c) for c in found)


def test_the_cycle_detector_finds_a_planted_cycle():
    planted = {m: dict(t) for m, t in EDGES.items()}
    planted["verify.streamed"]["verify.against"] = "fn"  # against imports streamed at the top
    assert ["verify.against", "verify.streamed"] in cycles(planted)


def test_parallel_imports_nothing_of_the_trainer():
    """train/parallel/ may import train modules only where they are below it: modules that do not (even lazily,
    even through others) import train/parallel/ back, e.g. train/model.py; never the trainer (loop, config,
    engines, precision, the MoE training hooks, parallelize)."""
    def parallel(m: str) -> bool:
        return m == "train.parallel" or m.startswith("train.parallel.")

    bad = []
    for mod, targets in EDGES.items():
        if not parallel(mod):
            continue
        for t in targets:
            if t.startswith("train.") and not parallel(t):
                back = sorted(x for x in reach(EDGES, t) if parallel(x))
                if back:
                    bad.append(f"{mod} imports {t}, which imports {back[0]}")
    assert not bad, "; ".join(bad)


def test_lower_packages_import_nothing_above():
    assert set(LAYERS) == set(PACKAGES)
    bad = [f"{a} -> {b}" for a, targets in EDGES.items() for b in targets
           if LAYERS.index(b.split(".")[0]) > LAYERS.index(a.split(".")[0])]
    assert not bad, bad


def test_verify_imports_nothing_of_convert():
    """verify/ is the proof engine: it reads HF files (checkpoint/hf_source.py) and torch_dist checkpoints
    (checkpoint/torch_dist_view.py) through checkpoint/, even lazily never through the converters that call it."""
    bad = sorted(f"{a} -> {b}" for a, targets in EDGES.items() for b in targets
                 if a.split(".")[0] == "verify" and b.split(".")[0] == "convert")
    assert not bad, bad
    assert any(b.split(".")[0] == "verify" for a, targets in EDGES.items() if a.split(".")[0] == "convert"
               for b in targets), "the converters' default proof calls verify"
