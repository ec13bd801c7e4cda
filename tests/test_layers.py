"""The layout is the architecture, read from the code's own imports: a module imports only from its own layer or
the ones below it, and no modules import each other round (a cycle). Every import counts: at the top, inside a
function, under TYPE_CHECKING. The judge stays pure: it imports neither torch nor NVML, so the launcher and
`stackproof verdict` decide without them."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "stackproof"
# Lowest first. The foundation (errors, environment, settings, files, tools) is what every part may use; where the pins
# are written (the matrix, its locks and the index they are checked against); the judge's pure rules and the typed
# readings they read; the measurements; the run record and its renderings; the runner of the suite;
# acting on nodes (the healthcheck runs the suite, then acts); building and shipping images; the entry points.
LAYERS = [
    {"stackproof", "stackproof.errors", "stackproof.environment", "stackproof.settings", "stackproof.files",
     "stackproof.tools", "stackproof.pipes"},
    {"stackproof.images.matrix", "stackproof.images.locks", "stackproof.images.index", "stackproof.images.metadata"},
    {"stackproof.judge"},
    {"stackproof.measure"},
    {"stackproof.report"},
    {"stackproof.run"},
    {"stackproof.act"},
    {"stackproof.images"},
    {"stackproof.bench", "stackproof.cli", "stackproof.__main__"},
]
PURE = ("torch", "pynvml", "numpy")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in PACKAGE.rglob("*.py")}


def imports(path: Path, known: set[str]) -> set[str]:
    """The stackproof modules (and third-party top-level names) a file imports, anywhere in it."""
    found = set()
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            for alias in node.names:  # `from stackproof.judge import bars` imports the module stackproof.judge.bars
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return found


def layer(name: str) -> int:
    for index, members in enumerate(LAYERS):
        if any(name == m or (m != "stackproof" and name.startswith(m + ".")) for m in members):
            return index
    raise AssertionError(f"{name}: in no layer of tests/test_layers.py; add it where it belongs")


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: {i for i in imports(path, set(known)) if i in known and i != name} for name, path in known.items()}


def test_no_module_imports_from_a_layer_above_its_own():
    upward = sorted(f"{name} -> {target}" for name, targets in graph().items() for target in targets
                    if layer(target) > layer(name))
    assert upward == []


def test_no_import_cycle():
    edges = graph()
    index, low, stack, on_stack, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(node):  # Tarjan's strongly connected components
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for target in sorted(edges[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    # A package's __init__ that imports its own modules is no cycle of parts.
    cycles = [c for c in cycles if not all(m == c[0] or m.startswith(c[0] + ".") for m in c)]
    assert cycles == []


def test_the_judge_imports_neither_torch_nor_nvml():
    known = modules()
    heavy = sorted(f"{name} -> {i}" for name, path in known.items() if name.startswith("stackproof.judge")
                   for i in imports(path, set(known)) if i.split(".")[0] in PURE)
    assert heavy == []


def test_the_measurement_reads_no_bar():
    """A measurement returns what the hardware says; the bar it is held to is the judge's (judge/bars.py), handed
    in by the check. A measure module may import the judge's typed readings and the pure rules it re-exports, never
    the bars: a bar constant feeding a measurement would make the reading depend on what it is judged against."""
    feeding = sorted(f"{name} -> {target}" for name, targets in graph().items() if name.startswith("stackproof.measure")
                     for target in targets if target == "stackproof.judge.bars")
    assert feeding == []
