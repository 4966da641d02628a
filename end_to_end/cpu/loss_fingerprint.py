"""Losses of tiny training runs across families, parallelism layouts, remat policies and kernels, written as
exact float reprs, so that a refactor can be checked to change nothing: run it before and after, then
`--compare BEFORE AFTER` (exit 1 on any difference, however small, in the cases AFTER ran).

  python3 end_to_end/cpu/loss_fingerprint.py --out /tmp/before.json      # ~6 min on 2 cores
  python3 end_to_end/cpu/loss_fingerprint.py --compare /tmp/before.json /tmp/after.json

Each case trains 3 steps on synthetic data on 8 CPU devices (XLA's forced host device count), float32 and
bfloat16 cases both. The `objective/*` cases run the user's command lines in subprocesses (SFT, DPO, DPO under
LoRA, GRPO through `python3 -m MaxText.rl`, multimodal SFT, a resumed run) on tiny converted Hugging Face models
that `--fixtures DIR` holds (made there once by make_tiny_*_model.py; pass the same DIR before and after, so
that both runs start from the same files); `--only objective/` runs just those.

XLA:CPU's kernels follow the host's vector units, so a loss's last bits depend on the kind of CPU. loss_fingerprint.json
is the record of this project's first 2-core x86 hosts (CI's among them); loss_fingerprint_hosts.json holds, per
`--host` signature (vendor and vector features), the test's cases as another kind of host computes them (an AVX-512
AMD EPYC's differ in 6 of 8). To add a kind of host, run those cases there at a commit whose losses equal
loss_fingerprint.json's on a recorded host, then `--record-host` the file (loss_fingerprint_test.py says how)."""

import argparse
import json
import os
import platform
import sys
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

TINY = [
  "dataset_type=synthetic", "base_emb_dim=64", "base_num_query_heads=4", "base_num_kv_heads=2", "base_mlp_dim=128",
  "base_num_decoder_layers=2", "head_dim=16", "vocab_size=256", "max_target_length=32", "dtype=float32",
  "log_config=false", "log_period=1", "learning_rate=1e-2", "warmup_steps_fraction=0", "enable_checkpointing=false",
  "enable_tensorboard=false", "steps=3", "per_device_batch_size=2", "override_model_config=true",
]  # fmt: skip
MOE = ["num_experts=4", "num_experts_per_tok=2", "base_moe_mlp_dim=32"]
MLA = ["q_lora_rank=16", "kv_lora_rank=16", "qk_nope_head_dim=8", "qk_rope_head_dim=8", "v_head_dim=8"]
FAMILIES = {
  "llama2": ["model_name=llama2-7b"],
  "llama3.1": ["model_name=llama3.1-8b"],
  "mistral": ["model_name=mistral-7b", "sliding_window_size=8"],
  "mixtral": ["model_name=mixtral-8x7b", *MOE],
  "gemma": ["model_name=gemma-2b"],
  "gemma2": ["model_name=gemma2-2b", "sliding_window_size=8"],
  "gemma3": ["model_name=gemma3-4b", "sliding_window_size=8", "base_num_decoder_layers=6"],
  "gpt3": ["model_name=gpt3-175b", "trainable_position_size=64"],
  "qwen3": ["model_name=qwen3-8b"],
  "qwen3-moe": ["model_name=qwen3-30b-a3b", *MOE],
  "deepseek2": ["model_name=deepseek2-16b", *MOE, *MLA, "q_lora_rank=0", "first_num_dense_layers=1",
                "base_num_decoder_layers=3", "original_max_position_embeddings=16"],
  "deepseek3": ["model_name=deepseek3-671b", *MOE, *MLA, "first_num_dense_layers=1", "base_num_decoder_layers=3",
                "n_routing_groups=2", "topk_routing_group=1", "original_max_position_embeddings=16"],
  "llama4": ["model_name=llama4-17b-16e", *MOE, "num_experts_per_tok=1", "base_num_decoder_layers=4",
             "chunk_attn_window_size=8", "interleave_moe_layer_step=2", "temperature_tuning_floor_scale=8",
             "original_max_position_embeddings=16"],
}  # fmt: skip
LAYOUTS = {
  "fsdp8": ["ici_fsdp_parallelism=8"],
  "dp2-fsdp4": ["ici_data_parallelism=2", "ici_fsdp_parallelism=4"],
  "tp2-fsdp4": ["ici_tensor_parallelism=2", "ici_fsdp_parallelism=4"],
  "seq2-fsdp4": ["ici_sequence_parallelism=2", "ici_fsdp_parallelism=4"],
  "cp2-fsdp4": ["ici_context_parallelism=2", "ici_fsdp_parallelism=4"],
  "cp4-flash": ["ici_context_parallelism=4", "ici_fsdp_parallelism=2", "attention=flash", "max_target_length=128"],
  "cp4-balanced": ["ici_context_parallelism=4", "ici_fsdp_parallelism=2", "context_parallel_load_balance=true"],
  "pp2": ["ici_pipeline_parallelism=2", "ici_fsdp_parallelism=4", "num_pipeline_microbatches=4"],
  "pp2-repeats": ["ici_pipeline_parallelism=2", "ici_fsdp_parallelism=4", "num_pipeline_microbatches=2",
                  "base_num_decoder_layers=4", "num_pipeline_repeats=2"],
  "pp4": ["ici_pipeline_parallelism=4", "ici_fsdp_parallelism=2", "num_pipeline_microbatches=4",
          "base_num_decoder_layers=4"],
  "ep2-mixtral": ["model_name=mixtral-8x7b", *MOE, "ici_expert_parallelism=2", "ici_fsdp_parallelism=4"],
  "ep4-dropping": ["model_name=mixtral-8x7b", *MOE, "ici_expert_parallelism=4", "ici_fsdp_parallelism=2",
                   "capacity_factor=0.5"],
  "ep2-deepseek3": FAMILIES["deepseek3"] + ["ici_expert_parallelism=2", "ici_fsdp_parallelism=4"],
  "flash": ["attention=flash", "max_target_length=128"],
  "flash-gemma2": FAMILIES["gemma2"] + ["attention=flash", "max_target_length=128"],
  "bf16": ["dtype=bfloat16"],
  "bf16-tp2": ["dtype=bfloat16", "ici_tensor_parallelism=2", "ici_fsdp_parallelism=4"],
  "vocab-tiling": ["num_vocab_tiling=4"],
  "lora": ["lora_rank=4", "lora_random_base=true"],
  "int8": ["quantization=int8"],
  "mtp": ["mtp_num_layers=1"],
}  # fmt: skip
REMAT = ["full", "minimal", "save_dot_except_mlp", "save_qkv_proj", "none", "save_out_proj", "qkv_proj_offloaded"]
CASES = {f"family/{k}": v for k, v in FAMILIES.items()}
CASES |= {f"layout/{k}": v for k, v in LAYOUTS.items()}
CASES |= {f"remat/{k}": [f"remat_policy={k}"] for k in REMAT}
CASES |= {"remat/none-unscanned": ["remat_policy=none", "scan_layers=false"]}
CASES |= {"family/llama4-unscanned": FAMILIES["llama4"] + ["scan_layers=false"]}

# The objectives, as a user runs them: (entry point, arguments); FX is the fixtures directory, OUT the output one.
QUIET = ["log_config=false", "log_period=1", "enable_tensorboard=false"]
CHAT = ["load_parameters_path=FX/chat/converted/params", "tokenizer_path=FX/chat/converted/tokenizer.json"]
OBJECTIVES = {
  "sft": ("MaxText/train.py", ["cpu/sft", *CHAT, "dataset_path=FX/chat/chat.jsonl", "steps=3",
                               "enable_checkpointing=false"]),
  "dpo": ("MaxText/train.py", ["cpu/dpo", *CHAT, "dataset_path=FX/prefs.jsonl", "steps=3", "eval_interval=3",
                               "enable_checkpointing=false"]),
  "dpo-lora": ("MaxText/train.py", ["cpu/dpo", *CHAT, "dataset_path=FX/prefs.jsonl", "steps=3", "eval_interval=3",
                                    "lora_rank=4", "lora_alpha=8", "enable_checkpointing=false"]),
  "grpo": ("-m MaxText.rl", ["FX/chat/converted/config.yml", *CHAT, "dataset_path=FX/prompts.jsonl",
                             "rl_reward=fingerprint_reward:varied", "add_bos=false", "steps=3",
                             "per_device_batch_size=8", "num_generations=4", "learning_rate=1e-4",
                             "max_target_length=64", "max_prefill_predict_length=32", "decode_max_new_tokens=4",
                             "decode_sampling_strategy=weighted", "enable_checkpointing=false"]),
  "multimodal-sft": ("MaxText/train.py", ["FX/vision/converted/config.yml",
                                          "load_parameters_path=FX/vision/converted/params",
                                          "use_sft=true", "dataset_type=text", "dataset_path=FX/vision/chat.jsonl",
                                          "eval_fraction=0", "max_target_length=48", "per_device_batch_size=1",
                                          "steps=3", "learning_rate=3e-3", "freeze_vision_encoder=false",
                                          "enable_checkpointing=false"]),
  # Resumed: 2 steps and a checkpoint, then the same run_name to 4 steps (the lines of both attempts).
  "resume": ("MaxText/train.py", ["MaxText/configs/base.yml", *[t for t in TINY if not t.startswith(("steps=",
             "enable_checkpointing"))], "checkpoint_period=2", "steps=2", "&&", "steps=4"]),
}  # fmt: skip
# The objective cases' fixtures: one fixed place, since the DPO case's eval split hashes the data's path.
DEFAULT_FIXTURES = "/tmp/loss_fingerprint_fixtures"
RECORDED = ("loss", "eval_loss", "dpo_accuracy", "eval_dpo_accuracy", "reward_mean", "kl")


def make_fixtures(fx):
  """The tiny models and data the objective cases read (make_tiny_*_model.py write the models), once per DIR."""
  import subprocess

  here = os.path.dirname(os.path.abspath(__file__))
  root = os.path.join(here, "..", "..")
  run = lambda *args: subprocess.run([sys.executable, *args], check=True, cwd=root, capture_output=True)  # noqa: E731
  for name, script in (("chat", "make_tiny_chat_model.py"), ("vision", "make_tiny_vision_model.py")):
    if not os.path.isdir(os.path.join(fx, name, "converted")):
      run(os.path.join(here, script), os.path.join(fx, name))
      run("-m", "MaxText.convert.hf_to_maxtext", "--hf_path", os.path.join(fx, name, "hf"), "--output",
          os.path.join(fx, name, "converted"))  # fmt: skip
  run(os.path.join(here, "make_prefs.py"), os.path.join(fx, "prefs.jsonl"), "4")
  # A reward that differs within a group on a random model.
  with open(os.path.join(fx, "fingerprint_reward.py"), "w") as f:
    f.write("def varied(prompt, completion):\n  return float(len(completion) % 3)\n")
  with open(os.path.join(fx, "prompts.jsonl"), "w") as f:  # make_tiny_chat_model.py's ChatML template
    for a in range(10):
      for b in range(10):
        f.write(json.dumps({"prompt": f"<|im_start|>user\n{a}+{b}=<|im_end|>\n<|im_start|>assistant\n"}) + "\n")


HOSTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "loss_fingerprint_hosts.json")
# The CPU features that change which kernels XLA:CPU runs (its own codegen and the library kernels it calls).
VECTOR_FEATURES = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "sve", "sve2")


def host_signature() -> str:
  """This host's CPU vendor and vector features, e.g. 'AuthenticAMD avx2 avx512_bf16 avx512_vnni avx512f fma'."""
  fields = {}
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if not line.strip():  # the first processor's block holds them all
          break
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
  except OSError:
    pass
  vendor = fields.get("vendor_id") or fields.get("CPU implementer") or platform.machine()  # x86, or arm
  flags = set((fields.get("flags") or fields.get("Features") or "").split())
  return " ".join([vendor, *sorted(flags & set(VECTOR_FEATURES))])


def recorded_for_this_host(default: dict) -> dict:
  """loss_fingerprint.json's cases, with this kind of host's own record (loss_fingerprint_hosts.json) over them."""
  with open(HOSTS) as f:
    return {**default, **json.load(f).get(host_signature(), {})}


def run_objective(name, fx, out_dir):
  """The recorded metrics of each metrics.jsonl line of one objective case, as reprs."""
  import subprocess

  entry, args = OBJECTIVES[name]
  root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
  common = [f"run_name={name}", f"base_output_directory={out_dir}", *QUIET]
  attempts = " ".join(args).split(" && ")
  first = attempts[0].split(" ")
  for i, attempt in enumerate(attempts):
    argv = first + attempt.split(" ") if i else first  # a later attempt: the first's arguments, its own on top
    argv = [a.replace("FX", fx) for a in argv]
    cmd = [sys.executable, *entry.split(" "), *argv, *common]
    # The GRPO case's reward module; this checkout's MaxText first (also where another one is installed).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.abspath(root), fx])}
    done = subprocess.run(cmd, cwd=root, capture_output=True, text=True, env=env)
    if done.returncode:
      tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or [""]
      return f"exit {done.returncode}: {tail[0]}"
  with open(os.path.join(out_dir, name, "metrics.jsonl")) as f:
    lines = [json.loads(line) for line in f]
  return [{k: repr(v) for k, v in line.items() if k in RECORDED} for line in lines]


def run_case(name, overrides, out_dir):
  from MaxText import config, train

  base = os.path.join(os.path.dirname(__file__), "..", "..", "MaxText", "configs", "base.yml")
  run = name.replace("/", "-")
  c = config.load([base, f"run_name={run}", f"base_output_directory={out_dir}", *TINY, *overrides], {})
  train.run(c)
  with open(c.metrics_file) as f:
    return [repr(json.loads(line)["loss"]) for line in f]


def main(argv):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--out", help="write {case: [loss reprs]} here")
  p.add_argument("--only", default="", help="comma-separated case-name prefixes")
  p.add_argument("--cases", default="", help="comma-separated case names, each exactly (with --only: either)")
  p.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
  p.add_argument("--fixtures", default=DEFAULT_FIXTURES, help="the objective cases' tiny models")
  p.add_argument("--host", action="store_true", help="print this host's signature (the key of its own record)")
  p.add_argument("--record-host", metavar="LOSSES", help="store an --out file as this kind of host's record")
  args = p.parse_args(argv[1:])
  if args.host:
    print(host_signature())
    return
  if args.record_host:
    with open(args.record_host) as f:
      losses = json.load(f)
    hosts, signature = json.load(open(HOSTS)) if os.path.exists(HOSTS) else {}, host_signature()
    hosts[signature] = {**hosts.get(signature, {}), **losses}
    with open(HOSTS, "w") as f:
      json.dump(hosts, f, indent=1)
      f.write("\n")
    print(f"{len(losses)} cases recorded for '{signature}' in {HOSTS}")
    return
  if args.compare:
    before, after = (json.load(open(f)) for f in args.compare)
    bad = [k for k in sorted(after) if before.get(k) != after.get(k)]  # an --only run compares its own cases
    for k in bad:
      print(f"DIFFERS {k}: {before.get(k)} -> {after.get(k)}")
    unrun = len(set(before) - set(after))
    note = f" ({unrun} of BEFORE not run)" if unrun else ""
    print(f"{len(after) - len(bad)}/{len(after)} cases bit-identical{note}")
    sys.exit(1 if bad else 0)
  prefixes, exact = [s for s in args.only.split(",") if s], {s for s in args.cases.split(",") if s}
  unknown = sorted(exact - set(CASES) - {f"objective/{k}" for k in OBJECTIVES})
  if unknown:
    p.error(f"--cases: no case named {', '.join(unknown)}")

  def chosen(name):
    return not (prefixes or exact) or name in exact or any(name.startswith(s) for s in prefixes)

  results = {}
  with tempfile.TemporaryDirectory() as tmp:
    for name, overrides in CASES.items():
      if not chosen(name):
        continue
      try:
        results[name] = run_case(name, overrides, tmp)
      except Exception as e:  # a case that fails is recorded as such (and must fail the same way after)
        results[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
      print(name, results[name], flush=True)
    wanted = [k for k in OBJECTIVES if chosen(f"objective/{k}")]
    if wanted:
      make_fixtures(args.fixtures)
    for name in wanted:
      results[f"objective/{name}"] = run_objective(name, args.fixtures, tmp)
      print(f"objective/{name}", results[f"objective/{name}"], flush=True)
  if args.out:
    with open(args.out, "w") as f:
      json.dump(results, f, indent=1)


if __name__ == "__main__":
  main(sys.argv)
