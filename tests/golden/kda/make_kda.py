#!/usr/bin/env python3
"""Makes the KDA layer goldens (tests/golden/kda/*.safetensors) for tests/test_kda.c.

  /path/to/venv/bin/python tests/golden/kda/make_kda.py [OUTDIR]

Needs torch and transformers 5.25 (glm5_next); CI never runs this, the test
reads what it wrote.

One transformers Glm5NextTextLinearAttention layer (KDA linear attention) at a
tiny random config: hidden 64, 4 heads x head_dim 16, conv kernel 4, rms_norm_eps
1e-5. The projections are stored in bf16 (the values the module then runs in
float32), the conv taps, dt_bias, A_log and o_norm in float32 (A_log, dt_bias and
o_norm drawn away from their constant initialisations).

  lb.safetensors       linear_lower_bound -5.0 (the safe gate); the conv as the
                       checkpoint stores it (q_conv1d, k_conv1d, v_conv1d
                       [C, 1, 4]), the forget gate's tensors directly under
                       self_attn (f_a_proj, f_b_proj, dt_bias, A_log)
  nolb.safetensors     linear_lower_bound null (the softplus gate); the conv fused
                       (conv1d [3C, 1, 4], transformers' in-memory layout) and the
                       forget gate under self_attn.forget_gate.
  mixed.safetensors    as lb (its own weights), with the projections in mixed
                       compressed-tensors pack-quantized formats, each decided by
                       the file alone (no quantization_config): q_proj and o_proj
                       int4 group 32, k_proj, f_a_proj and b_proj int8 per
                       channel, f_b_proj and g_b_proj int4 group 16, v_proj and
                       g_a_proj bf16. The goldens run the dequantized values
                       (round to nearest: scale = bf16(absmax / 7.5 or 127.5),
                       q = round-half-even(bf16(w / scale)), w = bf16(q scale)).

Each file holds, besides the weights (prefix model.layers.0.self_attn.):
  x          [150, 64]  the layer's input (150 tokens: the reference's prefill runs
                        64-token chunks, so this crosses two chunk boundaries)
  out        [150, 64]  the module's output for x in one pass (no cache: the
                        chunked form, chunk_kimi_delta_attention)
  state      [4, 16, 16] the recurrent state after x (S[h][k][v])
  conv_tail  [3, 192]   the last 3 projected inputs q|k|v before the next token
                        (oldest first)
  dec_x      [4, 64]    four decode tokens after x
  dec_out    [4, 64]    their outputs, one token at a time through the module's
                        decode path (causal_conv1d_update,
                        recurrent_kimi_delta_attention) from the state above
  dec_state  [4, 16, 16] the state after them
The script checks the decode outputs against one forward over x + dec_x.
"""
import os, sys
import torch
from safetensors.torch import save_file
from transformers.models.glm5_next import modeling_glm5_next as M
from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = sys.argv[1] if len(sys.argv) > 1 else HERE
N, ND = 150, 4
PFX = "model.layers.0.self_attn."


def make(lower_bound, seed):
    torch.manual_seed(seed)
    cfg = Glm5NextTextConfig(hidden_size=64, linear_num_heads=4, linear_head_dim=16, linear_conv_kernel_dim=4,
                             linear_lower_bound=lower_bound, rms_norm_eps=1e-5, hidden_act="silu",
                             num_hidden_layers=1, layer_types=["linear_attention"], mlp_layer_types=["dense"])
    m = M.Glm5NextTextLinearAttention(cfg, 0).float().eval()
    with torch.no_grad():
        for lin in (m.q_proj, m.k_proj, m.v_proj, m.b_proj, m.g_a_proj, m.g_b_proj, m.o_proj,
                    m.forget_gate.f_a_proj, m.forget_gate.f_b_proj):
            lin.weight.copy_(lin.weight.to(torch.bfloat16).float())
        m.conv1d.weight.copy_(torch.randn_like(m.conv1d.weight) * 0.4)
        m.forget_gate.dt_bias.copy_(torch.randn(m.qkv_dim) * 0.5)
        m.forget_gate.A_log.copy_(torch.log(torch.empty(m.num_heads).uniform_(1, 16)))
        m.o_norm.weight.copy_(1 + 0.2 * torch.randn(m.head_dim))
    return cfg, m


def rtn(w, bits, group):
    """compressed-tensors pack-quantized, symmetric round to nearest: the
    packed words [out, in*bits/32] (q + 2^(bits-1), low bits first), the bf16
    scales [out, in/group], and the dequantized weight."""
    out, inp = w.shape
    g = group or inp
    wb = w.to(torch.bfloat16).float().view(out, inp // g, g)
    qmax = 7.5 if bits == 4 else 127.5
    scale = (wb.abs().amax(-1, keepdim=True) / qmax).to(torch.bfloat16).float()
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = torch.round((wb / scale).to(torch.bfloat16).float())
    q = q.clamp(-(1 << (bits - 1)), (1 << (bits - 1)) - 1)
    deq = (q * scale).to(torch.bfloat16).float().view(out, inp)
    u = (q.view(out, inp) + (1 << (bits - 1))).to(torch.int64)
    per = 32 // bits
    u = u.view(out, inp // per, per)
    words = torch.zeros(out, inp // per, dtype=torch.int64)
    for i in range(per):
        words |= u[:, :, i] << (bits * i)
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    return words, scale.view(out, inp // g).to(torch.bfloat16), deq


MIXED = {"q_proj": (4, 32), "o_proj": (4, 32), "k_proj": (8, 0), "f_a_proj": (8, 0), "b_proj": (8, 0),
         "f_b_proj": (4, 16), "g_b_proj": (4, 16)}


def pieces(m, x):
    """The module's forward spelled out (the same calls), returning what it
    keeps: the output, the conv inputs and the final recurrent state."""
    qkv = torch.cat([m.q_proj(x), m.k_proj(x), m.v_proj(x)], dim=-1).transpose(1, 2)
    conv = M.causal_conv1d_fn(qkv, m.conv1d.weight.squeeze(1), None, activation="silu")
    q, k, v = torch.split(conv.transpose(1, 2), [m.qkv_dim] * 3, dim=-1)
    shp = (1, x.shape[1], -1, m.head_dim)
    g = m.forget_gate(x)
    beta = torch.sigmoid(m.b_proj(x))
    o, state = M.chunk_kimi_delta_attention(q.reshape(shp), k.reshape(shp), v.reshape(shp), g=g, beta=beta,
                                            initial_state=None, output_final_state=True,
                                            use_qk_l2norm_in_kernel=True)
    gate = m.g_b_proj(m.g_a_proj(x)).view(shp)
    out = m.o_proj(m.o_norm(o, gate).reshape(1, x.shape[1], -1))
    return out, qkv, state


@torch.no_grad()
def golden(name, lower_bound, seed, fused, mixed=False):
    cfg, m = make(lower_bound, seed)
    packed = {}
    if mixed:
        mods = {"q_proj": m.q_proj, "k_proj": m.k_proj, "b_proj": m.b_proj, "g_b_proj": m.g_b_proj,
                "o_proj": m.o_proj, "f_a_proj": m.forget_gate.f_a_proj, "f_b_proj": m.forget_gate.f_b_proj}
        for nm, (bits, group) in MIXED.items():
            words, scale, deq = rtn(mods[nm].weight, bits, group)
            mods[nm].weight.copy_(deq)
            packed[nm] = (words, scale, mods[nm].weight.shape)
    K, C = cfg.linear_conv_kernel_dim, m.qkv_dim
    x = torch.randn(1, N, cfg.hidden_size)
    dec_x = torch.randn(1, ND, cfg.hidden_size)
    ref = m(x)
    out, qkv, state = pieces(m, x)
    assert torch.equal(out, ref), "the spelled-out forward differs from the module's"
    # decode, the module's own per-token path
    conv_state = qkv[:, :, -(K - 1):].clone()          # [1, 3C, K-1]
    S = state.clone()
    dec_out = []
    for i in range(ND):
        xi = dec_x[:, i:i + 1]
        qkv_i = torch.cat([m.q_proj(xi), m.k_proj(xi), m.v_proj(xi)], dim=-1).transpose(1, 2)
        cv = M.causal_conv1d_update(qkv_i, conv_state, m.conv1d.weight.squeeze(1), None, activation="silu")
        q, k, v = torch.split(cv.transpose(1, 2), [C] * 3, dim=-1)
        shp = (1, 1, -1, m.head_dim)
        o, S = M.recurrent_kimi_delta_attention(q.reshape(shp), k.reshape(shp), v.reshape(shp),
                                                g=m.forget_gate(xi), beta=torch.sigmoid(m.b_proj(xi)),
                                                initial_state=S, output_final_state=True,
                                                use_qk_l2norm_in_kernel=True)
        gate = m.g_b_proj(m.g_a_proj(xi)).view(shp)
        dec_out.append(m.o_proj(m.o_norm(o, gate).reshape(1, 1, -1)))
    dec_out = torch.cat(dec_out, dim=1)
    full = m(torch.cat([x, dec_x], dim=1))[:, N:]
    rel = ((dec_out - full).abs().max() / full.abs().max()).item()
    assert rel < 1e-4, f"decode vs one pass: {rel}"
    print(f"{name}: decode vs one pass rel {rel:.2e}, |out| max {out.abs().max():.3f}")

    t = {}
    fg = "" if not fused else "forget_gate."
    for nm, lin in (("q_proj", m.q_proj), ("k_proj", m.k_proj), ("v_proj", m.v_proj), ("b_proj", m.b_proj),
                    ("g_a_proj", m.g_a_proj), ("g_b_proj", m.g_b_proj), ("o_proj", m.o_proj),
                    (fg + "f_a_proj", m.forget_gate.f_a_proj), (fg + "f_b_proj", m.forget_gate.f_b_proj)):
        if nm in packed:
            words, scale, shape = packed[nm]
            t[PFX + nm + ".weight_packed"] = words.contiguous()
            t[PFX + nm + ".weight_scale"] = scale.contiguous()
            t[PFX + nm + ".weight_shape"] = torch.tensor(list(shape), dtype=torch.int64)
        else:
            t[PFX + nm + ".weight"] = lin.weight.to(torch.bfloat16).contiguous()
    t[PFX + fg + "dt_bias"] = m.forget_gate.dt_bias.clone()
    t[PFX + fg + "A_log"] = m.forget_gate.A_log.clone()
    t[PFX + "o_norm.weight"] = m.o_norm.weight.clone()
    w = m.conv1d.weight  # [3C, 1, K]
    if fused:
        t[PFX + "conv1d.weight"] = w.clone()
    else:
        for i, p in enumerate("qkv"):
            t[PFX + p + "_conv1d.weight"] = w[i * C:(i + 1) * C].clone()
    t["x"] = x[0].contiguous()
    t["out"] = out[0].contiguous()
    t["state"] = state[0].contiguous()
    t["conv_tail"] = qkv[0, :, -(K - 1):].transpose(0, 1).contiguous()
    t["dec_x"] = dec_x[0].contiguous()
    t["dec_out"] = dec_out[0].contiguous()
    t["dec_state"] = S[0].contiguous()
    save_file(t, os.path.join(OUT, name + ".safetensors"),
              metadata={"linear_lower_bound": "null" if lower_bound is None else str(lower_bound),
                        "hidden_size": "64", "linear_num_heads": "4", "linear_head_dim": "16",
                        "linear_conv_kernel_dim": "4", "rms_norm_eps": "1e-5"})


golden("lb", -5.0, 51, fused=False)
golden("nolb", None, 52, fused=True)
golden("mixed", -5.0, 53, fused=False, mixed=True)
