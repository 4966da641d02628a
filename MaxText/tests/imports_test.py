"""How MaxText is imported: the user-error types only from MaxText/errors.py, no file edits sys.path, every
entry point runs main(sys.argv), no libtpu noise without accelerators. The import graph (no cycles) is
structure_test.py's.
"""

import ast
import importlib.util
import os
import subprocess
import sys

import pytest

import MaxText
from MaxText.tests.conftest import ROOT

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


def parse(path: str) -> ast.Module:
  with open(os.path.join(ROOT, path)) as f:
    return ast.parse(f.read(), path)


@pytest.mark.quick
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


@pytest.mark.quick
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


@pytest.mark.quick
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


@pytest.mark.parametrize("script", ["train.py", "decode.py", "train_compile.py"])
def test_an_incomplete_install_is_one_line_that_says_what_to_run(tmp_path, script):
  """`python3 MaxText/train.py` with the package not installed, or with its requirements missing (python -S: no
  site-packages), says what installs them instead of a bare ModuleNotFoundError."""
  path = os.path.join(ROOT, "MaxText", script)
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  no_package = subprocess.run([sys.executable, "-S", path], cwd=tmp_path, env=env, capture_output=True, text=True)
  assert no_package.returncode == 1 and "Traceback" not in no_package.stderr
  assert (
    no_package.stderr
    == "No module named 'MaxText': run `bash setup.sh` (or `pip install -e .` in this environment) first\n"
  )
  no_requirements = subprocess.run(
    [sys.executable, "-S", path], cwd=tmp_path, env={**env, "PYTHONPATH": ROOT}, capture_output=True, text=True
  )
  assert no_requirements.returncode == 1 and len(no_requirements.stderr.splitlines()) == 1
  assert "requirements are not installed (no module 'numpy'" in no_requirements.stderr
  assert "run `bash setup.sh`" in no_requirements.stderr


def test_a_missing_torch_extra_is_one_line_naming_the_setup(monkeypatch):
  """torch/transformers (the live Hugging Face comparisons) are the TORCH=1 extras."""
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a))
  with pytest.raises(SystemExit, match=r"^generating needs torch, which `TORCH=1 bash setup.sh` installs"):
    MaxText.require_torch("generating", ("torch",))
  MaxText.require_torch("this test", ("numpy",))  # present: nothing happens
