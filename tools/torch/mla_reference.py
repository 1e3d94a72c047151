"""DeepSeek's multi-head latent attention, YaRN RoPE and group-limited routing, restated in plain
PyTorch from Hugging Face transformers 5.25's `modeling_deepseek_v3.py` (`DeepseekV3Attention`,
`apply_rotary_pos_emb_interleave`, `DeepseekV3TopkRouter.get_topk_indices`),
`modeling_deepseek_v2.py` (`group_limited_greedy`) and `modeling_rope_utils.py`
(`_compute_yarn_parameters`, `yarn_apply_mscale`). Written independently of graphpp's graph
(which de-interleaves the RoPE dims by a reshape/permute and pads the narrower of the q.k and v
head widths): here the interleaved rotation works on even/odd slices, and q.k and v keep their
own widths. Everything runs in the dtype of its inputs (float64 for the fixtures).
Used by moe_fixture.py.
"""
import math

import torch

from llama_fixture import rms_norm, rotate_half

# HF builds q_a_layernorm and kv_a_layernorm with DeepseekV3RMSNorm's default eps.
LATENT_EPS = 1e-6


def yarn_mscale(scale, m=1.0):
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def rope_tables(cfg, seq):
    """cos, sin [T, d_rope] (halves layout) with YaRN when cfg has rope_scaling."""
    d, theta = cfg["qk_rope_head_dim"], cfg["rope_theta"]
    pos = theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    inv, factor = 1.0 / pos, 1.0
    ys = cfg.get("rope_scaling")
    if ys:
        s, orig = ys["factor"], ys["original_max_position_embeddings"]
        fast, slow = ys.get("beta_fast") or 32, ys.get("beta_slow") or 1

        def corr(rot):
            return d * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(theta))

        low, high = math.floor(corr(fast)), math.ceil(corr(slow))
        low, high = max(low, 0), min(high, d - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(d // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        keep = 1 - ramp
        inv = (1.0 / (s * pos)) * (1 - keep) + (1.0 / pos) * keep
        m, m_all = ys.get("mscale"), ys.get("mscale_all_dim")
        factor = yarn_mscale(s, m) / yarn_mscale(s, m_all) if m and m_all else yarn_mscale(s)
    ang = torch.arange(seq, dtype=torch.float64)[:, None] * inv[None, :]
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos() * factor, ang.sin() * factor


def rotate(x, cos, sin, interleave):
    """RoPE on x [B, H, T, d]: interleaved pairs (HF apply_rotary_pos_emb_interleave) or halves."""
    if not interleave:
        return x * cos + rotate_half(x) * sin
    c, s = cos[..., : cos.shape[-1] // 2], sin[..., : sin.shape[-1] // 2]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def mla_block(x, p, cfg, pre):
    """x + multi-head latent attention of layer `pre` on the input-normed x."""
    b, t, _ = x.shape
    h = cfg["num_attention_heads"]
    nope, r, dv, c = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"], cfg["kv_lora_rank"]
    a = f"{pre}.self_attn"
    hs = rms_norm(x, p[f"{pre}.input_layernorm.weight"], cfg["rms_norm_eps"])
    if cfg.get("q_lora_rank") is None:
        q = hs @ p[f"{a}.q_proj.weight"].T
    else:
        ql = rms_norm(hs @ p[f"{a}.q_a_proj.weight"].T, p[f"{a}.q_a_layernorm.weight"], LATENT_EPS)
        q = ql @ p[f"{a}.q_b_proj.weight"].T
    q = q.view(b, t, h, nope + r).transpose(1, 2)
    q_pass, q_rot = torch.split(q, [nope, r], dim=-1)
    ckv = hs @ p[f"{a}.kv_a_proj_with_mqa.weight"].T
    kv_lat, k_rot = torch.split(ckv, [c, r], dim=-1)
    kv = rms_norm(kv_lat, p[f"{a}.kv_a_layernorm.weight"], LATENT_EPS) @ p[f"{a}.kv_b_proj.weight"].T
    kv = kv.view(b, t, h, nope + dv).transpose(1, 2)
    k_pass, v = torch.split(kv, [nope, dv], dim=-1)
    k_rot = k_rot.view(b, 1, t, r)
    cos, sin = rope_tables(cfg, t)
    interleave = cfg.get("rope_interleave", True)
    q_rot, k_rot = rotate(q_rot, cos, sin, interleave), rotate(k_rot, cos, sin, interleave)
    q = torch.cat([q_pass, q_rot], dim=-1)
    k = torch.cat([k_pass, k_rot.expand(b, h, t, r)], dim=-1)
    scale = (nope + r) ** -0.5
    ys = cfg.get("rope_scaling")
    if ys and ys.get("mscale_all_dim"):
        scale *= yarn_mscale(ys["factor"], ys["mscale_all_dim"]) ** 2
    causal = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
    s = (q @ k.transpose(-1, -2) * scale).masked_fill(causal, float("-inf"))
    o = (s.softmax(-1) @ v).transpose(1, 2).reshape(b, t, h * dv)
    return x + o @ p[f"{a}.o_proj.weight"].T


def mla_shapes(cfg, pre):
    d, h = cfg["hidden_size"], cfg["num_attention_heads"]
    nope, r, dv, c = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"], cfg["kv_lora_rank"]
    a = f"{pre}.self_attn"
    shapes = {}
    if cfg.get("q_lora_rank") is None:
        shapes[f"{a}.q_proj.weight"] = (h * (nope + r), d)
    else:
        rq = cfg["q_lora_rank"]
        shapes.update({
            f"{a}.q_a_proj.weight": (rq, d),
            f"{a}.q_a_layernorm.weight": (rq,),
            f"{a}.q_b_proj.weight": (h * (nope + r), rq),
        })
    shapes.update({
        f"{a}.kv_a_proj_with_mqa.weight": (c + r, d),
        f"{a}.kv_a_layernorm.weight": (c,),
        f"{a}.kv_b_proj.weight": (h * (nope + dv), c),
        f"{a}.o_proj.weight": (d, h * dv),
    })
    return shapes


def limit_groups(choice, cfg):
    """Group-limited candidates (HF): choice [N, E] with experts outside each token's best
    topk_group groups set to -inf; also the smallest margin between the kept and the first
    dropped group score (so a test can require it well above rounding)."""
    g, tg = cfg["n_group"], cfg["topk_group"]
    n, e = choice.shape
    groups = choice.view(n, g, e // g)
    if cfg.get("topk_method", "noaux_tc") == "group_limited_greedy":
        score = groups.max(dim=-1).values
    else:
        score = groups.topk(2, dim=-1)[0].sum(dim=-1)
    ranked = score.topk(min(tg + 1, g), dim=-1)
    margin = (ranked.values[:, tg - 1] - ranked.values[:, tg]).min().item() if tg < g else math.inf
    mask = torch.zeros_like(score).scatter_(1, ranked.indices[:, :tg], 1.0)
    keep = mask.unsqueeze(-1).expand(n, g, e // g).reshape(n, e).bool()
    return choice.masked_fill(~keep, float("-inf")), margin
