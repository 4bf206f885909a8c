"""PyTorch reference of the DFlash draft model and of greedy DFlash decoding.

Written from the project's DFlash specification (draft architecture, context
features, one draft step, verification). It is deliberately simple: no KV
cache, every target forward recomputes the whole sequence, all math in the
dtype of the inputs (float64 for fixtures).
"""
import json
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F


def default_target_layer_ids(n_target_layers, n_draft_layers):
    """L evenly spaced target layers; Python's round() rounds half to even."""
    if n_draft_layers == 1:
        return [n_target_layers // 2]
    return [round(1 + i * (n_target_layers - 4) / (n_draft_layers - 1))
            for i in range(n_draft_layers)]


def rope_inv_freq(head_dim, theta):
    # Same float32 computation as Hugging Face's default RoPE.
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (theta ** exponent)


def apply_rope(x, positions, inv_freq):
    """x: [..., T, heads, head_dim]; positions: [T]. Rotate-half convention."""
    angles = positions.float()[:, None] * inv_freq[None, :]   # float32, like HF
    emb = torch.cat([angles, angles], dim=-1)
    cos = emb.cos().to(x.dtype)[:, None, :]
    sin = emb.sin().to(x.dtype)[:, None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.eps))


class DraftAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        h, hd = cfg["hidden_size"], cfg["head_dim"]
        self.n_heads, self.n_kv_heads, self.head_dim = (
            cfg["num_attention_heads"], cfg["num_key_value_heads"], hd)
        self.q_proj = nn.Linear(h, self.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(h, self.n_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(h, self.n_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * hd, h, bias=False)
        self.q_norm = RMSNorm(hd, cfg["rms_norm_eps"])
        self.k_norm = RMSNorm(hd, cfg["rms_norm_eps"])

    def forward(self, x, ctx, ctx_pos, block_pos, inv_freq, window):
        """x: [b, B, h] normed block; ctx: [b, C, h] context vectors."""
        b, B, _ = x.shape
        C = ctx.shape[1]
        hd = self.head_dim
        q = apply_rope(self.q_norm(self.q_proj(x).view(b, B, self.n_heads, hd)), block_pos, inv_freq)
        k_blk = apply_rope(self.k_norm(self.k_proj(x).view(b, B, self.n_kv_heads, hd)), block_pos, inv_freq)
        v_blk = self.v_proj(x).view(b, B, self.n_kv_heads, hd)
        k_ctx = apply_rope(self.k_norm(self.k_proj(ctx).view(b, C, self.n_kv_heads, hd)), ctx_pos, inv_freq)
        v_ctx = self.v_proj(ctx).view(b, C, self.n_kv_heads, hd)
        k = torch.cat([k_ctx, k_blk], dim=1)
        v = torch.cat([v_ctx, v_blk], dim=1)
        group = self.n_heads // self.n_kv_heads
        k = k.repeat_interleave(group, dim=2)                   # head h uses kv head h // group
        v = v.repeat_interleave(group, dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
        key_pos = torch.cat([ctx_pos, block_pos])
        if window is not None:                                  # no causal mask, only the window
            visible = (block_pos[:, None] - key_pos[None, :]) < window
            scores = scores.masked_fill(~visible[None, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = torch.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, B, self.n_heads * hd)
        return self.o_proj(out)


class DraftMLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        h, i = cfg["hidden_size"], cfg["intermediate_size"]
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.self_attn = DraftAttention(cfg)
        self.mlp = DraftMLP(cfg)


class DFlashDraft(nn.Module):
    """Parameter names are those of the z-lab checkpoints (no `model.` prefix)."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        h = cfg["hidden_size"]
        self.layer_ids = draft_target_layer_ids(cfg)
        self.fc = nn.Linear(len(self.layer_ids) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg["rms_norm_eps"])
        self.norm = RMSNorm(h, cfg["rms_norm_eps"])
        self.layers = nn.ModuleList([DraftLayer(cfg) for _ in range(cfg["num_hidden_layers"])])
        self.register_buffer("inv_freq", rope_inv_freq(cfg["head_dim"], cfg.get("rope_theta", 10000.0)),
                             persistent=False)

    def windows(self):
        types = self.cfg.get("layer_types")
        if not types:
            return [None] * len(self.layers)
        return [self.cfg["sliding_window"] if t == "sliding_attention" else None for t in types]

    def forward(self, ctx_features, ctx_pos, block_embeds, block_pos):
        """ctx_features: [b, C, L*h] concatenated target layer outputs;
        block_embeds: [b, B, h]. Returns the final-normed block hidden states."""
        inv_freq = self.inv_freq.float()
        ctx = self.hidden_norm(self.fc(ctx_features))
        x = block_embeds
        for layer, window in zip(self.layers, self.windows()):
            x = x + layer.self_attn(layer.input_layernorm(x), ctx, ctx_pos, block_pos, inv_freq, window)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x)


def draft_target_layer_ids(cfg):
    ids = cfg.get("dflash_config", {}).get("target_layer_ids")
    if ids is None:
        ids = default_target_layer_ids(cfg["num_target_layers"], cfg["num_hidden_layers"])
    return list(ids)


def save_draft(draft, out_dir, dtype):
    from safetensors.torch import save_file
    os.makedirs(out_dir, exist_ok=True)
    tensors = {k: v.detach().to(dtype).contiguous().cpu() for k, v in draft.state_dict().items()}
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(draft.cfg, f, indent=2)


def load_draft(in_dir, dtype=torch.float64):
    from safetensors.torch import load_file
    with open(os.path.join(in_dir, "config.json")) as f:
        cfg = json.load(f)
    draft = DFlashDraft(cfg)
    draft.load_state_dict({k: v.to(torch.float32) for k, v in load_file(os.path.join(in_dir, "model.safetensors")).items()})
    return draft.to(dtype)


# ----------------------------------------------------------------------------
# Target helpers (Hugging Face model) and greedy decoding

def layer_outputs(model, ids, layer_ids):
    """Logits [T, V] and the outputs of decoder layers `layer_ids` (list of [T, h]),
    captured by hooks, i.e. the residual stream after each layer."""
    captured = {}
    hooks = []
    for j in set(layer_ids):
        def hook(_m, _inp, out, j=j):
            captured[j] = (out[0] if isinstance(out, tuple) else out)[0].detach()
        hooks.append(model.model.layers[j].register_forward_hook(hook))
    try:
        with torch.no_grad():
            logits = model(torch.tensor([ids], device=model.device)).logits[0]
    finally:
        for h in hooks:
            h.remove()
    return logits, [captured[j] for j in layer_ids]


def plain_greedy(model, prompt, max_new, eos_ids):
    ids = list(prompt)
    out = []
    while len(out) < max_new:
        with torch.no_grad():
            logits = model(torch.tensor([ids], device=model.device)).logits[0]
        tok = int(logits[-1].argmax())
        out.append(tok)
        ids.append(tok)
        if tok in eos_ids:
            break
    return out


def draft_block_logits(model, draft, features, s, pending, block_size, mask_id):
    """Logits [B-1, V] of one draft step: context features of positions < s."""
    dev = features.device
    block = torch.tensor([[pending] + [mask_id] * (block_size - 1)], device=dev)
    embeds = model.model.embed_tokens(block).to(features.dtype)
    hidden = draft(features[None, :s], torch.arange(s, device=dev),
                   embeds, torch.arange(s, s + block_size, device=dev))
    return model.lm_head(hidden[0, 1:])


def dflash_greedy(model, draft, prompt, max_new, eos_ids, block_size=None):
    """Greedy DFlash decoding; returns (tokens, acceptance lengths)."""
    cfg = draft.cfg
    B = block_size or cfg["block_size"]
    mask_id = cfg["dflash_config"]["mask_token_id"]
    ids = list(prompt)
    logits, feats = layer_outputs(model, ids, draft.layer_ids)
    features = torch.cat(feats, dim=-1)
    pending = int(logits[-1].argmax())
    out = [pending]
    accepted_lengths = []
    while len(out) < max_new and pending not in eos_ids:
        s = len(ids)
        with torch.no_grad():
            d = draft_block_logits(model, draft, features, s, pending, B, mask_id).argmax(-1).tolist()
        logits, feats = layer_outputs(model, ids + [pending] + d, draft.layer_ids)
        g = logits[s:s + B].argmax(-1).tolist()
        a = 0
        while a < B - 1 and d[a] == g[a]:
            a += 1
        ids += [pending] + d[:a]
        features = torch.cat(feats, dim=-1)[:len(ids)]
        pending = g[a]
        accepted_lengths.append(a + 1)
        for tok in d[:a] + [pending]:
            out.append(tok)
            if tok in eos_ids or len(out) >= max_new:
                break
        if out[-1] in eos_ids:
            break
    return out[:max_new], accepted_lengths
