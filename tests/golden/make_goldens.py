#!/usr/bin/env python3
"""Makes the parity goldens with HF transformers (run on the GPU host, where
transformers and torch are; the gguf package is carried as a wheel).

  python3 tests/golden/make_goldens.py GGUF_PATH OUTDIR

Writes:
  OUTDIR/smollm2_golden.json      default model (GGUF, dequantized by transformers' gguf path)
  OUTDIR/tiny-<arch>/             random-weight HF checkpoints (llama with llama3 rope scaling,
                                  qwen2 with qkv bias, qwen3 with q/k norm and tied embeddings),
                                  each with its golden.json

golden.json: {"model", "prompts": [{"text", "ids", "top_ids", "top_logits", "greedy"}]}
top_* hold HF's 20 largest logits at every input position (float32 model on the CPU);
greedy is the 64-token argmax continuation, no EOS stop.
"""
import json, os, sys, shutil
import torch
import transformers
from transformers import AutoTokenizer, AutoModelForCausalLM

torch.manual_seed(1234)
torch.backends.cuda.matmul.allow_tf32 = False
K, N_GREEDY = 20, 64

PROMPTS = [
    "The capital of France is",
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nWrite a haiku about rivers.<|im_end|>\n<|im_start|>assistant\n",
    "Sluices control the flow of water in canals. When a boat travels upstream, the lower gate opens, "
    "the boat enters the lock chamber, and the gate closes behind it. Water then flows in through the "
    "upper sluice until the level matches the upper canal — a process that takes 8 to 15 minutes. Why?",
]


@torch.no_grad()
def golden(model, tok, name, prompts):
    out = {"model": name, "transformers": transformers.__version__, "prompts": []}
    for text in prompts:
        ids = tok(text, add_special_tokens=True)["input_ids"]
        x = torch.tensor([ids])
        logits = model(x).logits[0].float()
        top = torch.topk(logits, K, dim=-1)
        # greedy continuation with the KV cache, no EOS stop
        res = model(x, use_cache=True)
        past, nxt, greedy = res.past_key_values, int(res.logits[0, -1].argmax()), []
        for _ in range(N_GREEDY):
            greedy.append(nxt)
            res = model(torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
            past, nxt = res.past_key_values, int(res.logits[0, -1].argmax())
        out["prompts"].append({
            "text": text, "ids": ids,
            "top_ids": top.indices.tolist(),
            "top_logits": [[float(v) for v in row] for row in top.values],
            "greedy": greedy,
            "greedy_text": tok.decode(greedy),
        })
        print(name, repr(text[:30]), len(ids), "ids ->", repr(tok.decode(greedy[:12])), flush=True)
    return out


def main():
    gguf_path, outdir = sys.argv[1], sys.argv[2]
    os.makedirs(outdir, exist_ok=True)
    d, f = os.path.dirname(os.path.abspath(gguf_path)), os.path.basename(gguf_path)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    with open(os.path.join(outdir, "smollm2_golden.json"), "w") as fh:
        json.dump(golden(model, tok, "SmolLM2-135M-Instruct.Q4_1.gguf", PROMPTS), fh)
    del model

    common = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                  rms_norm_eps=1e-6, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    tiny = {
        "tiny-llama": (transformers.LlamaConfig(
            **common, rope_theta=500000.0, tie_word_embeddings=False,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
            torch.bfloat16),
        "tiny-qwen2": (transformers.Qwen2Config(**common, rope_theta=10000.0, tie_word_embeddings=True),
                       torch.float16),
        "tiny-qwen3": (transformers.Qwen3Config(**common, head_dim=16, rope_theta=1000000.0,
                                                tie_word_embeddings=True), torch.float32),
    }
    for name, (cfg, dtype) in tiny.items():
        m = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        with torch.no_grad():
            for pname, p in m.named_parameters():
                if p.dim() == 1:  # norms and biases: random so a missing one shows
                    p.copy_((1.0 if "norm" in pname else 0.0) + 0.2 * torch.randn_like(p))
                else:
                    p.copy_(0.15 * torch.randn_like(p))
        path = os.path.join(outdir, name)
        shutil.rmtree(path, ignore_errors=True)
        m.to(dtype).save_pretrained(path, safe_serialization=True)
        tok.save_pretrained(path)
        # reload in float32 from what was saved so the golden sees the rounded weights
        m2 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with open(os.path.join(path, "golden.json"), "w") as fh:
            json.dump(golden(m2, tok, name, PROMPTS), fh)


if __name__ == "__main__":
    main()
