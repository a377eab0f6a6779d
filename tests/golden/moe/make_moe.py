#!/usr/bin/env python3
"""Makes the mixture-of-experts test checkpoints and their goldens (tests/models/tiny-*-moe*).

  /work/venv-quant/bin/python tests/golden/moe/make_moe.py [OUTDIR]   (default tests/models)

Needs torch, transformers (5.25) and compressed-tensors (a venv outside the repository; CI never runs this,
the tests read what it wrote). The tokenizer is the 347-token byte-level BPE of tests/models/quant (a link).

Checkpoints (weights random, rounded to bf16 and saved as bf16; norms, biases and the router's correction bias
perturbed so a missing one shows):
- tiny-qwen3-moe: qwen3_moe, 16 experts top-4, norm_topk_prob, layer 0 dense (mlp_only_layers), per-expert
  tensors as transformers saves them.
- tiny-qwen3-moe-fused: qwen3_moe without norm_topk_prob, decoder_sparse_step 2 (layers 1 and 3 sparse),
  stored in transformers 5's in-memory fused layout (experts.gate_up_proj [E][2F][H], experts.down_proj
  [E][H][F]), as some exports save it.
- tiny-glm4-moe: glm4_moe, 16 experts in 4 groups, top-4 of the best 2 groups, sigmoid router with correction
  bias, routed_scaling_factor 2.5, one shared expert, first layer dense, q/k/v bias, q/k norm, half-rotary RoPE.
  The script checks that transformers' DeepseekV3MoE given these weights routes exactly as Glm4MoeMoE does and
  computes the same output to float rounding
  (deepseek_v3's MoE block is this one).
- tiny-qwen2-moe: qwen2_moe, 8 experts top-2 without renormalisation, a shared expert of its own width
  (shared_expert_intermediate_size) weighed by sigmoid(shared_expert_gate), q/k/v bias, layer 0 dense.
- tiny-qwen3-moe-w4: tiny-qwen3-moe's weights with the routed experts int4 group 16 symmetric
  (compressed-tensors pack-quantized, quantized with the library's own qparams/quantize/pack_to_int32), except
  the experts `ignore` lists (expert 0 of every layer: bf16). Golden through the dense path: transformers runs
  the library's dequantization of the packed experts (it does not load quantized MoE checkpoints dependably).
- tiny-qwen3-moe-awq: the same weights with every linear layer AutoAWQ int4 g16 (GEMM layout, zero points),
  experts included, routers dense; golden through the dense path (AutoAWQ's dequantization transcribed in
  tests/golden/quant/make_quant.py).

golden.json: {"model", "prompts": [{"ids", "top_ids", "top_logits", "greedy"}], "min_route_margin"}: top_* are
transformers' 20 largest logits at every position (float32 model on the CPU), greedy the 16-token argmax
continuation with the KV cache. min_route_margin is the smallest gap, over every token and MoE layer of the
prompts, between the last chosen expert's choice score and the best unchosen one: a near-tie there could flip a
choice between implementations; it is printed so a tight one is seen.
"""
import json, os, shutil, sys

import torch
import transformers
from safetensors.torch import load_file, save_file
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize
from compressed_tensors.quantization.utils.helpers import calculate_qparams

K, N_GREEDY = 20, 16
HERE = os.path.dirname(os.path.abspath(__file__))
TOKDIR = "quant/ct-w4g32-sym"  # relative to OUTDIR
PROMPTS = [[5, 17, 42, 99, 150], [200, 33, 7, 8, 300, 12, 64, 77, 101, 250, 3, 19],
           [60, 61, 62, 63, 10, 20, 30, 40, 50, 70, 80, 90, 110, 120, 130, 140, 160, 170, 180, 190]]

COMMON = dict(vocab_size=347, hidden_size=64, intermediate_size=96, moe_intermediate_size=16,
              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=0,
              pad_token_id=None, tie_word_embeddings=False)


def qwen3(**kw):
    return transformers.Qwen3MoeConfig(**COMMON, num_experts=16, num_experts_per_tok=4,
                                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **kw)


def qwen2():
    return transformers.Qwen2MoeConfig(**COMMON, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
                                       shared_expert_intermediate_size=24, decoder_sparse_step=1, mlp_only_layers=[0],
                                       qkv_bias=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def glm4():
    return transformers.Glm4MoeConfig(**{**COMMON, "num_hidden_layers": 3}, n_routed_experts=16,
                                      num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1,
                                      routed_scaling_factor=2.5, first_k_dense_replace=1, norm_topk_prob=True,
                                      attention_bias=True, use_qk_norm=True,
                                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                       "partial_rotary_factor": 0.5})


def build(cfg, seed):
    torch.manual_seed(seed)
    m = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if p.dim() == 1:
                p.copy_((1.0 if "norm" in n else 0.0) + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
        for n, b in m.named_buffers():
            if n.endswith("e_score_correction_bias"):  # small: it moves choices without swamping the scores
                b.copy_(0.05 * torch.randn_like(b))
    return m


def route_margins(m, ids):
    """Smallest gap between the k-th chosen and the best unchosen choice score, over every MoE layer and token."""
    margins = []
    hooks = []

    def hook(mod, inp, out):
        x = inp[0].reshape(-1, inp[0].shape[-1]).float()
        logits = x @ mod.weight.float().t()
        if hasattr(mod, "e_score_correction_bias"):
            s = logits.sigmoid() + mod.e_score_correction_bias
            g = s.view(-1, mod.num_group, mod.num_experts // mod.num_group)
            gs = g.topk(2, dim=-1)[0].sum(-1)
            keep = torch.zeros_like(gs).scatter_(1, gs.topk(mod.topk_group, dim=-1)[1], 1)
            s = s.masked_fill(~keep.unsqueeze(-1).expand_as(g).reshape(s.shape).bool(), float("-inf"))
        else:
            s = logits.softmax(-1)
        v = s.sort(-1, descending=True).values
        margins.append(float((v[:, mod.top_k - 1] - v[:, mod.top_k]).min()))
    for mod in m.modules():
        if type(mod).__name__.endswith(("TopKRouter", "TopkRouter")):
            hooks.append(mod.register_forward_hook(hook))
    with torch.no_grad():
        m(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return min(margins)


@torch.no_grad()
def golden(m, name):
    out = {"model": name, "transformers": transformers.__version__, "prompts": []}
    margin = 1e9
    for ids in PROMPTS:
        x = torch.tensor([ids])
        logits = m(x).logits[0].float()
        top = torch.topk(logits, K, dim=-1)
        res = m(x, use_cache=True)
        past, nxt, greedy = res.past_key_values, int(res.logits[0, -1].argmax()), []
        for _ in range(N_GREEDY):
            greedy.append(nxt)
            res = m(torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
            past, nxt = res.past_key_values, int(res.logits[0, -1].argmax())
        margin = min(margin, route_margins(m, ids + greedy))
        out["prompts"].append({"ids": ids, "top_ids": top.indices.tolist(),
                               "top_logits": [[float(v) for v in row] for row in top.values], "greedy": greedy})
    out["min_route_margin"] = margin
    print(f"{name}: min routing margin {margin:.2e}, greedy {out['prompts'][0]['greedy'][:8]}", flush=True)
    return out


def save(m, path, outdir):
    shutil.rmtree(path, ignore_errors=True)
    m.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    os.symlink(os.path.join("..", TOKDIR, "tokenizer.json"), os.path.join(path, "tokenizer.json"))
    shutil.copy(os.path.join(outdir, TOKDIR, "tokenizer_config.json"), os.path.join(path, "tokenizer_config.json"))
    for extra in ("generation_config.json",):
        if os.path.exists(os.path.join(path, extra)):
            os.remove(os.path.join(path, extra))


def write_golden(path, g):
    with open(os.path.join(path, "golden.json"), "w") as f:
        json.dump(g, f)


def reload(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def fuse(path, cfg):
    """Rewrites path/model.safetensors with the experts in transformers 5's fused layout."""
    sd = load_file(os.path.join(path, "model.safetensors"))
    E = cfg.num_experts
    for l in range(cfg.num_hidden_layers):
        p = f"model.layers.{l}.mlp.experts"
        if f"{p}.0.gate_proj.weight" not in sd:
            continue
        gu = [torch.cat([sd.pop(f"{p}.{e}.gate_proj.weight"), sd.pop(f"{p}.{e}.up_proj.weight")], 0) for e in range(E)]
        dn = [sd.pop(f"{p}.{e}.down_proj.weight") for e in range(E)]
        sd[f"{p}.gate_up_proj"] = torch.stack(gu).contiguous()
        sd[f"{p}.down_proj"] = torch.stack(dn).contiguous()
    save_file(sd, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})


def quantize_experts(src, path, cfg, outdir, group=16):
    """int4 g16 sym experts (expert 0 of every layer left bf16 through ignore); returns the dense reference model."""
    shutil.rmtree(path, ignore_errors=True)
    shutil.copytree(src, path, symlinks=True)
    os.remove(os.path.join(path, "golden.json"))
    sd = load_file(os.path.join(path, "model.safetensors"))
    dense = {k: v.to(torch.float32) for k, v in sd.items()}
    args = QuantizationArgs(num_bits=4, symmetric=True, strategy="group", group_size=group)
    for name in sorted(k for k in sd if ".mlp.experts." in k):
        if ".experts.0." in name:
            continue
        mod = name[:-len(".weight")]
        w = sd.pop(name)
        g = w.unflatten(-1, (w.shape[-1] // group, group))
        s, z = calculate_qparams(torch.amin(g, dim=-1), torch.amax(g, dim=-1), args)
        q = quantize(w, s, None, args, dtype=torch.int8)
        sd[mod + ".weight_packed"] = pack_to_int32(q, 4)
        sd[mod + ".weight_scale"] = s.to(torch.bfloat16)
        sd[mod + ".weight_shape"] = torch.tensor(list(w.shape), dtype=torch.int64)
        dense[name] = dequantize(q, s.to(torch.bfloat16), None, args).to(torch.float32)
    save_file(sd, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        c = json.load(f)
    c["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["re:.*mlp\\.experts\\..*"], "format": "pack-quantized",
                                      "weights": json.loads(args.model_dump_json()),
                                      "input_activations": None, "output_activations": None}},
        "ignore": ["lm_head", "re:.*mlp\\.gate$", "re:.*mlp\\.experts\\.0\\..*"]}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(c, f, indent=2, sort_keys=True)
    m = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    # transformers fuses the per-expert tensors on load; from_pretrained on a dense copy does the same here
    tmp = path + ".dense"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    save_file({k: v.contiguous() for k, v in dense.items()}, os.path.join(tmp, "model.safetensors"),
              metadata={"format": "pt"})
    cfg.save_pretrained(tmp)
    m = reload(tmp)
    shutil.rmtree(tmp)
    return m


@torch.no_grad()
def check_deepseek_v3_block(glm):
    """deepseek_v3's MoE block is glm4_moe's (same router, experts, shared experts): the same weights give the
    same output, so the glm4_moe goldens cover it."""
    c = glm.config
    dcfg = transformers.DeepseekV3Config(hidden_size=c.hidden_size, moe_intermediate_size=c.moe_intermediate_size,
                                         n_routed_experts=c.n_routed_experts, num_experts_per_tok=c.num_experts_per_tok,
                                         n_group=c.n_group, topk_group=c.topk_group, n_shared_experts=c.n_shared_experts,
                                         routed_scaling_factor=c.routed_scaling_factor, norm_topk_prob=True)
    ds = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3MoE(dcfg).float().eval()
    src = glm.model.layers[1].mlp
    ds.load_state_dict(src.state_dict(), strict=True)
    x = torch.randn(1, 32, c.hidden_size)
    _, w1, i1 = ds.gate(x)
    _, w2, i2 = src.gate(x)
    assert torch.equal(i1, i2) and torch.equal(w1, w2), "deepseek_v3's router chooses differently from glm4_moe's"
    y = src(x)
    d = ((ds(x) - y).abs().max() / y.abs().max()).item()
    assert d < 1e-5, f"deepseek_v3's MoE block differs from glm4_moe's by {d} relative"
    print(f"deepseek_v3 MoE block: same routing as glm4_moe's, output within {d:.1e} relative", flush=True)


def awq_layers(src, path, cfg, group=16):
    """Every nn.Linear inside the layers AutoAWQ-packed (int4 g16 asym, GEMM layout), the routers left dense
    (transformers 5's routers are not nn.Linear); returns the dense reference model (the transcribed AutoAWQ
    dequantization of what was packed)."""
    sys.path.insert(0, os.path.join(HERE, "..", "quant"))
    from make_quant import awq_pack, awq_dequantize_gemm, rtn_asym_u
    shutil.rmtree(path, ignore_errors=True)
    shutil.copytree(src, path, symlinks=True)
    os.remove(os.path.join(path, "golden.json"))
    sd = load_file(os.path.join(path, "model.safetensors"))
    dense = {k: v.to(torch.float32) for k, v in sd.items()}
    for name in sorted(k for k in sd if k.startswith("model.layers.") and k.endswith("_proj.weight")):
        mod = name[:-len(".weight")]
        w = sd.pop(name)
        q, z, sc = rtn_asym_u(w, 4, group, torch.float16)
        qweight, qzeros, scales = awq_pack(q.t().contiguous()), awq_pack(z.t().contiguous()), sc.t().contiguous()
        sd[mod + ".qweight"], sd[mod + ".qzeros"], sd[mod + ".scales"] = qweight, qzeros, scales
        dense[name] = awq_dequantize_gemm(qweight, qzeros, scales, 4, group).t().contiguous().to(torch.float32)
    save_file(sd, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        c = json.load(f)
    c["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                                "version": "gemm", "modules_to_not_convert": None}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(c, f, indent=2, sort_keys=True)
    tmp = path + ".dense"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    save_file({k: v.contiguous() for k, v in dense.items()}, os.path.join(tmp, "model.safetensors"),
              metadata={"format": "pt"})
    cfg.save_pretrained(tmp)
    m = reload(tmp)
    shutil.rmtree(tmp)
    return m


def main():
    outdir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "..", "..", "models")
    outdir = os.path.abspath(outdir)
    specs = [("tiny-qwen3-moe", qwen3(norm_topk_prob=True, mlp_only_layers=[0]), 11),
             ("tiny-qwen3-moe-fused", qwen3(norm_topk_prob=False, decoder_sparse_step=2), 12),
             ("tiny-glm4-moe", glm4(), 13),
             ("tiny-qwen2-moe", qwen2(), 14)]
    for name, cfg, seed in specs:
        path = os.path.join(outdir, name)
        save(build(cfg, seed), path, outdir)
        ref = reload(path)
        write_golden(path, golden(ref, name))
        if name == "tiny-glm4-moe":
            check_deepseek_v3_block(ref)
        if name.endswith("-fused"):
            fuse(path, cfg)
    name = "tiny-qwen3-moe-w4"
    path = os.path.join(outdir, name)
    m = quantize_experts(os.path.join(outdir, "tiny-qwen3-moe"), path, specs[0][1], outdir)
    write_golden(path, golden(m, name))
    name = "tiny-qwen3-moe-awq"
    path = os.path.join(outdir, name)
    m = awq_layers(os.path.join(outdir, "tiny-qwen3-moe"), path, specs[0][1])
    write_golden(path, golden(m, name))


if __name__ == "__main__":
    main()
