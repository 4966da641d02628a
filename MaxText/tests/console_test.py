"""What a run prints besides its records: the header, the progress line, the closing outputs."""

import io
import os
import time

from MaxText import console
from MaxText.tests.conftest import cfg


class FakeTerminal(io.StringIO):
  def isatty(self):
    return True


def test_header_is_short_and_names_the_outputs(tmp_path):
  c = cfg(tmp_path, "h", "steps=7")
  text = console.run_header(
    c,
    num_params=1_234_567,
    mesh_shape={"data": 1, "fsdp": 8, "tensor": 1},
    global_batch=8,
    start=0,
    source="init",
    peak="peak 0.05 TFLOP/s/device (measured float32 matmul, cpu)",
    platform="cpu",
  )
  lines = text.splitlines()
  assert len(lines) <= 8
  assert lines[0] == "run h: steps 0 -> 7 | start: init"
  assert "1.23M parameters" in text and "8 x 32 tokens per step" in text
  assert "fsdp 8 (8 cpu devices) | peak 0.05 TFLOP/s/device" in text
  assert f"outputs  {os.path.abspath(c.run_dir)}/" in text
  assert "the default" not in text  # base_output_directory was given
  lora_header = console.run_header(
    c,
    num_params=6_738_415_616,
    num_trainable=39_976_960,
    mesh_shape={"data": 1},
    global_batch=1,
    start=0,
    source="init",
    peak="",
    platform="cpu",
  )
  assert "6.74B parameters (trainable 40M, LoRA)," in lora_header
  default = cfg(tmp_path, "h", "base_output_directory=outputs")
  assert "set base_output_directory=" in console.run_header(
    default, num_params=1, mesh_shape={"data": 1}, global_batch=1, start=0, source="init", peak="", platform="cpu"
  )


def test_progress_bar_on_a_terminal_only(capsys):
  terminal = FakeTerminal()
  bar = console.Progress(total=10, initial=0, enabled=True, stream=terminal)
  for step in range(1, 4):
    bar.update(step, loss=2.0, eta_s=7.0)
  bar.write("step 3/10 | loss 2")
  bar.close()
  assert "3/10" in terminal.getvalue() and "loss 2" in terminal.getvalue()
  assert capsys.readouterr().out == "step 3/10 | loss 2\n"  # records go to stdout, the bar to the terminal

  log = io.StringIO()  # not a terminal: no bar, a plain line only after interval_s without output
  quiet = console.Progress(total=10, initial=0, enabled=True, stream=log, interval_s=3600)
  quiet.update(1, loss=2.0, eta_s=9.0)
  assert log.getvalue() == "" and capsys.readouterr().out == ""
  plain = console.Progress(total=10, initial=0, enabled=True, stream=log, interval_s=0)
  plain.update(4, loss=2.0, eta_s=75.0)
  assert capsys.readouterr().out == "progress: step 4/10 | ETA 1m15s\n"
  off = console.Progress(total=10, initial=0, enabled=False, stream=FakeTerminal(), interval_s=0)
  off.update(4, loss=2.0, eta_s=1.0)
  assert off.bar is None and capsys.readouterr().out == ""


def test_outputs_lines(tmp_path):
  c = cfg(tmp_path, "o", "enable_tensorboard=true")
  text = "\n".join(console.outputs_lines(c, "/x/checkpoints/5/state"))
  assert f"decode.py {os.path.abspath(c.run_dir)}/config.yml load_parameters_path=/x/checkpoints/5/state" in text
  assert f"tensorboard --logdir {os.path.abspath(c.tensorboard_dir)}" in text
  assert "last checkpoint" not in "\n".join(console.outputs_lines(c, None))


def test_the_decode_command_fits_how_the_run_was_trained(tmp_path):
  """The run's own config.yml, with the checkpoint where decode.py reads it: params, or a LoRA run's adapters."""
  lora = cfg(tmp_path, "l", "lora_rank=4", f"load_parameters_path={tmp_path}")  # the paths must exist
  assert "config.yml lora_weights_path=/r/5/state " in console.decode_command(lora, "/r/5/state")
  full = cfg(tmp_path, "f", f"load_full_state_path={tmp_path}")
  assert "load_parameters_path=/r/5/state load_full_state_path= " in console.decode_command(full, "/r/5/state")


def test_the_decode_command_samples_from_the_data_s_own_words(tmp_path):
  """A small model decoded greedily mostly repeats one word: the hint samples, from the run's held-out words."""
  c = cfg(tmp_path, "s")
  assert console.decode_command(c, "/r/5/state").endswith("/r/5/state decode_sampling_strategy=nucleus")
  line = console.decode_command(c, "/r/5/state", "def __init__(self, x):")
  assert line.endswith("/r/5/state 'prompt=def __init__(self, x):' decode_sampling_strategy=nucleus")
  topk = cfg(tmp_path, "k", "decode_sampling_strategy=topk")  # the run's own choice stays (its config.yml has it)
  assert "decode_sampling_strategy" not in console.decode_command(topk, "/r/5/state")


def test_a_long_compile_says_it_is_still_running_and_a_short_one_says_nothing():
  out = io.StringIO()
  with console.Heartbeat("compiling the train step", interval_s=0.05, stream=out):
    time.sleep(0.18)
  lines = out.getvalue().splitlines()
  assert len(lines) >= 2 and lines[0].startswith("compiling the train step: still running, 0s so far (XLA's")
  assert "Very slow compile?" not in lines[1]
  quiet = io.StringIO()
  with console.Heartbeat("compiling", interval_s=5, stream=quiet):
    pass
  with console.Heartbeat("compiling", enabled=False, interval_s=0.01, stream=quiet):
    time.sleep(0.05)
  assert quiet.getvalue() == ""
