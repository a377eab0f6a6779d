#!/usr/bin/env python3
"""Makes tests/models/kda/glm5-kda: a tiny glm5_next text model whose layers are
mostly KDA, and its golden.json, for tests/test_kda.c's model and engine tests.

  /path/to/venv/bin/python tests/golden/kda/make_glm5_kda.py [OUTDIR]

Needs torch and transformers 5.25 (glm5_next); CI never runs this.

Glm5NextTextModel at hidden 64, 4 layers (KDA, KDA, MLA, KDA: layer_types
linear_attention x2, indexed_attention, linear_attention), every FFN dense,
hc_mult 4 hyper-connections, KDA 4 heads x 16 with the lower-bounded gate, MLA
without RoPE and with an indexer whose index_topk (4096) passes every prompt
(so every key is attended), on the 384-token byte-level vocabulary of
tests/models/quant (its tokenizer.json is linked, not copied). The logits are
lm_head(model(ids)) with a separate random lm_head. Every parameter is drawn at
random (norm weights about 1), rounded to bf16, saved in bf16 under the
checkpoint's own names (conversion_mapping.py's glm5_next renamings reversed:
q/k/v_conv1d, f_a_proj, f_b_proj, dt_bias and A_log directly under self_attn,
hc_attn_fn ...), and the goldens run those bf16 values in float32.

golden.json: as tests/golden/make_goldens.py ({"prompts": [{"ids", "top_ids",
"top_logits", "greedy"}]}): the top 20 logits at every position, 16 greedy
tokens by full forwards. The 100-token prompt crosses the reference's 64-token
KDA chunks.
"""
import json, os, shutil, sys
import torch
from safetensors.torch import save_file
from transformers.models.glm5_next import modeling_glm5_next as M
from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig

torch.manual_seed(5353)
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
OUT = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "tests", "models", "kda")
TOKDIR = os.path.join(ROOT, "tests", "models", "quant", "ct-w4g32-sym")
K, N_GREEDY = 20, 16
PROMPTS = [
    [5, 17, 42, 99, 150, 201, 33, 7],
    [(i * 37 + 11) % 383 + 1 for i in range(100)],
    [(i * 53 + 3) % 383 + 1 for i in range(40)],
]

CFG = dict(vocab_size=384, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
           num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=0, qk_nope_head_dim=16,
           v_head_dim=16, layer_types=["linear_attention", "linear_attention", "indexed_attention",
                                        "linear_attention"],
           mlp_layer_types=["dense"] * 4, linear_num_heads=4, linear_head_dim=16, linear_conv_kernel_dim=4,
           linear_lower_bound=-5.0, hc_mult=4, hc_sinkhorn_iters=20, index_topk=4096, index_n_heads=8,
           index_head_dim=16, rms_norm_eps=1e-5, max_position_embeddings=4096, pad_token_id=None,
           bos_token_id=None, eos_token_id=0, tie_word_embeddings=False)


def file_name(k):
    """The checkpoint's name of a Glm5NextTextModel parameter."""
    k = "model." + k
    for a, b in (("self_attn.forget_gate.", "self_attn."), (".attn_hc.fn", ".hc_attn_fn"),
                 (".attn_hc.base", ".hc_attn_base"), (".attn_hc.scale", ".hc_attn_scale"),
                 (".ffn_hc.fn", ".hc_ffn_fn"), (".ffn_hc.base", ".hc_ffn_base"), (".ffn_hc.scale", ".hc_ffn_scale")):
        k = k.replace(a, b)
    return k


@torch.no_grad()
def main():
    cfg = Glm5NextTextConfig(**CFG)
    model = M.Glm5NextTextModel(cfg).float().eval()
    lm_head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
    for name, p in list(model.named_parameters()) + [("lm_head.weight", lm_head.weight)]:
        if p.dim() == 1:
            base = 1.0 if "norm" in name else 0.0
            p.copy_(base + 0.2 * torch.randn_like(p))
        else:
            p.copy_(0.15 * torch.randn_like(p))
        p.copy_(p.to(torch.bfloat16).float())

    def logits(ids):
        return lm_head(model(torch.tensor([ids])).last_hidden_state)[0].float()

    out = {"model": "glm5-kda", "prompts": []}
    for ids in PROMPTS:
        lg = logits(ids)
        top = torch.topk(lg, K, dim=-1)
        seq, greedy = list(ids), []
        for _ in range(N_GREEDY):
            nxt = int(logits(seq)[-1].argmax())
            greedy.append(nxt)
            seq.append(nxt)
        out["prompts"].append({"ids": ids, "top_ids": top.indices.tolist(),
                               "top_logits": [[float(v) for v in row] for row in top.values], "greedy": greedy})
        print(len(ids), "ids ->", greedy, flush=True)

    path = os.path.join(OUT, "glm5-kda")
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    C = cfg.linear_num_heads * cfg.linear_head_dim
    t = {}
    for k, v in model.state_dict().items():
        v = v.to(torch.bfloat16).contiguous()
        if k.endswith("self_attn.conv1d.weight"):  # the checkpoint keeps q, k and v apart
            for i, part in enumerate("qkv"):
                t[file_name(k).replace("conv1d", part + "_conv1d")] = v[i * C:(i + 1) * C].contiguous()
        else:
            t[file_name(k)] = v
    t["lm_head.weight"] = lm_head.weight.to(torch.bfloat16).contiguous()
    save_file(t, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    c = cfg.to_dict()
    c["model_type"] = "glm5_next_text"
    c["architectures"] = ["Glm5NextTextModel"]
    c["torch_dtype"] = "bfloat16"
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(c, fh, indent=1)
    os.symlink("../../quant/ct-w4g32-sym/tokenizer.json", os.path.join(path, "tokenizer.json"))
    shutil.copy(os.path.join(TOKDIR, "tokenizer_config.json"), path)
    with open(os.path.join(path, "golden.json"), "w") as fh:
        json.dump(out, fh)


if __name__ == "__main__":
    main()
