"""An independent reference of the DSpark draft's forward, written from design/dspark.md (sections 1.1-1.6 and
2, steps 2-4) in plain torch, float64, on the checkpoint's own tensors: it shares no code with
backend/model/dspark*.py. Qwen3 flavour, full attention, vanilla Markov head, confidence head with Markov features,
sample-from-anchor: what the tiny draft is."""
from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3's RMSNorm: w * x / rms(x)."""
    return w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rope(x: torch.Tensor, positions: torch.Tensor, rotary_dim: int, theta: float) -> torch.Tensor:
    """NeoX rotary embedding on the first `rotary_dim` channels of x [N, heads, D] at absolute `positions` [N]."""
    inv = 1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    ang = positions.double()[:, None] * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], -1)
    return torch.cat([rot * cos + rotated * sin, rest], -1)


def draft_block(w: dict[str, torch.Tensor], cfg: dict, features: torch.Tensor, anchor: int) -> dict:
    """One draft block for one sequence. `w`: the draft checkpoint's tensors (embed_tokens and lm_head are the
    target's); `cfg`: its config.json; `features` [t, m*H]: the tapped target features of positions 0..t-1; the
    anchor x0 sits at position t. Returns h [gamma, H] (final-norm block hidden), base logits U [gamma, V], and the
    sequential greedy loop: tokens x_1..x_gamma, logits U_k + B_k(x_{k-1}), confidences c_k."""
    w = {k: v.double() for k, v in w.items()}
    eps, gamma = cfg["rms_norm_eps"], cfg["block_size"]
    nh, nkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    rot = int(d * cfg.get("partial_rotary_factor", 1.0))
    theta = cfg["rope_theta"]
    t = features.shape[0]
    # 1.1: C = hidden_norm(W_fc F)
    c = rms_norm(features.double() @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
    # 1.2: block input [x0, m, ..., m] at positions t..t+gamma-1, the target's embedding
    ids = torch.tensor([anchor] + [cfg["mask_token_id"]] * (gamma - 1))
    x = w["embed_tokens.weight"][ids]
    ctx_pos, blk_pos = torch.arange(t), torch.arange(t, t + gamma)
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        a = p + "self_attn."
        xn = rms_norm(x, w[p + "input_layernorm.weight"], eps)
        # 1.3: Q from the block; K, V from [C ; X] through the same k_proj / v_proj; per-head q_norm / k_norm; RoPE
        q = rms_norm((xn @ w[a + "q_proj.weight"].T).view(gamma, nh, d), w[a + "q_norm.weight"], eps)
        q = rope(q, blk_pos, rot, theta)

        def keys_values(rows, pos):
            k = rms_norm((rows @ w[a + "k_proj.weight"].T).view(len(pos), nkv, d), w[a + "k_norm.weight"], eps)
            return rope(k, pos, rot, theta), (rows @ w[a + "v_proj.weight"].T).view(len(pos), nkv, d)
        kc, vc = keys_values(c, ctx_pos)
        kb, vb = keys_values(xn, blk_pos)
        k, v = torch.cat([kc, kb]), torch.cat([vc, vb])
        # every block query sees all context rows (< t) and all gamma block rows: no mask; GQA
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / d ** 0.5, -1)
        o = torch.einsum("hqk,khd->qhd", att, v).reshape(gamma, nh * d)
        x = x + o @ w[a + "o_proj.weight"].T
        xn = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        mlp = torch.nn.functional.silu(xn @ w[p + "mlp.gate_proj.weight"].T) * (xn @ w[p + "mlp.up_proj.weight"].T)
        x = x + mlp @ w[p + "mlp.down_proj.weight"].T
    h = rms_norm(x, w["norm.weight"], eps)
    base = h @ w["lm_head.weight"].T  # 1.4
    # 1.5 / 1.6 / 2.4: B_k = W2 W1[x_{k-1}] (x_0 = the anchor), c_k = sigmoid(w . [h_k ; W1[x_{k-1}]] + b)
    prev, tokens, logits, conf = anchor, [], [], []
    for k in range(gamma):
        e = w["markov_head.markov_w1.weight"][prev]
        z = base[k] + w["markov_head.markov_w2.weight"] @ e
        conf.append(torch.sigmoid(w["confidence_head.proj.weight"][0] @ torch.cat([h[k], e])
                                  + w["confidence_head.proj.bias"][0]))
        prev = int(z.argmax())
        tokens.append(prev)
        logits.append(z)
    return dict(h=h, base=base, tokens=torch.tensor(tokens), logits=torch.stack(logits), confidence=torch.stack(conf))
