"""The import graph of MaxText has no cycles, and no file edits sys.path.

The graph is read from the source with `ast`, not by importing: an edge A -> B for every `import MaxText.B`
or `from MaxText[.pkg] import B` in A, at module level or inside a function (a lazy import that closes a
loop is still a cycle: config <-> config_checks and launch <-> train were both lazy). Imports under
`if TYPE_CHECKING:` never run and are left out. `from MaxText.pkg import name` is an edge to the module
MaxText.pkg.name when there is one, else to the package MaxText.pkg.
"""

import ast
import importlib.util
import os
import subprocess
import sys

import pytest

import MaxText
from MaxText.tests.conftest import ROOT

PACKAGE = "MaxText"
MUTATING = {"insert", "append", "extend", "remove", "pop", "clear", "__setitem__", "__iadd__"}  # list methods
# Entry points whose `__main__` block other work is rewriting (the paths and metrics rewrites own these files).
MAIN_PENDING: set[str] = set()


def python_files(top: str) -> list[str]:
  """Every .py file under `top`, relative to ROOT, outside hidden directories and virtual environments."""
  found = []
  for directory, dirs, files in os.walk(top):
    dirs[:] = sorted(
      d
      for d in dirs
      if not d.startswith((".", "__pycache__")) and not os.path.exists(os.path.join(directory, d, "pyvenv.cfg"))
    )
    found += [os.path.relpath(os.path.join(directory, f), ROOT) for f in sorted(files) if f.endswith(".py")]
  return found


def module_name(path: str) -> str:
  name = path[: -len(".py")].replace(os.sep, ".")
  return name[: -len(".__init__")] if name.endswith(".__init__") else name


def parse(path: str) -> ast.Module:
  with open(os.path.join(ROOT, path)) as f:
    return ast.parse(f.read(), path)


def _is_type_checking(node: ast.AST) -> bool:
  test = node.test if isinstance(node, ast.If) else None
  return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
    isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
  )


def imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
  """Every import statement that can run: anywhere in the file except under `if TYPE_CHECKING:`."""
  return _imports(ast.iter_child_nodes(tree))


def _imports(nodes) -> list[ast.Import | ast.ImportFrom]:
  found = []
  for node in nodes:
    if isinstance(node, ast.Import | ast.ImportFrom):
      found.append(node)
    elif _is_type_checking(node):
      found += _imports(node.orelse)
    else:
      found += _imports(ast.iter_child_nodes(node))
  return found


def imported_modules(node: ast.Import | ast.ImportFrom, importer: str, is_package: bool, modules: set[str]) -> set[str]:
  """The MaxText modules that `node`, in module `importer`, imports."""
  if isinstance(node, ast.Import):
    return {alias.name for alias in node.names if alias.name.split(".")[0] == PACKAGE}
  base = node.module or ""
  if node.level:  # relative: from the importer's package, one level up per extra dot
    parts = importer.split(".") if is_package else importer.split(".")[:-1]
    parts = parts[: len(parts) - node.level + 1]
    base = ".".join([*parts, base] if base else parts)
  if base.split(".")[0] != PACKAGE:
    return set()
  return {f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names}


def import_graph() -> dict[str, set[str]]:
  """MaxText module -> the MaxText modules it imports (itself left out)."""
  paths = {module_name(p): p for p in python_files(os.path.join(ROOT, PACKAGE))}
  graph = {}
  for name, path in paths.items():
    is_package = path.endswith("__init__.py")
    edges = set().union(*(imported_modules(node, name, is_package, set(paths)) for node in imports(parse(path))))
    graph[name] = {m for m in edges if m in paths and m != name}
  return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
  """Tarjan's algorithm, iterative: the components of more than one module (each one holds a cycle)."""
  index, low, on_stack, stack, components = {}, {}, set(), [], []
  for root in sorted(graph):
    if root in index:
      continue
    work = [(root, iter(sorted(graph[root])))]
    index[root] = low[root] = len(index)
    stack.append(root)
    on_stack.add(root)
    while work:
      node, children = work[-1]
      child = next(children, None)
      if child is None:
        work.pop()
        if work:
          low[work[-1][0]] = min(low[work[-1][0]], low[node])
        if low[node] == index[node]:
          component = []
          while True:
            member = stack.pop()
            on_stack.discard(member)
            component.append(member)
            if member == node:
              break
          if len(component) > 1:
            components.append(sorted(component))
      elif child not in index:
        index[child] = low[child] = len(index)
        stack.append(child)
        on_stack.add(child)
        work.append((child, iter(sorted(graph[child]))))
      elif child in on_stack:
        low[node] = min(low[node], index[child])
  return components


def a_cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
  """The shortest import path from the component's first module back to itself, inside the component."""
  start, members = component[0], set(component)
  paths = {start: [start]}
  frontier = [start]
  while frontier:
    following = []
    for node in frontier:
      for child in sorted(graph[node] & members):
        if child == start:
          return [*paths[node], start]
        if child not in paths:
          paths[child] = [*paths[node], child]
          following.append(child)
    frontier = following
  raise AssertionError(f"no cycle through {start}")


def test_no_import_cycles():
  graph = import_graph()
  cycles = [" -> ".join(a_cycle(graph, c)) for c in strongly_connected(graph)]
  assert not cycles, "import cycles among MaxText modules:\n  " + "\n  ".join(cycles)


def test_the_cycle_finder_finds_cycles():
  graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e2"}, "e2": {"e"}}
  assert strongly_connected(graph) == [["a", "b", "c"], ["e", "e2"]]
  assert a_cycle(graph, ["a", "b", "c"]) == ["a", "b", "c", "a"]


def test_lazy_and_relative_imports_are_edges():
  tree = ast.parse(
    "from typing import TYPE_CHECKING\n"
    "if TYPE_CHECKING:\n  from MaxText import never\n"
    "def f():\n  from MaxText import config\n  from . import sibling\n  import MaxText.data.files\n"
  )
  modules = {"MaxText.config", "MaxText.data.sibling", "MaxText.data.files", "MaxText.never"}
  found = set().union(*(imported_modules(n, "MaxText.data.text", False, modules) for n in imports(tree)))
  assert found == {"MaxText.config", "MaxText.data.sibling", "MaxText.data.files"}


def test_errors_is_the_bottom_of_the_graph():
  """Any module can import the user-error types; they import nothing from MaxText."""
  assert import_graph()["MaxText.errors"] == set()


def test_user_errors_are_imported_from_errors_only():
  """The error types have one home: no file imports them from another module or reads them off one."""
  errors = {n.name for n in parse(os.path.join("MaxText", "errors.py")).body if isinstance(n, ast.ClassDef)}
  found = []
  for path in python_files(ROOT):
    for node in ast.walk(parse(path)):
      if isinstance(node, ast.ImportFrom) and node.module != "MaxText.errors":
        found += [f"{path}:{node.lineno} {a.name}" for a in node.names if a.name in errors]
      elif isinstance(node, ast.Attribute) and node.attr in errors:
        if not (isinstance(node.value, ast.Name) and node.value.id == "errors"):
          found.append(f"{path}:{node.lineno} {ast.unparse(node)}")
  assert not found, "import these from MaxText.errors:\n" + "\n".join(found)


def sys_path_edits(tree: ast.AST) -> list[int]:
  """Lines that change the import path: sys.path assigned, item-assigned or deleted, or a list method called
  on it; `from sys import path`; site.addsitedir."""
  lines = []
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module == "sys" and any(a.name == "path" for a in node.names):
      lines.append(node.lineno)
    elif isinstance(node, ast.Attribute) and node.attr == "addsitedir":
      lines.append(node.lineno)
    assigned = node.targets if isinstance(node, ast.Assign | ast.Delete) else []
    assigned = [node.target] if isinstance(node, ast.AugAssign | ast.AnnAssign) else assigned
    for target in assigned:
      if _is_sys_path(target.value if isinstance(target, ast.Subscript) else target):
        lines.append(node.lineno)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATING:
      if _is_sys_path(node.func.value):
        lines.append(node.lineno)
  return sorted(lines)


def _is_sys_path(node: ast.AST) -> bool:
  return (
    isinstance(node, ast.Attribute)
    and node.attr == "path"
    and isinstance(node.value, ast.Name)
    and node.value.id == "sys"
  )


def test_no_file_edits_sys_path():
  """Scripts import MaxText as installed (setup.sh: pip install -e .); none reaches for the repository root."""
  edits = [f"{path}:{line}" for path in python_files(ROOT) for line in sys_path_edits(parse(path))]
  assert not edits, "sys.path edits (import the installed package instead):\n  " + "\n  ".join(edits)


@pytest.mark.parametrize(
  "source",
  [
    "import sys\nsys.path.insert(0, 'x')",
    "import sys\nsys.path[0] = 'x'",
    "import sys\nsys.path = ['x']",
    "import sys\nsys.path += ['x']",
    "import sys\nsys.path.append('x')",
    "from sys import path",
    "import site\nsite.addsitedir('x')",
  ],
)
def test_sys_path_edits_are_found(source):
  assert sys_path_edits(ast.parse(source))


def test_reading_sys_path_is_not_an_edit():
  assert not sys_path_edits(ast.parse("import sys, os\nprint(sys.path[0], os.path.join('a', 'b'))"))


def test_entry_points_run_main_with_sys_argv():
  """One convention: main(argv) takes sys.argv (the program name first); a script's `__main__` block is
  exactly `main(sys.argv)`."""
  odd = []
  for path in python_files(ROOT):
    if path in MAIN_PENDING:
      continue
    for node in parse(path).body:
      if isinstance(node, ast.If) and ast.unparse(node.test) == "__name__ == '__main__'":
        if [ast.unparse(s) for s in node.body] != ["main(sys.argv)"]:
          odd.append(f"{path}:{node.lineno}: {' / '.join(ast.unparse(s) for s in node.body)}")
  assert not odd, "__main__ blocks that are not `main(sys.argv)`:\n  " + "\n  ".join(odd)


def _devices_without_jax_platforms(code: str) -> subprocess.CompletedProcess:
  ours = ("JAX_PLATFORMS", "TPU_WORKER_HOSTNAMES", "TPU_ACCELERATOR_TYPE")  # what importing MaxText here set
  env = {k: v for k, v in os.environ.items() if k not in ours}
  return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed")
@pytest.mark.skipif(MaxText._accelerator_present(), reason="this machine has an accelerator: JAX picks it")
@pytest.mark.parametrize("order", ["import MaxText, jax", "import jax, MaxText"])
def test_no_libtpu_noise_on_a_machine_without_accelerators(order):
  """libtpu installed, no TPU/GPU here: importing MaxText picks the CPU before libtpu can print its TPU_WORKER_HOSTNAMES
  errors, whichever of jax and MaxText comes first; JAX on its own prints them (the reason for the fix)."""
  ours = _devices_without_jax_platforms(f"{order}; print(jax.devices()[0].platform)")
  assert ours.returncode == 0, ours.stderr
  assert ours.stdout.strip() == "cpu"
  assert "TPU_WORKER_HOSTNAMES" not in ours.stderr and "E0000" not in ours.stderr, ours.stderr
  bare = _devices_without_jax_platforms("import jax; print(jax.devices()[0].platform)")
  assert "TPU_WORKER_HOSTNAMES" in bare.stderr


def test_an_explicit_jax_platforms_is_left_alone():
  env = {**os.environ, "JAX_PLATFORMS": ""}
  code = "import os, MaxText; print(repr(os.environ['JAX_PLATFORMS']))"
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
  assert out.stdout.strip() == "''", out.stderr
