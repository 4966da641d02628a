"""The shape of the source, measured with `ast` (nothing imported): the figures issue 38 set as done.

The source is MaxText/**/*.py outside MaxText/tests, plus the top-level *.py scripts. Measured: import cycles
(every import counts, those under `if TYPE_CHECKING:` and inside functions included), file lengths, function
lengths, where `use_dpo` is read, that rl.py (if it is still there) is a thin alias, and that test modules
share helpers through conftest.py or helpers.py, never by importing each other.
"""

import ast
import os

import pytest

from MaxText.tests.conftest import ROOT

pytestmark = pytest.mark.quick  # the whole module is in the quick tier

MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 60
MAX_LONG_FUNCTIONS = 2  # functions over MAX_FUNCTION_LINES
MAX_USE_DPO_READS = 1  # the alias of objective=dpo
RL_MAX_FUNCTION_LINES = 15  # rl.py, if kept, only forwards to the trainer


def source_files() -> list[str]:
  """Paths relative to ROOT: MaxText/**/*.py except MaxText/tests, and the top-level scripts."""
  found = sorted(f for f in os.listdir(ROOT) if f.endswith(".py"))
  for directory, dirs, files in os.walk(os.path.join(ROOT, "MaxText")):
    rel = os.path.relpath(directory, ROOT)
    dirs[:] = sorted(d for d in dirs if d != "__pycache__" and os.path.join(rel, d) != os.path.join("MaxText", "tests"))
    found += [os.path.join(rel, f) for f in sorted(files) if f.endswith(".py")]
  return found


def module_of(path: str) -> str:
  name = path[: -len(".py")].replace(os.sep, ".")
  return name[: -len(".__init__")] if name.endswith(".__init__") else name


def parse(path: str) -> ast.Module:
  with open(os.path.join(ROOT, path)) as f:
    return ast.parse(f.read(), path)


def imported(node: ast.Import | ast.ImportFrom, importer: str, is_package: bool, modules: set[str]) -> set[str]:
  """The modules of `modules` that an import statement in `importer` loads: `from pkg import name` is the
  module pkg.name when there is one, else pkg; a relative import is resolved against the importer."""
  if isinstance(node, ast.Import):
    return {a.name for a in node.names if a.name in modules}
  base = node.module or ""
  if node.level:
    parts = importer.split(".")[: len(importer.split(".")) - node.level + (1 if is_package else 0)]
    base = ".".join([*parts, base] if base else parts)
  found = set()
  for alias in node.names:
    if f"{base}.{alias.name}" in modules:
      found.add(f"{base}.{alias.name}")
    elif base in modules:
      found.add(base)
  return found


def import_nodes(tree: ast.AST, type_checking: bool) -> list[ast.Import | ast.ImportFrom]:
  """Every import statement, lazy ones inside functions too; those under `if TYPE_CHECKING:` if type_checking."""
  found = []
  for node in ast.iter_child_nodes(tree):
    if isinstance(node, ast.Import | ast.ImportFrom):
      found.append(node)
    elif not type_checking and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
      found += [n for child in node.orelse for n in import_nodes(ast.Module([child], []), type_checking)]
    else:
      found += import_nodes(node, type_checking)
  return found


def import_graph(files: list[str], type_checking: bool = True) -> dict[str, set[str]]:
  """module -> the modules it imports (lazy imports too; TYPE_CHECKING ones unless type_checking=False)."""
  modules = {module_of(f): f for f in files}
  graph = {}
  for name, path in modules.items():
    is_package = path.endswith("__init__.py")
    edges = set()
    for node in import_nodes(parse(path), type_checking):
      edges |= imported(node, name, is_package, set(modules))
    graph[name] = edges - {name}
  return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components of more than one module, each sorted (Tarjan's algorithm, iterative)."""
  index, low, on_stack, stack, components, counter = {}, {}, set(), [], [], [0]
  for root in sorted(graph):
    if root in index:
      continue
    work = [(root, iter(sorted(graph[root])))]
    index[root] = low[root] = counter[0]
    counter[0] += 1
    stack.append(root)
    on_stack.add(root)
    while work:
      node, children = work[-1]
      child = next(children, None)
      if child is not None:
        if child not in index:
          index[child] = low[child] = counter[0]
          counter[0] += 1
          stack.append(child)
          on_stack.add(child)
          work.append((child, iter(sorted(graph[child]))))
        elif child in on_stack:
          low[node] = min(low[node], index[child])
        continue
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
  return components


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """One cycle per strongly connected component: its modules in import order, the first repeated at the end."""
  return [a_cycle(graph, set(c)) for c in strongly_connected(graph)]


def a_cycle(graph: dict[str, set[str]], component: set[str]) -> list[str]:
  """The shortest path back to the first module of `component` (breadth first inside it)."""
  start = min(component)
  paths = {start: [start]}
  queue = [start]
  while queue:
    node = queue.pop(0)
    for child in sorted(graph[node] & component):
      if child == start:
        return [*paths[node], start]
      if child not in paths:
        paths[child] = [*paths[node], child]
        queue.append(child)
  return sorted(component)


def functions(tree: ast.AST) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
  return [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]


def length(node: ast.AST) -> int:
  return node.end_lineno - node.lineno + 1


def long_functions(files: list[str], limit: int) -> list[str]:
  return [
    f"{path}:{fn.lineno} {fn.name} ({length(fn)} lines)"
    for path in files
    for fn in functions(parse(path))
    if length(fn) > limit
  ]


def use_dpo_reads(tree: ast.AST) -> list[int]:
  """Lines that read use_dpo: an attribute `.use_dpo`, a subscript `[...]["use_dpo"]` or `.get("use_dpo")`."""
  lines = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Attribute) and node.attr == "use_dpo" and isinstance(node.ctx, ast.Load):
      lines.append(node.lineno)
    elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_use_dpo(node.slice):
      lines.append(node.lineno)
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
      if node.args and _is_use_dpo(node.args[0]):
        lines.append(node.lineno)
  return lines


def _is_use_dpo(node: ast.AST) -> bool:
  return isinstance(node, ast.Constant) and node.value == "use_dpo"


def cycle_report(graph: dict[str, set[str]]) -> list[str]:
  return [
    f"{len(c)} modules import each other ({', '.join(c)}); one cycle: {' -> '.join(a_cycle(graph, set(c)))}"
    for c in strongly_connected(graph)
  ]


def test_no_import_cycles_when_running():
  """The imports that run (a lazy one that closes a loop is still a cycle: config <-> config_checks was one)."""
  found = cycle_report(import_graph(source_files(), type_checking=False))
  assert not found, "import cycles:\n" + "\n".join(found)


def test_no_import_cycles_type_checking_included():
  graph = import_graph(source_files())
  found = cycle_report(graph)
  assert not found, "import cycles (TYPE_CHECKING imports count):\n" + "\n".join(found)


def test_the_cycle_finder_finds_and_prints_a_cycle():
  graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
  assert cycles(graph) == [["a", "b", "c", "a"]]


def test_errors_is_the_bottom_of_the_graph():
  """Any module can import the user-error types; errors.py imports nothing from MaxText."""
  assert import_graph(source_files())["MaxText.errors"] == set()


def test_type_checking_and_lazy_imports_are_edges():
  tree = ast.parse(
    "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n  from MaxText.parallel.plan import Plan\n"
    "def f():\n  from . import sibling\n  import MaxText.config\n"
  )
  modules = {"MaxText.parallel.plan", "MaxText.layers.sibling", "MaxText.config"}
  found = set().union(
    *(
      imported(n, "MaxText.layers.x", False, modules)
      for n in ast.walk(tree)
      if isinstance(n, ast.ImportFrom | ast.Import)
    )
  )
  assert found == modules
  running = set().union(*(imported(n, "MaxText.layers.x", False, modules) for n in import_nodes(tree, False)))
  assert running == {"MaxText.layers.sibling", "MaxText.config"}


def test_no_file_over_500_lines():
  long = [
    f"{path} ({n} lines)"
    for path in source_files()
    if (n := len(open(os.path.join(ROOT, path)).readlines())) > MAX_FILE_LINES
  ]
  assert not long, f"files over {MAX_FILE_LINES} lines:\n" + "\n".join(long)


def test_at_most_two_functions_over_60_lines():
  long = long_functions(source_files(), MAX_FUNCTION_LINES)
  assert len(long) <= MAX_LONG_FUNCTIONS, f"{len(long)} functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)


def test_use_dpo_is_read_in_one_place():
  reads = [f"{path}:{line}" for path in source_files() for line in sorted(use_dpo_reads(parse(path)))]
  assert len(reads) <= MAX_USE_DPO_READS, (
    f"use_dpo read in {len(reads)} places (objective=dpo is the key):\n" + "\n".join(reads)
  )


def test_the_use_dpo_finder_finds_reads():
  tree = ast.parse("a = c.use_dpo\nb = raw['use_dpo']\nd = raw.get('use_dpo', False)\nkeys = {'use_dpo': True}\n")
  assert use_dpo_reads(tree) == [1, 2, 3]


def test_rl_module_is_no_trainer_of_its_own():
  """rl.py, if kept (python3 -m MaxText.rl), forwards to the one trainer: no class, no function over 15 lines
  (no loop, step or metrics writer of its own)."""
  path = os.path.join("MaxText", "rl.py")
  if not os.path.exists(os.path.join(ROOT, path)):
    return
  tree = parse(path)
  classes = [f"{path}:{n.lineno} class {n.name}" for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
  long = long_functions([path], RL_MAX_FUNCTION_LINES)
  assert not classes and not long, "rl.py defines a trainer of its own:\n" + "\n".join(classes + long)


def test_test_modules_do_not_import_test_modules():
  """Shared test helpers live in conftest.py or helpers.py; a test module importing another runs its tests'
  module-level code and couples the two."""
  tests = os.path.join("MaxText", "tests")
  found = []
  for name in sorted(os.listdir(os.path.join(ROOT, tests))):
    if not name.endswith(".py"):
      continue
    for node in ast.walk(parse(os.path.join(tests, name))):
      targets = []
      if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom) and node.module:
        targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
      elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "MaxText.tests." in node.value:
        targets = [w.strip(";,") for w in node.value.split() if w.startswith("MaxText.tests.")]  # code in strings
      found += [
        f"{tests}/{name}:{node.lineno} {t}" for t in targets if t.startswith("MaxText.tests.") and t.endswith("_test")
      ]
  assert not found, "import shared helpers from MaxText/tests/helpers.py or conftest.py instead:\n" + "\n".join(found)
