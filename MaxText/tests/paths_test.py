"""MaxText/paths.py: the one module that tells a gs:// path from a local one. The helpers that hide it, on local
paths (gcs_test.py and gcs_inputs_test.py run them against a bucket), and a scan of the package that fails
when another module tests a path for the gs:// prefix itself."""

import ast
import os
import pathlib

import pytest

from MaxText import paths

PACKAGE = pathlib.Path(paths.__file__).parent
# Methods and functions whose string argument, when it is a gs:// prefix, makes the call a test of the scheme.
STRING_TESTS = {"startswith", "endswith", "removeprefix", "find", "rfind", "index", "count", "partition", "split"}
REGEX_TESTS = {"match", "fullmatch", "search", "compile"}
# Modules owned by other reworks (metrics writers, entry-point checks) that still ask paths.is_remote; they
# never test the prefix themselves. Remove a name once its module calls a paths helper instead.
IS_REMOTE_ALLOWED: set[str] = set()


def _names_scheme(node: ast.AST) -> bool:
  """Whether `node` is a string constant (or a tuple of them) that names the gs:// scheme."""
  if isinstance(node, ast.Tuple | ast.List | ast.Set):
    return any(_names_scheme(e) for e in node.elts)
  return isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("gs:")


def scheme_tests(source: str, filename: str = "<source>") -> list[str]:
  """'line: what' for each place in `source` that tells paths apart by their gs:// prefix: a string method or
  regex given the prefix, a comparison with it, or a use of paths.is_remote / REMOTE_PREFIXES. A message or
  help text that mentions gs:// is none of these."""
  found = []
  for node in ast.walk(ast.parse(source, filename)):
    if isinstance(node, ast.Call):
      name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
      args = [*node.args, *(k.value for k in node.keywords)]
      if name in STRING_TESTS | REGEX_TESTS and any(_names_scheme(a) for a in args):
        found.append(f"{node.lineno}: {name}() of a gs:// prefix")
    elif isinstance(node, ast.Compare) and any(_names_scheme(n) for n in [node.left, *node.comparators]):
      found.append(f"{node.lineno}: comparison with a gs:// prefix")
    elif isinstance(node, ast.Attribute | ast.Name):
      name = node.attr if isinstance(node, ast.Attribute) else node.id
      if name in ("is_remote", "REMOTE_PREFIXES"):
        found.append(f"{node.lineno}: {name}")
  return found


def test_no_module_but_paths_tells_gs_paths_apart():
  offences = []
  for file in sorted(PACKAGE.rglob("*.py")):
    rel = file.relative_to(PACKAGE).as_posix()
    if rel == "paths.py" or rel.startswith("tests/"):
      continue
    for line in scheme_tests(file.read_text(), str(file)):
      if rel in IS_REMOTE_ALLOWED and line.endswith(": is_remote"):
        continue
      offences.append(f"MaxText/{rel}:{line}")
  assert not offences, "test the path through a MaxText.paths helper instead:\n" + "\n".join(offences)


@pytest.mark.parametrize(
  "source",
  [
    "if path.startswith('gs://'): pass",
    "ok = not p.startswith(('gs://', 's3://'))",
    "remote = 'gs://' in path",
    "remote = path[:5] == 'gs://'",
    "remote = re.match(r'gs://', path)",
    "remote = paths.is_remote(path)",
    "prefixes = paths.REMOTE_PREFIXES",
  ],
)
def test_the_scan_finds_prefix_tests(source):
  assert scheme_tests(source)


@pytest.mark.parametrize(
  "source",
  [
    "parser.add_argument('--files', help='glob of input files, local or gs://')",
    "raise DataError(f'put it on a shared filesystem (or a gs:// bucket), not {path!r}')",
    "name = 'gs://bucket'.upper()",
  ],
)
def test_the_scan_lets_messages_mention_gs(source):
  assert not scheme_tests(source)


def test_glob_and_glob_root_of_local_patterns(tmp_path):
  for name in ("a/1.txt", "a/b/2.txt", "c.json"):
    (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / name).write_text("x")
  assert paths.glob(f"{tmp_path}/**/*.txt") == [f"{tmp_path}/a/1.txt", f"{tmp_path}/a/b/2.txt"]
  assert paths.glob(f"{tmp_path}/a") == []  # a directory is no file
  assert paths.glob(f"{tmp_path}/nothing-*") == []
  assert paths.glob_root(f"{tmp_path}/a/**/*.txt") == f"{tmp_path}/a"
  assert paths.glob_root(f"{tmp_path}/c.json") == str(tmp_path)
  assert paths.glob_root("gs://b/docs/*/x.txt") == "gs://b/docs"
  assert paths.glob_root("gs://b/docs/x.txt") == "gs://b/docs"


def test_local_probes_keep_os_semantics(tmp_path):
  file = tmp_path / "f"
  file.write_text("x")
  assert paths.probe(str(file), file.read_text, "never used") == "x"
  with pytest.raises(FileNotFoundError):  # a local error is the OS's own, not a StorageError
    paths.probe(str(tmp_path / "none"), (tmp_path / "none").read_text, "never used")
  assert paths.probe_exists(str(file), "") and paths.probe_isfile(str(file), "")
  assert not paths.probe_isdir(str(file), "")
  assert paths.probe_isdir(str(tmp_path), "") and not paths.probe_exists(str(tmp_path / "none"), "")
  assert paths.may_exist(str(file)) and paths.may_exist("gs://b/never-probed") and not paths.may_exist(f"{file}x")
  assert paths.may_read(str(file)) and paths.may_read("gs://b/never-probed") and not paths.may_read(f"{file}x")
  stat = os.stat(file)
  assert paths.version_key(str(file)) == [stat.st_size, stat.st_mtime_ns]
  assert paths.path_or_file(str(file)) == str(file)


def test_publish_and_wait_published_on_a_local_directory(tmp_path):
  """A local directory stands for itself (local_dir_for): publishing its own files leaves them as they are, and
  a file is looked for once, not waited for."""
  directory = str(tmp_path / "tok")
  local = paths.local_dir_for(directory)
  assert local == directory
  os.makedirs(local)
  (tmp_path / "tok" / "m").write_text("x")
  (tmp_path / "other").write_text("y")
  paths.publish([os.path.join(local, "m"), str(tmp_path / "other")], directory)
  assert sorted(os.listdir(local)) == ["m", "other"] and (tmp_path / "tok" / "other").read_text() == "y"
  assert paths.wait_published(os.path.join(directory, "m"), 1000.0, "The file")
  assert not paths.wait_published(os.path.join(directory, "none"), 1000.0, "The file")


def test_write_atomic_replaces_whole_and_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
  target = tmp_path / "f.json"
  paths.write_atomic(str(target), "old")
  paths.write_atomic(str(target), "new")
  assert target.read_text() == "new" and os.listdir(tmp_path) == ["f.json"]

  def full_disk(*_):
    raise OSError(28, "No space left on device")

  monkeypatch.setattr(paths.os, "replace", full_disk)
  with pytest.raises(OSError, match="No space left"):
    paths.write_atomic(str(target), "lost")
  assert target.read_text() == "new" and os.listdir(tmp_path) == ["f.json"]
