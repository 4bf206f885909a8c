"""The Qwen3-Next fixture, written by transformers' own Qwen3Next classes; called by
make_fixtures.py (--only qwen3_next):

  targets/qwen3_next_untied      float32, untied: Qwen3.5's layers with the linear attention's
                                 projections fused per key head (in_proj_qkvz, in_proj_ba; two
                                 value heads a key head), layer 1 a dense MLP (mlp_only_layers),
                                 the others routed without renormalizing the top-k
                                 (norm_topk_prob false) plus a shared expert
  drafts/qwen3_next_untied_l1    a random one-layer draft
  expected/qwen3_next_untied.*   as the other targets, plus 200 steps of incremental decoding

The delta rule is swapped for qwen3_5_fixtures' float64 recurrence, as for Qwen3.5.
"""
import os
import shutil

import torch
import transformers
import transformers.models.qwen3_next.modeling_qwen3_next as q3n
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

import qwen3_5_fixtures as q35f

NAME = "qwen3_next_untied"
SHAPE = dict(hidden_size=48, intermediate_size=72, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=12, linear_value_head_dim=8,
             linear_conv_kernel_dim=4, rope_theta=10000.0, partial_rotary_factor=0.25, rms_norm_eps=1e-6,
             num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=40,
             norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[1])


def write(mf, out, device, rng):
    q35f.ORIGINAL[q3n] = (q3n.torch_recurrent_gated_delta_rule, q3n.torch_chunk_gated_delta_rule)
    q35f.check_f64_delta_rule()
    q35f.use_f64_delta_rule(True)
    for path in (os.path.join(out, "targets", NAME), os.path.join(out, "drafts", NAME + "_l1")):
        shutil.rmtree(path, ignore_errors=True)
    torch.manual_seed(41)
    model = mf.eager_experts(Qwen3NextForCausalLM(q35f.hybrid_config(Qwen3NextConfig, mf, tie_word_embeddings=False,
                                                                     **SHAPE)))
    q35f.randomize(model, 41)
    target = os.path.join(out, "targets", NAME)
    model.save_pretrained(target)
    print(NAME, open(os.path.join(target, "config.json")).read(), flush=True)
    mf.check_expert_layout(target)
    from safetensors import safe_open
    with safe_open(os.path.join(target, "model.safetensors"), "pt") as st:
        print(NAME, "layer 0:", sorted((k, list(st.get_slice(k).get_shape())) for k in st.keys() if "layers.0." in k),
              flush=True)
    torch.manual_seed(400)
    draft = mf.ref.DFlashDraft(mf.draft_config(model.config, 1, 16))
    mf.randomize(draft, 400)
    mf.ref.save_draft(draft, os.path.join(out, "drafts", NAME + "_l1"), torch.float32)
    mf.reference_case(out, NAME, target, os.path.join(out, "drafts", NAME + "_l1"), device, rng)
    q35f.add_incremental(mf, out, NAME, rng, device)
    print(f"transformers {transformers.__version__}: Qwen3-Next fixture written", flush=True)
