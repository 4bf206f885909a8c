#!/usr/bin/env python3
"""Which bf16 roundings make a Qwen3 checkpoint's logits differ from float32?

Runs the Qwen3 forward in float32 (torch, on the GPU) with bf16 rounding at a
chosen set of sites, the places where dflash's bf16 kernels round (the norms'
outputs, the products' outputs, q/k norm + RoPE, attention probabilities and
output, the residual stream, SwiGLU's steps, the logits), and prints the
relative L2 error of the logits against float32 for: every site, every site but
one, and a few combinations. The float32 run is checked against transformers'
float32 logits first (the forward must be the model's).

Usage: logits_rounding_sites.py MODEL_DIR --prompt-ids 1,2,3 [--json OUT]
"""
import argparse
import glob
import json
import math

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

SITES = ["norm", "qkv", "qk_rope", "attn_p", "attn_out", "o", "resid", "gate_up", "act", "down", "logits"]


def bf(x):
    return x.to(torch.bfloat16).float()


class Forward:
    def __init__(self, model_dir):
        cfg = json.load(open(f"{model_dir}/config.json"))
        self.cfg = cfg
        w = {}
        for f in sorted(glob.glob(f"{model_dir}/*.safetensors")):
            w.update({k: v.to("cuda").float() for k, v in load_file(f).items()})
        self.w = w
        hd = cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
        self.hd = hd
        self.inv_freq = 1.0 / (cfg.get("rope_theta", 10000.0) ** (torch.arange(0, hd, 2, device="cuda").float() / hd))

    def run(self, ids, sites):
        c, w, hd = self.cfg, self.w, self.hd
        r = (lambda name, x: bf(x) if name in sites else x)
        eps = c["rms_norm_eps"]
        nh, nkv = c["num_attention_heads"], c["num_key_value_heads"]

        def rms(x, weight):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

        n = len(ids)
        pos = torch.arange(n, device="cuda").float()
        ang = pos[:, None] * self.inv_freq[None, :]
        cos, sin = torch.cos(ang), torch.sin(ang)

        def rope(x):  # x [n, heads, hd]
            a, b = x[..., : hd // 2], x[..., hd // 2:]
            cc, ss = cos[:, None, :], sin[:, None, :]
            return torch.cat([a * cc - b * ss, b * cc + a * ss], -1)

        x = w["model.embed_tokens.weight"][torch.tensor(ids, device="cuda")]
        mask = torch.ones(n, n, device="cuda", dtype=torch.bool).tril()
        for i in range(c["num_hidden_layers"]):
            p = f"model.layers.{i}."
            h = r("norm", rms(x, w[p + "input_layernorm.weight"]))
            q = r("qkv", h @ w[p + "self_attn.q_proj.weight"].T).view(n, nh, hd)
            k = r("qkv", h @ w[p + "self_attn.k_proj.weight"].T).view(n, nkv, hd)
            v = r("qkv", h @ w[p + "self_attn.v_proj.weight"].T).view(n, nkv, hd)
            q = r("qk_rope", rope(rms(q, w[p + "self_attn.q_norm.weight"])))
            k = r("qk_rope", rope(rms(k, w[p + "self_attn.k_norm.weight"])))
            g = nh // nkv
            k = k.repeat_interleave(g, dim=1)
            v = v.repeat_interleave(g, dim=1)
            s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
            s = s.masked_fill(~mask[None], float("-inf"))
            pr = r("attn_p", torch.exp(s - s.amax(-1, keepdim=True)))
            o = torch.einsum("hqk,khd->qhd", pr, v) / pr.sum(-1).T[:, :, None]
            o = r("attn_out", o.reshape(n, nh * hd))
            x = r("resid", x + r("o", o @ w[p + "self_attn.o_proj.weight"].T))
            h = r("norm", rms(x, w[p + "post_attention_layernorm.weight"]))
            gate = r("gate_up", h @ w[p + "mlp.gate_proj.weight"].T)
            up = r("gate_up", h @ w[p + "mlp.up_proj.weight"].T)
            act = r("act", r("act", torch.nn.functional.silu(gate)) * up)
            x = r("resid", x + r("down", act @ w[p + "mlp.down_proj.weight"].T))
        h = r("norm", rms(x, w["model.norm.weight"]))
        return r("logits", h @ w["lm_head.weight"].T)


def rel(a, ref):
    return float((a - ref).norm() / ref.norm())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--prompt-ids", required=True)
    ap.add_argument("--json")
    a = ap.parse_args()
    ids = [int(t) for t in a.prompt_ids.split(",")]
    torch.backends.cuda.matmul.allow_tf32 = False
    with torch.no_grad():
        m = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).to("cuda").eval()
        hf32 = m(torch.tensor([ids], device="cuda")).logits[0].float()
        del m
        torch.cuda.empty_cache()
        f = Forward(a.model)
        ref = f.run(ids, set())
        res = {"model": a.model, "n_tokens": len(ids), "fp32_forward_vs_hf_fp32": rel(ref, hf32)}
        all_sites = set(SITES)
        res["all_sites"] = rel(f.run(ids, all_sites), ref)
        for s in SITES:
            res[f"all_but_{s}"] = rel(f.run(ids, all_sites - {s}), ref)
            res[f"only_{s}"] = rel(f.run(ids, {s}), ref)
        for combo in (["resid", "act"], ["resid", "act", "gate_up"], ["resid", "o", "down"],
                      ["resid", "act", "attn_out", "qk_rope"]):
            res["all_but_" + "+".join(combo)] = rel(f.run(ids, all_sites - set(combo)), ref)
    print(json.dumps(res, indent=1))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
