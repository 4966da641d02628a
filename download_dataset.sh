#!/usr/bin/env bash
# Fetch C4 (TFDS format) into a GCS bucket or a local directory, or prepare local text for grain.
#
#   bash download_dataset.sh PROJECT BUCKET        # gs://allennlp-tensorflow-datasets/c4/en/3.0.1 -> gs://BUCKET/c4/en/3.0.1
#     (as MaxText's; PROJECT is billed for the requester-pays copy)
#   bash download_dataset.sh PROJECT --local DIR   # the same into DIR/c4/en/3.0.1 (about 800 GB)
#   bash download_dataset.sh --text 'GLOB' DIR     # local .txt/.jsonl/.parquet -> DIR/data-*.array_record (grain)
#
# The C4 copy is TFDS TFRecord. dataset_type=tfds reads TFDS datasets in array_record format without
# TensorFlow; set ARRAY_RECORD=1 to convert the copy (needs `pip install tensorflow`), then train with
#   dataset_type=tfds dataset_path=<DIR or gs://BUCKET>/array_record dataset_name=c4/en:3.0.1
# For --text, SHARDS (default 8) sets the number of files and TEXT_COLUMN (default text) the jsonl/parquet field.
# C4_SOURCE overrides the source directory (local or gs://). COPY=python copies through MaxText.paths (gcsfs,
# requester-pays billed to PROJECT) instead of gsutil; it is used anyway when gsutil is not installed.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON="${PYTHON:-python3}"
SOURCE="${C4_SOURCE:-gs://allennlp-tensorflow-datasets/c4/en/3.0.1}"
COPY="${COPY:-gsutil}"

usage() { sed -n '4,7p' "$0" | sed 's/^# *//' >&2; exit 2; }
case "${1:-}" in -h|--help) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;; esac

copy_c4() {  # $1: target directory; the files of SOURCE into it
  if [ "$COPY" = gsutil ] && command -v gsutil >/dev/null; then
    gsutil -u "$PROJECT" -m cp -r "$SOURCE/*" "$1"
  else
    FSSPEC_GCS_REQUESTER_PAYS="$PROJECT" "$PYTHON" -m MaxText.paths copy "$SOURCE" "$1"
  fi
}

convert_c4() {  # $1: root holding c4/en/3.0.1
  [ "${ARRAY_RECORD:-0}" = "1" ] || return 0
  "$PYTHON" -m tensorflow_datasets.scripts.cli.main convert_format --dataset_version_dir="$1/c4/en/3.0.1" \
    --out_file_format=array_record --out_dir="$1/array_record/c4/en/3.0.1"
}

if [ "${1:-}" = "--text" ]; then
  [ $# -eq 3 ] || usage
  exec "$PYTHON" -m MaxText.data.convert_to_arrayrecord --files "$2" --output_dir "$3" \
    --num_shards "${SHARDS:-8}" --text_column "${TEXT_COLUMN:-text}"
fi
[ $# -ge 2 ] || usage
PROJECT="$1"
if [ "$2" = "--local" ]; then
  [ $# -eq 3 ] || usage
  DIR="${3%/}"
  mkdir -p "$DIR/c4/en/3.0.1"
  copy_c4 "$DIR/c4/en/3.0.1"
  convert_c4 "$DIR"
  echo "C4 in $DIR/c4/en/3.0.1 (array_record copy, with ARRAY_RECORD=1: $DIR/array_record/c4/en/3.0.1)"
else
  BUCKET="${2#gs://}"
  BUCKET="${BUCKET%/}"
  copy_c4 "gs://$BUCKET/c4/en/3.0.1"
  convert_c4 "gs://$BUCKET"
  echo "C4 in gs://$BUCKET/c4/en/3.0.1"
fi
