"""Google Cloud credentials for gs:// paths (paths.with_timeout asks before a path's first touch): looked up
once per process within CREDENTIALS_TIMEOUT_S, else one line saying what to set. Without the check gcsfs
falls back to anonymous access and each storage call retries for minutes."""

from __future__ import annotations

import os
import threading

from MaxText.errors import StorageError

# The credential lookup (a key file, gcloud's file, then the GCE metadata server) answers in about a second;
# past this long the metadata server is unreachable and there are no credentials to find.
CREDENTIALS_TIMEOUT_S = 10.0
CREDENTIALS_HELP = (
  "run `gcloud auth application-default login`, or set GOOGLE_APPLICATION_CREDENTIALS to a service-account key "
  "file (FSSPEC_GCS_TOKEN=anon reads public buckets without credentials)"
)
_credentials_found = False  # once Application Default Credentials were found, a process does not look again


def check_credentials(what: str) -> None:
  """StorageError naming `what` and what to set unless Google Cloud credentials can be found, within
  CREDENTIALS_TIMEOUT_S. Skipped for an emulator (STORAGE_EMULATOR_HOST) and for anonymous access asked for
  (FSSPEC_GCS_TOKEN=anon, read by gcsfs)."""
  global _credentials_found
  if _credentials_found or os.environ.get("STORAGE_EMULATOR_HOST") or os.environ.get("FSSPEC_GCS_TOKEN") == "anon":
    return
  import google.auth  # noqa: PLC0415 (gcsfs's dependency; only gs:// paths need it)

  answer: list[BaseException | None] = []

  def lookup() -> None:
    try:
      google.auth.default()
      answer.append(None)
    except Exception as e:  # DefaultCredentialsError, or a malformed key file's ValueError / TransportError
      answer.append(e)

  thread = threading.Thread(target=lookup, daemon=True)
  thread.start()
  thread.join(CREDENTIALS_TIMEOUT_S)
  if not answer:
    raise StorageError(
      f"{what}: no Google Cloud credentials found within {CREDENTIALS_TIMEOUT_S:g} s; {CREDENTIALS_HELP}"
    )
  if answer[0] is not None:
    reason = (str(answer[0]).strip().splitlines() or [type(answer[0]).__name__])[0][:200]
    raise StorageError(f"{what}: no usable Google Cloud credentials ({reason}); {CREDENTIALS_HELP}")
  _credentials_found = True
