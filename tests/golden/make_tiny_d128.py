#!/usr/bin/env python3
"""Makes tests/models/tiny-qwen3-d128 and its golden.json with HF transformers
(run on the GPU host, where transformers and torch are):

  python3 tests/golden/make_tiny_d128.py OUTDIR

A random-weight qwen3 with the attention geometry of Qwen3-8B and
Llama-3.1-8B (head_dim 128, 4 query heads per KV head) and nothing else
large (hidden 64, 2 layers, bf16, tied embeddings, tiny-llama's tokenizer):
the GPU backend's head_dim-128 kernels (the warpgroup prefill attention, with
either KV cache) then run end to end against the CPU backend and HF, which
the other tiny models (head_dim 8 and 16) never reach. Weights and golden
as make_goldens.py makes them (its golden() and PROMPTS).
"""
import json, os, shutil, sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from make_goldens import PROMPTS, golden

torch.manual_seed(128)
here = os.path.dirname(os.path.abspath(__file__))
path = sys.argv[1]
tok = AutoTokenizer.from_pretrained(os.path.join(here, "..", "models", "tiny-llama"))
cfg = transformers.Qwen3Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=1, head_dim=128,
                               max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1000000.0,
                               tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
m = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
with torch.no_grad():
    for pname, p in m.named_parameters():
        if p.dim() == 1:  # norms: random so a missing one shows
            p.copy_((1.0 if "norm" in pname else 0.0) + 0.2 * torch.randn_like(p))
        else:
            p.copy_(0.15 * torch.randn_like(p))
shutil.rmtree(path, ignore_errors=True)
m.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
tok.save_pretrained(path)
# reload in float32 from what was saved so the golden sees the rounded weights
m2 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
with open(os.path.join(path, "golden.json"), "w") as fh:
    json.dump(golden(m2, tok, "tiny-qwen3-d128", PROMPTS), fh)
# in git, tokenizer.json is a link to tiny-llama's (the same file)
