"""The environment is read in one place (issue 37, item 4), read from the code's own syntax: no module of the
package or the suite but stackproof/environment.py reads os.environ or os.getenv (nor writes it: a variable set
here and read there would be a channel between our own parts). Handing the whole environment on to a child
process (`env=os.environ`, `{**os.environ, ...}`, `dict(os.environ)`, `os.environ.copy()`) is not a read."""

import ast
from pathlib import Path

from stackproof import environment

REPO = Path(__file__).resolve().parent.parent
OWNER = REPO / "stackproof" / "environment.py"
ACCESS = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}


def reads(source: str) -> list[str]:
    """'line: code' for each read (or write) of the process environment in this source, outside a hand-over."""
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    os_names = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names if alias.name == "os"}

    def handed_on(node: ast.AST) -> bool:
        parent = parents.get(node)
        if isinstance(parent, ast.keyword) and parent.arg == "env":
            return True
        if isinstance(parent, ast.Dict) and any(k is None and v is node
                                                for k, v in zip(parent.keys, parent.values, strict=True)):
            return True
        if isinstance(parent, ast.Call) and isinstance(parent.func, ast.Name) and parent.func.id == "dict" \
                and parent.args == [node] and not parent.keywords:
            return True
        return isinstance(parent, ast.Attribute) and parent.attr == "copy" and isinstance(parents.get(parent), ast.Call)

    def read(node: ast.AST) -> bool:
        if isinstance(node, ast.ImportFrom):
            return node.module == "os" and any(a.name in ACCESS for a in node.names)
        return isinstance(node, ast.Attribute) and node.attr in ACCESS and isinstance(node.value, ast.Name) \
            and node.value.id in os_names and not (node.attr == "environ" and handed_on(node))

    found = [node for node in ast.walk(tree) if read(node)]
    return [f"{node.lineno}: {ast.get_source_segment(source, node)}"
            for node in sorted(found, key=lambda n: (n.lineno, n.col_offset))]


def test_only_the_environment_module_reads_the_environment():
    sources = [p for folder in ("stackproof", "smoke_tests") for p in sorted((REPO / folder).rglob("*.py"))
               if p != OWNER]
    found = [f"{p.relative_to(REPO)}:{line}" for p in sources for line in reads(p.read_text())]
    assert found == [], ("read the variable through stackproof/environment.py (declare it there), or hand the "
                         "value down from the entry point that read it", found)


def test_the_guard_tells_a_read_from_a_hand_over():
    source = '''
import os
import os as system
from os import getenv
subprocess.run(cmd, env=os.environ)
child = {**os.environ, "A": "1"}
copied, again = dict(os.environ), os.environ.copy()
name = os.environ.get("NODE")
other = {**os.environ, "B": os.environ["B"]}
os.environ["NCCL_DEBUG"] = "INFO"
there = "RANK" in system.environ
value = os.getenv("X")
'''
    assert reads(source) == ["4: from os import getenv", "8: os.environ", "9: os.environ", "10: os.environ",
                             "11: system.environ", "12: os.getenv"]


def test_each_variable_is_declared_once():
    names = [v.name for v in vars(environment).values() if isinstance(v, environment.Variable)]
    names += [v.name for v in environment.CA_BUNDLES]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    assert all(v.means for v in vars(environment).values() if isinstance(v, environment.Variable))
