"""User paths, local or gs://: the one place MaxText decides how a path a user gave is read or written.

Every path a user gives (outputs, checkpoints, data, tokenizers, converter inputs and outputs) goes
through etils `epath`, the path type orbax, grain and tfds use; for gs:// it reaches the bucket through
gcsfs (fsspec), and orbax's array data through tensorstore. Pointing both at a GCS emulator takes two
environment variables (docs/cloud_storage.md): STORAGE_EMULATOR_HOST (gcsfs, google-cloud-storage,
TensorBoard's writer) and TENSORSTORE_GCS_HTTP_URL (tensorstore).

Local paths keep plain `os` semantics (absolute paths, `~` expansion), so local runs behave as before.
"""

from __future__ import annotations

import contextlib
import glob as pyglob
import hashlib
import itertools
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from etils import epath

from MaxText import gcs_auth
from MaxText.errors import ConfigError, StorageError

REMOTE_PREFIXES = ("gs://",)  # paths that name objects in a bucket, never a local file
# Without network or credentials the storage clients retry for minutes; a probe that has no answer in this
# long fails with one line naming the path instead.
PROBE_TIMEOUT_S = 30.0
MIRROR_SYNC_S = 30.0  # a remote append-only file (metrics.jsonl) is re-uploaded at most this often, and at close


# gcsfs asks each bucket for its (hierarchical namespace) type through a client that wants default
# credentials, and logs a warning for every path when it cannot: noise, the plain API is used either way.
logging.getLogger("gcsfs").setLevel(logging.ERROR)


def is_remote(path: str | os.PathLike | None) -> bool:
  """Whether `path` names an object store location (gs://...) rather than a local file."""
  return bool(path) and os.fspath(path).startswith(REMOTE_PREFIXES)


def absolute(path: str) -> str:
  """`path` as an absolute string: local paths through os.path.abspath (after `~`), remote ones unchanged
  (os.path.abspath would turn gs://b into ./gs:/b, a local directory)."""
  return path if is_remote(path) else os.path.abspath(os.path.expanduser(path))


def join(path: str, *parts: str) -> str:
  """`path`/`parts` as a string; keeps the gs:// scheme."""
  return os.fspath(epath.Path(path).joinpath(*parts)) if is_remote(path) else os.path.join(path, *parts)


def dirname(path: str) -> str:
  """The parent of `path` as a string; keeps the gs:// scheme."""
  return os.fspath(epath.Path(path).parent) if is_remote(path) else os.path.dirname(path)


def Path(path: str | os.PathLike) -> epath.Path:  # noqa: N802 (reads like the type it returns)
  """The epath of `path`; local paths made absolute first."""
  return epath.Path(absolute(os.fspath(path)))


def exists(path: str) -> bool:
  return Path(path).exists()


def isdir(path: str) -> bool:
  return Path(path).is_dir()


def isfile(path: str) -> bool:
  """Whether `path` is a file (a remote object)."""
  return Path(path).is_file()


def makedirs(path: str) -> None:
  """Create `path` and its parents (a no-op on a bucket, whose directories are prefixes)."""
  Path(path).mkdir(parents=True, exist_ok=True)


def write_atomic(path: str, text: str) -> None:
  """Replace the file at `path` with `text` so that a reader (or a kill -9 mid-write) sees the old file or the
  new one, never part of one: locally a temporary file renamed over it; an object store's upload is atomic."""
  if is_remote(path):
    Path(path).write_text(text)
    return
  tmp = f"{path}.{os.getpid()}.tmp"
  try:
    with open(tmp, "w") as f:
      f.write(text)
    os.replace(tmp, path)
  except BaseException:  # a full disk, an interrupt: no half-written temporary file is left beside `path`
    with contextlib.suppress(OSError):
      os.remove(tmp)
    raise


def listdir(path: str) -> list[str]:
  """The names directly under `path`; [] when it does not exist."""
  root = Path(path)
  return sorted(p.name for p in root.iterdir()) if root.is_dir() else []


def bucket_of(path: str) -> str:
  """gs://bucket of a remote path."""
  return "/".join(path.split("/")[:3])


def with_timeout[T](fn: Callable[[], T], what: str, timeout_s: float | None = None) -> T:
  """fn() run in a daemon thread; StorageError naming `what` when it raises or has no answer in timeout_s
  (PROBE_TIMEOUT_S). For the first touch of a path, where a missing network or credentials would otherwise
  retry for minutes. `what` names the path; when that is a gs:// one, credentials are checked first
  (gcs_auth.check_credentials), since their absence otherwise shows only as the timeout."""
  timeout_s = PROBE_TIMEOUT_S if timeout_s is None else timeout_s
  if any(prefix in what for prefix in REMOTE_PREFIXES):
    gcs_auth.check_credentials(what)
  answer: list[Any] = []

  def call() -> None:
    try:
      answer.append((True, fn()))
    except Exception as e:  # the storage clients raise their own types (auth, DNS, HTTP)
      answer.append((False, e))

  thread = threading.Thread(target=call, daemon=True)  # daemon: a stuck client does not hold up the exit
  thread.start()
  thread.join(timeout_s)
  if not answer:
    raise StorageError(
      f"{what}: no answer from storage within {timeout_s:g} s; check network access and credentials "
      "(gcloud auth application-default login) or use a local path"
    )
  ok, value = answer[0]
  if not ok:
    reason = (str(value).strip().splitlines() or [""])[0][:300]
    raise StorageError(f"{what}: {type(value).__name__}: {reason}; check the path, the bucket and credentials")
  return value


def probe[T](path: str, fn: Callable[[], T], what: str, timeout_s: float | None = None) -> T:
  """fn(), the first touch of `path`: for a remote path through with_timeout (StorageError naming `what` when
  storage has no answer or fails), for a local one called directly (its errors the OS's own)."""
  return with_timeout(fn, what, timeout_s) if is_remote(path) else fn()


def probe_exists(path: str, what: str) -> bool:
  """Whether `path` exists: probe()d when remote; os.path.exists of the path as given when local."""
  return probe(path, lambda: exists(path), what) if is_remote(path) else os.path.exists(path)


def probe_isfile(path: str, what: str) -> bool:
  """Whether `path` is a file: probe()d when remote; os.path.isfile of the path as given when local."""
  return probe(path, lambda: isfile(path), what) if is_remote(path) else os.path.isfile(path)


def probe_isdir(path: str, what: str) -> bool:
  """Whether `path` is a directory: probe()d when remote; os.path.isdir of the path as given when local."""
  return probe(path, lambda: isdir(path), what) if is_remote(path) else os.path.isdir(path)


def may_exist(path: str) -> bool:
  """False only for a local `path` that does not exist. A remote one is not probed (config validation makes
  no network calls; its reader or restore reports a missing object)."""
  return is_remote(path) or os.path.exists(path)


def may_read(path: str) -> bool:
  """False only for a local `path` this process cannot read (os.access). A remote one is not probed (its
  reader reports it)."""
  return is_remote(path) or os.access(path, os.R_OK)


def version_key(path: str) -> list[Any]:
  """[size, modification time] of the file `path`, for cache keys: a local file's st_size and st_mtime_ns; an
  object's length and its time as a string (an object's generation changes with every rewrite, as a file's
  mtime does)."""
  if is_remote(path):
    stat = Path(path).stat()
    return [stat.length, str(stat.mtime)]
  stat = os.stat(path)
  return [stat.st_size, stat.st_mtime_ns]


def path_or_file(path: str) -> Any:
  """What a reader taking a local path or a binary file object (pyarrow) gets: a local `path` itself (the
  reader's own file access), a remote one opened through epath (range reads through gcsfs), since pyarrow's
  own GCS client takes neither gcsfs's credentials nor the emulator's environment variable."""
  return Path(path).open("rb") if is_remote(path) else path


def check_writable(path: str, key: str, timeout_s: float | None = None) -> None:
  """StorageError naming `key` unless `path`'s bucket exists and takes a write, within timeout_s.

  Writes and deletes a small marker object under `path`: the one check that catches a missing bucket,
  missing credentials and a missing permission alike, before any device work."""
  marker = Path(path) / f".maxtext-write-check-{os.getpid()}"

  def probe() -> None:
    if not epath.Path(bucket_of(path)).exists():
      raise FileNotFoundError(f"bucket {bucket_of(path)} does not exist")
    marker.write_text("ok")
    marker.unlink()

  with_timeout(probe, f"{key}={path!r}", timeout_s)


def is_local_file(path: str) -> bool:
  """Whether `path` is a local file (never true for gs://)."""
  return bool(path) and not is_remote(path) and os.path.isfile(path)


def is_local_dir(path: str) -> bool:
  """Whether `path` is an existing local directory (a gs:// path is not probed: False)."""
  return bool(path) and not is_remote(path) and os.path.isdir(path)


def local_or(path: str, stand_in: str) -> str:
  """`path` where it is local, else `stand_in` (a local directory for a writer that takes only local paths)."""
  return stand_in if is_remote(path) else path


def check_local(path: str, key: str, advice: str) -> None:
  """ConfigError naming `key` unless `path` is local (for writers, such as XLA's dump, that take no gs://)."""
  if is_remote(path):
    raise ConfigError(f"{key}: {path!r} is not a local directory; {advice}")


def checked_remote_output(path: str, key: str, is_writer: Callable[[], bool]) -> bool:
  """For a gs:// output directory: check_writable on the writer process (is_writer()) and True; False for a
  local path, whose checks are the caller's."""
  if not is_remote(path):
    return False
  if is_writer():
    check_writable(path, key)
  return True


def download(path: str) -> str:
  """A local copy of the remote file `path` (a temporary file) for readers that take only local files."""
  fd, local = tempfile.mkstemp(suffix="-" + os.path.basename(path))
  with os.fdopen(fd, "wb") as f:
    f.write(Path(path).read_bytes())
  return local


class AppendFile:
  """An append-only text file at a local or remote path: local ones are appended to directly; remote ones
  (object stores cannot append) are kept in a local temporary copy, seeded with the object's current text
  so a resumed run appends, and uploaded whole at most every MIRROR_SYNC_S seconds and at close."""

  def __init__(self, path: str, sync_s: float = MIRROR_SYNC_S):
    self.path, self._sync_s, self._synced = path, sync_s, 0.0
    if not is_remote(path):
      os.makedirs(os.path.dirname(absolute(path)), exist_ok=True)
      self._file = open(path, "a")
      return
    fd, self._local = tempfile.mkstemp(suffix="-" + os.path.basename(path))
    remote = Path(path)
    with os.fdopen(fd, "w") as f:
      f.write(remote.read_text() if remote.exists() else "")
    self._file = open(self._local, "a")

  def write(self, text: str) -> None:
    self._file.write(text)

  def flush(self, force: bool = False) -> None:
    self._file.flush()
    if is_remote(self.path) and (force or time.monotonic() - self._synced >= self._sync_s):
      Path(self.path).write_bytes(epath.Path(self._local).read_bytes())
      self._synced = time.monotonic()

  def close(self) -> None:
    if self._file.closed:
      return
    self.flush(force=True)
    self._file.close()
    if is_remote(self.path):
      os.unlink(self._local)


def local_dir_for(path: str) -> str:
  """A local directory standing for `path`: `path` itself when local; for a remote directory a fixed one
  under the system temporary directory (the same on every run, so its files serve as a cache)."""
  if not is_remote(path):
    return absolute(path)
  digest = hashlib.sha256(path.encode()).hexdigest()[:16]
  return os.path.join(tempfile.gettempdir(), "maxtext-gcs-cache", digest)


def local_copy(path: str) -> str:
  """A local file (or directory of files) with the contents of `path`: `path` itself when local; for a
  remote one a copy in local_dir_for(its parent), fetched unless a copy of the same size is there. For the
  libraries that open only local files (sentencepiece, tiktoken, tokenizers, numpy memory maps)."""
  if not is_remote(path):
    return path
  source = Path(path)
  target = os.path.join(local_dir_for(dirname(path)), source.name)
  if source.is_dir():  # its files (a Hugging Face model or tokenizer directory), not its subdirectories
    items = [(p, os.path.join(target, p.name)) for p in source.iterdir() if p.is_file()]
  else:
    items = [(source, target)]
  for remote, local in items:
    data = remote.read_bytes()
    if os.path.isfile(local) and os.path.getsize(local) == len(data):
      continue
    os.makedirs(os.path.dirname(local), exist_ok=True)
    tmp = f"{local}.{os.getpid()}.tmp"  # processes of one host may fetch the same file at once
    with open(tmp, "wb") as f:
      f.write(data)
    os.replace(tmp, local)
  return target


def publish(local_files: list[str], directory: str) -> None:
  """Copy `local_files` into `directory`, in order (the last one marks the set complete: readers wait for it).
  A file already in place (written into local_dir_for(directory) of a local directory, which is the directory
  itself) is left as it is."""
  for local in local_files:
    target = join(directory, os.path.basename(local))
    if not is_remote(target) and absolute(target) == os.path.abspath(local):
      continue
    Path(target).write_bytes(epath.Path(local).read_bytes())


def publish_tree(local_dir: str, remote_dir: str) -> None:
  """Copy every file under `local_dir` to the same relative path under `remote_dir`."""
  for root, _, names in os.walk(local_dir):
    for name in names:
      rel = os.path.relpath(os.path.join(root, name), local_dir)
      Path(join(remote_dir, *rel.split(os.sep))).write_bytes(epath.Path(root, name).read_bytes())


@contextlib.contextmanager
def local_output_dir(path: str, key: str, replace: tuple[str, ...] = ()) -> Iterator[str]:
  """A local directory to write the files of the output directory `path` (the option `key`) into, for writers
  of local files only: `path` itself when local; for a remote one (checked writable first) a
  temporary directory whose files are uploaded to `path` when the block ends without an error, then removed
  (so it needs local disk for all of them). `replace`: subdirectories of `path` written whole, removed from a
  remote `path` before the upload so that no file of an earlier upload remains (a local writer replaces
  its own)."""
  if not is_remote(path):
    yield path
    return
  check_writable(path, key)
  staging = tempfile.mkdtemp(prefix="maxtext-staging-")
  try:
    yield staging
    for name in replace:
      stale = Path(join(path, name))
      if stale.exists():
        stale.rmtree()
    publish_tree(staging, path)
  finally:
    shutil.rmtree(staging, ignore_errors=True)


def files_under(root: str) -> list[str]:
  """The '/'-separated paths, relative to the directory `root` (local or remote), of every file below it."""

  def walk(directory: epath.Path, prefix: str) -> Iterator[str]:
    for child in sorted(directory.iterdir(), key=lambda p: p.name):
      if child.is_dir():
        yield from walk(child, f"{prefix}{child.name}/")
      else:
        yield prefix + child.name

  return list(walk(Path(root), ""))


def _fixed_parts(pattern: str, sep: str) -> tuple[list[str], list[str]]:
  """(the parts of `pattern` before its first wildcard, all its parts), split at `sep`."""
  parts = pattern.split(sep)
  return list(itertools.takewhile(lambda part: not any(c in part for c in "*?["), parts)), parts


def glob(pattern: str, timeout_s: float | None = None) -> list[str]:
  """Sorted files matching `pattern` (`**` recurses); may be empty. A local pattern after `~` expansion,
  directories left out; a remote one is listed (its wildcards only after the fixed directories) within
  timeout_s (PROBE_TIMEOUT_S), StorageError naming it otherwise; a remote name without wildcards is checked to
  exist."""
  if not is_remote(pattern):
    return sorted(p for p in pyglob.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(p))
  fixed, parts = _fixed_parts(pattern, "/")
  if len(fixed) == len(parts):
    found = with_timeout(lambda: epath.Path(pattern).exists(), f"Cannot list {pattern!r}", timeout_s)
    return [pattern] if found else []
  root, rest = epath.Path("/".join(fixed)), "/".join(parts[len(fixed) :])
  return with_timeout(lambda: sorted(str(p) for p in root.glob(rest)), repr(pattern), timeout_s)


def glob_root(pattern: str) -> str:
  """Absolute directory above the first wildcard of `pattern` (its parent directory when it has none)."""
  if is_remote(pattern):
    fixed, parts = _fixed_parts(pattern, "/")
    return "/".join(fixed) if len(fixed) < len(parts) else dirname(pattern)
  fixed, parts = _fixed_parts(pattern, os.sep)
  root = os.sep.join(fixed) if len(fixed) < len(parts) else os.path.dirname(pattern)
  return os.path.abspath(root or ".")


def wait_published(path: str, timeout_s: float, what: str) -> bool:
  """Whether the file `path`, which process 0 wrote (publish), can be read here. A remote one is waited for
  (wait_for: StorageError naming `what` after timeout_s); a local one is looked at once, since a directory
  this host does not share with process 0 never shows it."""
  if is_remote(path):
    wait_for(path, timeout_s, what)
    return True
  return os.path.isfile(path)


def copy_tree(source: str, target: str) -> list[str]:
  """Copy every file under the directory `source` to the same relative path under `target` (each local or
  remote), streaming each file; returns the relative paths copied. StorageError naming `source` when it is
  not a directory (checked within PROBE_TIMEOUT_S)."""
  if not with_timeout(lambda: isdir(source), f"{source!r}"):
    raise StorageError(f"{source!r} is not a directory")
  names = files_under(source)
  for name in names:
    destination = Path(join(target, *name.split("/")))
    if not is_remote(target):
      destination.parent.mkdir(parents=True, exist_ok=True)
    with Path(join(source, *name.split("/"))).open("rb") as src, destination.open("wb") as dst:
      shutil.copyfileobj(src, dst, 16 << 20)
  return names


def main(argv: list[str]) -> None:
  """`python3 -m MaxText.paths copy SOURCE TARGET` (argv: sys.argv): copy_tree, for download_dataset.sh where
  gsutil is missing (gcsfs's settings come from FSSPEC_GCS_* variables, e.g. FSSPEC_GCS_REQUESTER_PAYS=PROJECT)."""
  args = argv[1:]
  if len(args) != 3 or args[0] != "copy":
    print("usage: python3 -m MaxText.paths copy SOURCE_DIR TARGET_DIR (each local or gs://)", file=sys.stderr)
    sys.exit(2)
  try:
    names = copy_tree(args[1], args[2])
  except (StorageError, OSError) as e:
    print(f"Storage error: {(str(e).splitlines() or [type(e).__name__])[0]}", file=sys.stderr)
    sys.exit(1)
  print(f"copied {len(names)} files from {args[1]} to {args[2]}")


def wait_for(path: str, timeout_s: float, what: str, poll_s: float = 1.0) -> None:
  """Return once `path` exists; StorageError naming `what` and `path` after timeout_s seconds."""
  deadline = time.monotonic() + timeout_s
  while not exists(path):
    if time.monotonic() > deadline:
      raise StorageError(
        f"{what} {path!r} did not appear within {timeout_s:g} s; process 0 writes it: check its log, or that every "
        "process sees the same base_output_directory"
      )
    time.sleep(poll_s)


def writable_dir(path: str) -> tuple[str, DirMirror | None]:
  """A local directory a writer of local files can use for `path`: `path` itself when local, else a
  DirMirror's local directory, whose files reach `path` (returned too, to close)."""
  if not is_remote(path):
    return path, None
  mirror = DirMirror(path)
  return mirror.local, mirror


class DirMirror:
  """A fresh local directory whose files are copied to the remote directory `remote` (each file whose size
  changed) at most every MIRROR_SYNC_S seconds and at close; for writers that write only local files
  (TensorBoard's event writer talks to GCS itself, but re-uploads whole files and retries for minutes)."""

  def __init__(self, remote: str, sync_s: float = MIRROR_SYNC_S):
    self.remote, self._sync_s, self._synced = remote, sync_s, time.monotonic()
    self.local = tempfile.mkdtemp(prefix="maxtext-mirror-")
    self._sizes: dict[str, int] = {}

  def sync(self, force: bool = False) -> None:
    if not force and time.monotonic() - self._synced < self._sync_s:
      return
    changed = []
    for name in sorted(os.listdir(self.local)):
      size = os.path.getsize(os.path.join(self.local, name))
      if self._sizes.get(name) != size:
        changed.append(os.path.join(self.local, name))
        self._sizes[name] = size
    publish(changed, self.remote)
    self._synced = time.monotonic()

  def close(self) -> None:
    self.sync(force=True)
    shutil.rmtree(self.local, ignore_errors=True)


if __name__ == "__main__":
  main(sys.argv)
