"""Exit non-zero unless two Hugging Face model directories hold the same tensors, by name, shape and dtype.

The walk-throughs check their export against the model they converted from without torch:
  python3 end_to_end/cpu/same_tensors.py ORIGINAL_DIR EXPORTED_DIR
"""

import glob
import sys

from safetensors import safe_open


def tensors(directory: str) -> dict:
  """{name: (shape, dtype)} over every *.safetensors file of `directory`."""
  out = {}
  for path in glob.glob(f"{directory}/*.safetensors"):
    with safe_open(path, "np") as f:
      out |= {name: (f.get_slice(name).get_shape(), f.get_slice(name).get_dtype()) for name in f.keys()}
  return out


def main(argv: list[str]) -> None:
  """argv: the program name, ORIGINAL_DIR, EXPORTED_DIR."""
  original, exported = argv[1:3]
  if tensors(original) != tensors(exported):
    sys.exit(f"the export's tensors differ from the model's: {exported} against {original}")
  print(f"export: the {len(tensors(exported))} tensors of {original}, by name, shape and dtype")


if __name__ == "__main__":
  main(sys.argv)
