"""MaxText/paths.py: the one module that tells a gs:// path from a local one. The helpers that hide it, on local
paths (gcs_test.py and gcs_inputs_test.py run them against a bucket)."""

import os

import pytest

from MaxText import paths


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
