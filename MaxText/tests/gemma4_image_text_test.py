"""Gemma 4's released checkpoints are Gemma4ForConditionalGeneration (model_type gemma4): the text model under
text_config and model.language_model., beside vision and audio towers. The import reads the text model alone, with
the logits of the text-only model, skips the towers in one info line, and exports back as Gemma4ForCausalLM."""

import json
import logging
import os

import numpy as np
import pytest

from MaxText import config
from MaxText.convert import hf_to_maxtext, mappings
from MaxText.errors import ConfigError
from MaxText.tests.helpers import TOKENS, assert_live_model_converts, hf_model, maxtext_logits

# A few tensors of each tower, named as transformers 5.23 saves them (shapes do not matter: they are skipped).
TOWER_TENSORS = (
  "model.vision_tower.patch_embedder.input_proj.weight",
  "model.vision_tower.encoder.layers.0.self_attn.q_proj.linear.weight",
  "model.audio_tower.layers.0.self_attn.q_proj.linear.weight",
  "model.audio_tower.output_proj.weight",
  "model.embed_vision.embedding_projection.weight",
  "model.embed_audio.embedding_projection.weight",
)


def image_text_checkpoint(text_dir, path, tie=None):
  """The text-only checkpoint in `text_dir` rewritten as a Gemma4ForConditionalGeneration in `path`: its config
  under text_config (top-level tie_word_embeddings `tie`, the text config's when None), its tensors under
  model.language_model. (lm_head stays), plus random tower tensors."""
  from safetensors import numpy as safetensors_numpy

  text = json.load(open(os.path.join(text_dir, "config.json")))
  tie = text["tie_word_embeddings"] if tie is None else tie
  cfg = {"model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"], "text_config": text}
  cfg |= {"vision_config": {"model_type": "gemma4_vision", "hidden_size": 16}, "tie_word_embeddings": tie}
  cfg |= {"audio_config": {"model_type": "gemma4_audio", "hidden_size": 16}}
  os.makedirs(path, exist_ok=True)
  json.dump(cfg, open(os.path.join(path, "config.json"), "w"))
  tensors = safetensors_numpy.load_file(os.path.join(text_dir, "model.safetensors"))
  out = {name.replace("model.", "model.language_model.", 1): w for name, w in tensors.items()}
  rng = np.random.default_rng(0)
  out |= {name: rng.normal(size=(4, 8)).astype(np.float32) for name in TOWER_TENSORS}
  safetensors_numpy.save_file(out, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
  return path


@pytest.mark.parametrize("family", ["gemma4-ple", "gemma4-moe"])
def test_image_text_checkpoint_imports_its_text_model(tmp_path, caplog, family):
  """hf_references/gemma4-ple (kv-sharing and per-layer embeddings, the E2B/E4B layout) and gemma4-moe (the
  26B-A4B layout) as image-audio-text checkpoints: converted, the logits are the text-only model's; the towers
  are skipped in one info line; the export config is the text-only Gemma4ForCausalLM (families_test checks that
  export's tensors bit-exact)."""
  reference, text_dir = hf_model(family, tmp_path)
  hf_path, out = image_text_checkpoint(text_dir, tmp_path / "image_text"), str(tmp_path / "mt")
  logger = logging.getLogger("MaxText")
  quiet = not logger.propagate  # launch.setup_logging ran in this process: caplog's root handler sees nothing
  if quiet:
    logger.addHandler(caplog.handler)
  try:
    with caplog.at_level(logging.INFO, logger="MaxText"):
      hf_to_maxtext.convert(str(hf_path), out)
  finally:
    if quiet:
      logger.removeHandler(caplog.handler)
  skipped = [r.getMessage() for r in caplog.records if "towers" in r.getMessage()]
  assert len(skipped) == 1 and skipped[0].startswith(f"Skipping {len(TOWER_TENSORS)} tensors"), skipped
  np.testing.assert_allclose(maxtext_logits(out, TOKENS), reference.logits, rtol=1e-5, atol=1e-5)
  c = config.load([os.path.join(out, "config.yml"), "run_name=t"], {})
  exported = mappings.of_block(c.decoder_block).hf_config(c, "float32")
  assert exported["architectures"] == ["Gemma4ForCausalLM"] and "text_config" not in exported


def test_image_text_config_reads_as_its_text_config(tmp_path):
  """The same keys as the text model's config.json; the head tied unless the top level says otherwise
  (Gemma4Config's default ties it); no text_config: one line."""
  _, text_dir = hf_model("gemma4-ple", tmp_path)
  text = json.load(open(os.path.join(text_dir, "config.json")))
  image_text = {"model_type": "gemma4", "text_config": text, "tie_word_embeddings": False}
  read = mappings.of_config_json(image_text).maxtext_keys
  assert read(image_text) == read(text)
  tied = read({"model_type": "gemma4", "text_config": {**text, "tie_word_embeddings": False}})
  assert tied == read({**text, "tie_word_embeddings": True}) and tied["logits_via_embedding"] is True
  with pytest.raises(ConfigError, match="model_type=gemma4 config.json needs a text_config object"):
    read({**text, "model_type": "gemma4"})


@pytest.mark.torch
@pytest.mark.slow  # builds, saves and runs a live image-audio-text model
def test_live_image_text_model_converts_to_its_text_logits(tmp_path):
  """A tiny random transformers Gemma4ForConditionalGeneration (towers included) converts; our logits on text
  equal its own."""
  import torch
  import transformers

  from MaxText.tests.helpers import FAMILIES

  text = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2)
  text |= dict(head_dim=8, **FAMILIES["gemma4-ple"][1])
  vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, head_dim=8)
  audio = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2)
  cfg = transformers.Gemma4Config(text_config=text, vision_config=vision, audio_config=audio)
  torch.manual_seed(0)
  assert_live_model_converts(transformers.Gemma4ForConditionalGeneration(cfg).float().eval(), tmp_path)
