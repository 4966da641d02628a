"""A tiny preference data set for DPO on CPU (docs/dpo.md, end_to_end/cpu/dpo.sh): "a+b=" prompts whose chosen
reply is the sum and whose rejected reply is a wrong digit.

    python3 end_to_end/cpu/make_prefs.py OUT.jsonl [MAX_TERM]

One {"prompt", "chosen", "rejected"} object per line: for a, b in 0..MAX_TERM (default 2) and each wrong digit w
(every digit but a + b), {"prompt": "a+b=", "chosen": "a+b", "rejected": "w"}.
"""

import json
import sys


def pairs(max_term: int) -> list[dict]:
  terms = range(max_term + 1)
  return [
    {"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(w)}
    for a in terms
    for b in terms
    for w in range(10)
    if w != a + b
  ]


def main(argv: list[str]) -> None:
  if len(argv) not in (2, 3):
    raise SystemExit(__doc__.split("\n\n")[1].strip())
  rows = pairs(int(argv[2]) if len(argv) == 3 else 2)
  with open(argv[1], "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
  print(f"Wrote {len(rows)} pairs to {argv[1]}")


if __name__ == "__main__":
  main(sys.argv)
