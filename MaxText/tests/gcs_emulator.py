"""A local GCS emulator for the tests (gcp-storage-emulator), serving gs:// to gcsfs/epath, google-cloud-storage,
tensorstore (hence orbax) and array_record's GCS client (grain, tfds):
`python3 MaxText/tests/gcs_emulator.py PORT BUCKET [BUCKET ...]`; prints "ready" once it
serves. Point the clients at it with gcs_env(port) (docs/cloud_storage.md).

The emulator's media download omits the x-goog-generation header that tensorstore reads for every object
(its conditional writes, which orbax's OCDBT manifest relies on, need it: without it every checkpoint
write fails with "Malformed StorageGeneration"); we add it here, before the server module binds its routes.
"""

import sys
import time


def gcs_env(port: int) -> dict[str, str]:
  """The environment variables that point every client MaxText uses at the emulator on 127.0.0.1:`port`."""
  url = f"http://127.0.0.1:{port}"
  return {
    "STORAGE_EMULATOR_HOST": url,  # gcsfs (epath), google-cloud-storage (TensorBoard's writer)
    "TENSORSTORE_GCS_HTTP_URL": url,  # tensorstore (orbax checkpoints)
    "CLOUD_STORAGE_EMULATOR_ENDPOINT": url,  # google-cloud-cpp inside array_record (grain, tfds)
    "GOOGLE_CLOUD_PROJECT": "test",
  }


def _patch_download_headers() -> None:
  from gcp_storage_emulator.handlers import objects

  original = objects.download

  def download(request, response, storage, *args, **kwargs):
    try:
      obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
      response["x-goog-generation"] = str(obj["generation"])
      response["x-goog-metageneration"] = str(obj.get("metageneration", 1))
    except Exception:  # a missing object: the original handler answers 404
      pass
    return original(request, response, storage, *args, **kwargs)

  objects.download = download


def main(argv: list[str]) -> None:
  """argv: sys.argv (the program name first): PORT [BUCKET ...]."""
  port, buckets = int(argv[1]), argv[2:]
  _patch_download_headers()
  from gcp_storage_emulator import server

  emulator = server.create_server("127.0.0.1", port, in_memory=True, default_bucket=buckets[0] if buckets else None)
  emulator.start()
  for name in buckets[1:]:
    emulator._api._storage.create_bucket(name, {})  # noqa: SLF001 (no public call; the storage is in-memory)
  print("ready", flush=True)
  while True:
    time.sleep(3600)


if __name__ == "__main__":
  main(sys.argv)
