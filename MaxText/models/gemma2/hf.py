"""Gemma 2 <-> Gemma2ForCausalLM (model_type gemma2): Gemma's plus the window, soft-caps and query scale, and
the norms around both sublayers (post_attention_layernorm is our post-attention norm, pre_feedforward_layernorm
the norm before the MLP)."""

from __future__ import annotations

from collections.abc import Iterator

from MaxText.convert import hf_mapping

EXTRA = {  # Gemma 2's and Gemma 3's
  "sliding_window": "sliding_window_size",
  "query_pre_attn_scalar": "query_pre_attn_scalar",
  "attn_logit_softcapping": "attn_logits_soft_cap",
  "final_logit_softcapping": "final_logits_soft_cap",
}


class Gemma2(hf_mapping.Mapping):
  decoder_block = "gemma2"
  model_types = ("gemma2",)
  arch = ("gemma2", "Gemma2ForCausalLM")
  extra = EXTRA
  fixed = {"use_post_attn_norm": True, "use_post_ffw_norm": True}
  activation_field = "hidden_activation"

  def norm_rules(self) -> Iterator[tuple]:
    yield "post_attention_layernorm.weight", ("post_self_attention_norm", "scale"), (), None, None
    yield "pre_feedforward_layernorm.weight", ("post_self_attention_layer_norm", "scale"), (), None, None
    yield "post_feedforward_layernorm.weight", ("post_ffw_norm", "scale"), (), None, None


MAPPING = Gemma2()
