#!/usr/bin/env python3
"""Makes the MLA test checkpoints and their goldens (tests/models/mla/).

  /path/to/venv/bin/python tests/golden/mla/make_mla.py [OUTDIR [NAME...]]
      (default tests/models/mla, every checkpoint; names pick some)

Needs torch and transformers (5.25: deepseek_v3 and glm_moe_dsa); CI never runs
this, the tests read what it wrote.

Each checkpoint is a tiny random model (hidden 64, 2-3 layers, every FFN dense:
first_k_dense_replace / mlp_layer_types say so, because the MoE FFN is another
layer kind) on the 384-token byte-level vocabulary of tests/models/quant (its
tokenizer.json is linked, not copied). Weights are saved in bf16 with the norms
perturbed, then reloaded in float32 for the goldens, so the goldens see exactly
the stored values.

  dsv3-qlora      deepseek_v3, q_lora_rank 32, interleaved RoPE, one MTP module
                  appended (model.layers.2.*: random, transformers' main model skips
                  it; tests/models/mtp has the MTP goldens)
  dsv3-noqlora    deepseek_v3, q_proj (no q_lora), rope_interleave false
  dsv3-yarn       deepseek_v3 with YaRN (factor 4 over 32 original positions,
                  mscale 1, mscale_all_dim 0.8: both the cos/sin factor and the
                  softmax scale differ from 1 and from each other)
  dsv3-norope     deepseek_v3 with qk_rope_head_dim 0 (GLM-5.3's MLA: no RoPE); the
                  rotary embedding reads head_dim 0 as unset, so its frequency
                  table is emptied after loading (no rotation at all)
  dsv3-c512       deepseek_v3, one layer, with DeepSeek's latent width (kv_lora_rank 512, rope 16):
                  the shape the GPU's tensor-core prefill attention takes (its own seed,
                  so it is the same made alone or with the others)
  glm-dsa         glm_moe_dsa, 3 layers (indexer full, shared, full), 32 indexer
                  heads, index_topk 6: golden.json has the sparse attention;
                  golden_dense.json the same weights with index_topk above every
                  prompt's length (what index_topk null gives)

golden.json: as tests/golden/make_goldens.py ({"prompts": [{"ids", "top_ids",
"top_logits", "greedy"}]}), 32 greedy tokens. For glm-dsa the indexer's scores
at the top-k boundary are checked for ties (a tie would make the choice of keys,
and so the golden, depend on the sort): over every position of the prompts and
their greedy continuations, the gap between the k-th and the (k+1)-th score
must exceed 1e-4 of the largest score (100 times the float rounding between
two implementations), else the next seed is tried; the gap is printed.
"""
import json, os, sys, shutil
import torch
import transformers
from transformers import AutoModelForCausalLM
from safetensors.torch import load_file, save_file

torch.manual_seed(4321)
K, N_GREEDY = 20, 32
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
TOKDIR = os.path.join(ROOT, "tests", "models", "quant", "ct-w4g32-sym")

# byte-level ids (the vocabulary has 384 tokens); the long one passes the
# YaRN model's 32 original positions well before its end
PROMPTS = [
    [5, 17, 42, 99, 150, 201, 33, 7],
    [200, 33, 7, 8, 300, 12, 64, 77, 101, 250, 3, 19, 44, 45, 46, 120, 121, 380, 2, 9],
    [(i * 37 + 11) % 383 + 1 for i in range(70)],
]

COMMON = dict(vocab_size=384, hidden_size=64, intermediate_size=96, num_attention_heads=4,
              num_key_value_heads=4, max_position_embeddings=512, rms_norm_eps=1e-5,
              bos_token_id=None, eos_token_id=0, tie_word_embeddings=False,
              kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
              n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_group=1, topk_group=1)


@torch.no_grad()
def golden(model, name, prompts):
    out = {"model": name, "transformers": transformers.__version__, "prompts": []}
    for ids in prompts:
        x = torch.tensor([ids])
        logits = model(x).logits[0].float()
        top = torch.topk(logits, K, dim=-1)
        seq, greedy = list(ids), []
        # greedy by full forwards (no cache): the reference for every position
        for _ in range(N_GREEDY):
            nxt = int(model(torch.tensor([seq])).logits[0, -1].argmax())
            greedy.append(nxt)
            seq.append(nxt)
        out["prompts"].append({"ids": ids, "top_ids": top.indices.tolist(),
                               "top_logits": [[float(v) for v in row] for row in top.values],
                               "greedy": greedy})
        print(name, len(ids), "ids ->", greedy[:10], flush=True)
    return out


def randomize(m):
    with torch.no_grad():
        for pname, p in m.named_parameters():
            if p.dim() == 1:
                p.copy_((1.0 if "norm" in pname else 0.0) + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))


def save(m, path, extra=None):
    shutil.rmtree(path, ignore_errors=True)
    m.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    if extra:
        f = os.path.join(path, "model.safetensors")
        sd = load_file(f)
        sd.update(extra)
        save_file(sd, f, metadata={"format": "pt"})
    os.symlink("../../quant/ct-w4g32-sym/tokenizer.json", os.path.join(path, "tokenizer.json"))
    shutil.copy(os.path.join(TOKDIR, "tokenizer_config.json"), path)


def mtp_tensors(m, cfg, layer):
    """A complete MTP module after the last layer, as DeepSeek-V3 checkpoints
    store it (tests/golden/mtp/make_mtp.py makes it: transformers' MtpLayer,
    whose decoder layer is MoE), its values from a generator of its own. The two
    draws of the global RNG keep the later checkpoints' weights what they were
    when this module was a stub of 7 tensors."""
    E = cfg.hidden_size
    torch.randn(E, 2 * E), torch.randn(cfg.intermediate_size, E)
    sys.path.insert(0, os.path.join(HERE, "..", "mtp"))
    from make_mtp import mtp_checkpoint_tensors
    assert layer == cfg.num_hidden_layers
    return mtp_checkpoint_tensors(m, cfg, torch.Generator().manual_seed(4321))[1]


def index_gaps(m, prompts):
    """Smallest relative gap between the k-th and (k+1)-th indexer score over
    every full indexer layer, query and prompt (ties would make the golden
    depend on the sort)."""
    worst = float("inf")
    captured = []

    def hook(mod, args, kwargs, out):
        captured.append((mod, args, kwargs))

    hs = [l.self_attn.indexer.register_forward_hook(hook, with_kwargs=True)
          for l in m.model.layers if l.self_attn.indexer is not None]
    for ids in prompts:
        captured.clear()
        m(torch.tensor([ids]))
        for mod, args, kwargs in captured:
            hsd, q_resid, pe = args[0], args[1], args[2]
            cos, sin = pe
            # recompute the scores as the indexer does, before top-k
            from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import apply_rotary_pos_emb_interleave
            B, S, _ = hsd.shape
            q = mod.wq_b(q_resid).view(B, S, mod.n_heads, mod.head_dim)
            q_rot, q_pass = torch.split(q, [mod.qk_rope_head_dim, mod.head_dim - mod.qk_rope_head_dim], dim=-1)
            k = mod.k_norm(mod.wk(hsd)).unsqueeze(2)
            k_rot, k_pass = torch.split(k, [mod.qk_rope_head_dim, mod.head_dim - mod.qk_rope_head_dim], dim=-1)
            q_rot, k_rot = apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
            q = torch.cat([q_rot, q_pass], dim=-1)
            k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
            sc = torch.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * mod.softmax_scale)
            w = mod.weights_proj(hsd).float() * (mod.n_heads ** -0.5)
            isc = torch.matmul(w.unsqueeze(-2), sc).squeeze(-2)[0]  # [S, T]
            for i in range(S):
                row = isc[i, : i + 1]
                if row.numel() <= mod.index_topk:
                    continue
                v = torch.sort(row, descending=True).values
                gap = float(v[mod.index_topk - 1] - v[mod.index_topk]) / max(float(v.abs().max()), 1e-9)
                worst = min(worst, gap)
    for h in hs:
        h.remove()
    return worst


def main():
    outdir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "tests", "models", "mla")
    only = set(sys.argv[2:])
    os.makedirs(outdir, exist_ok=True)
    DS = transformers.DeepseekV3Config
    models = {
        "dsv3-qlora": DS(**COMMON, num_hidden_layers=2, first_k_dense_replace=2, q_lora_rank=32,
                         rope_interleave=True, num_nextn_predict_layers=1,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        "dsv3-noqlora": DS(**COMMON, num_hidden_layers=2, first_k_dense_replace=2, q_lora_rank=None,
                           rope_interleave=False, num_nextn_predict_layers=0,
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        "dsv3-yarn": DS(**COMMON, num_hidden_layers=2, first_k_dense_replace=2, q_lora_rank=24,
                        rope_interleave=True, num_nextn_predict_layers=0,
                        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                         "original_max_position_embeddings": 32, "beta_fast": 32,
                                         "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8}),
        "dsv3-norope": DS(**{**COMMON, "qk_rope_head_dim": 0}, num_hidden_layers=2, first_k_dense_replace=2,
                          q_lora_rank=32, num_nextn_predict_layers=0,
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        "dsv3-c512": DS(**{**COMMON, "kv_lora_rank": 512, "qk_rope_head_dim": 16}, num_hidden_layers=1,
                        first_k_dense_replace=2, q_lora_rank=32, rope_interleave=True, num_nextn_predict_layers=0,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    }
    seeds = {"dsv3-c512": 512}
    for name, cfg in models.items():
        if only and name not in only:
            continue
        if name in seeds:
            torch.manual_seed(seeds[name])
        try:
            m = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        except Exception as e:  # rope dim 0 may not build: say so, go on
            print(name, "not made:", e)
            continue
        randomize(m)
        path = os.path.join(outdir, name)
        extra = mtp_tensors(m, cfg, cfg.num_hidden_layers) if getattr(cfg, "num_nextn_predict_layers", 0) else None
        save(m, path, extra)
        m2 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        if cfg.qk_rope_head_dim == 0:
            # the rotary embedding reads head_dim 0 as unset and falls back to
            # hidden / heads: an empty frequency table is what rope dim 0 means
            m2.model.rotary_emb.inv_freq = torch.zeros(0)
        try:
            g = golden(m2, name, PROMPTS)
        except Exception as e:
            print(name, "forward failed:", e)
            shutil.rmtree(path)
            continue
        with open(os.path.join(path, "golden.json"), "w") as fh:
            json.dump(g, fh)

    if only and "glm-dsa" not in only:
        return
    GC = transformers.GlmMoeDsaConfig
    gcommon = {k: v for k, v in COMMON.items()}
    gcommon.update(num_hidden_layers=3, q_lora_rank=32, index_n_heads=32, index_head_dim=16, index_topk=6,
                   mlp_layer_types=["dense"] * 3, first_k_dense_replace=3,
                   indexer_types=["full", "shared", "full"], head_dim=8,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    for seed in range(40):
        torch.manual_seed(100 + seed)
        cfg = GC(**gcommon)
        m = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        randomize(m)
        path = os.path.join(outdir, "glm-dsa")
        save(m, path)
        m2 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        g = golden(m2, "glm-dsa", PROMPTS)
        # every position the test checks: the prompts and their greedy continuations
        with torch.no_grad():
            gap = index_gaps(m2, [p["ids"] + p["greedy"] for p in g["prompts"]])
        print("glm-dsa seed", 100 + seed, "smallest top-k boundary gap", gap)
        if gap > 1e-4:
            break
    else:
        sys.exit("no seed without near-ties at the indexer's top-k boundary")
    with open(os.path.join(path, "golden.json"), "w") as fh:
        json.dump(g, fh)
    m2.config.index_topk = 1 << 20
    for l in m2.model.layers:
        if l.self_attn.indexer is not None:
            l.self_attn.indexer.index_topk = 1 << 20
    with open(os.path.join(path, "golden_dense.json"), "w") as fh:
        json.dump(golden(m2, "glm-dsa (index_topk null)", PROMPTS), fh)


if __name__ == "__main__":
    main()
