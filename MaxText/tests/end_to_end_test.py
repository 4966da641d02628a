"""Runs the end_to_end scripts that fit the CPU suite (the quick start itself is too long: run
end_to_end/cpu/quickstart.sh by hand or in a nightly job)."""

import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_smoke_script(tmp_path):
  result = subprocess.run(
    ["bash", "end_to_end/cpu/smoke.sh", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600
  )
  assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
  assert "OK " in result.stdout
  assert "MFU" in result.stdout
