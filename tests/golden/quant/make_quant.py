#!/usr/bin/env python3
"""Makes the quantized test checkpoints and their goldens (tests/models/quant/).

  python3 tests/golden/quant/make_quant.py [OUTDIR]     (default tests/models/quant)

Needs torch, transformers, compressed-tensors and tokenizers (a venv outside the
repository; CI never runs this, the tests read what it wrote).

Every checkpoint is a tiny random llama (hidden 64, 2 layers, a 384-token
byte-level BPE vocabulary; hidden 128 for group 128), weights rounded to bf16,
norms perturbed. Then:

- compressed-tensors checkpoints are quantized by compressed-tensors itself:
  apply_quantization_config, round-to-nearest scales and zero points from the
  library's calculate_qparams over each group's min/max (what llmcompressor's
  memoryless min-max observer feeds it, no calibration data), compressed with
  ModelCompressor (pack-quantized) and saved. The reference weights are the
  library's own dequantization (ModelCompressor.decompress_model).
- act-order: compressed-tensors 0.20 no longer writes weight_g_idx (its
  actorder "group" was removed), so those tensors are made here as GPTQ's
  act-order makes them: columns permuted into group order, quantized and
  dequantized by the library's quantize/dequantize on the permuted matrix,
  packed with its pack_to_int32, and the group of each column written to
  weight_g_idx.
- AWQ (GEMM) and GPTQ checkpoints are packed by this script following the
  layouts of AutoAWQ (awq/utils/packing_utils.py: AWQ_ORDER interleave,
  qweight [in, out/8], qzeros [groups, out/8], f16 scales) and AutoGPTQ /
  GPTQModel (qweight [in*bits/32, out] packed along the input, qzeros
  [groups, out*bits/32], v1 stores zero - 1); AutoAWQ and GPTQModel need CUDA
  builds, so their reference dequantization is transcribed here from their
  torch code (dequantize_gemm; the torch QuantLinear's dequantize_weight) and
  each checkpoint is round-tripped through it.

Goldens per checkpoint (golden.json): per prompt the ids, transformers' top-20
logits at every position and a 16-token greedy continuation, from a float32
LlamaForCausalLM holding the reference dequantized weights (the dense path:
transformers itself mis-loads some quantized checkpoints); per weight matrix
the FNV-1a 64 hash of its dequantized values as little-endian f32, the first
row's first 8 values, and the format sluice must report.
"""
import json, os, shutil, sys

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                             apply_quantization_config)
from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize
from compressed_tensors.quantization.utils.helpers import calculate_qparams
from safetensors.torch import save_file

K, N_GREEDY = 20, 16
HERE = os.path.dirname(os.path.abspath(__file__))
PROJ = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]


# ---- the tokenizer and the base model ------------------------------------------------

def make_tokenizer(path):
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = ["The capital of France is Paris. Sluices control the flow of water in canals.",
            "When a boat travels upstream, the lower gate opens and the boat enters the lock."] * 20
    tr = trainers.BpeTrainer(vocab_size=384, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(text, tr)
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": None, "eos_token": "<|endoftext|>", "add_bos_token": False,
                   "tokenizer_class": "PreTrainedTokenizerFast"}, f)
    return tok.get_vocab_size()


def base_model(vocab, hidden, ff, seed, arch="llama"):
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=ff, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                  max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0,
                  bos_token_id=None, eos_token_id=0, pad_token_id=None)
    if arch == "qwen3":  # q/k norms and tied embeddings
        m = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, tie_word_embeddings=True))
    else:
        m = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=False))
    with torch.no_grad():
        for n, p in m.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    return m.to(torch.bfloat16).eval()


# ---- round-to-nearest with the library's own arithmetic ------------------------------

def rtn_qparams(w, args):
    """Scale and zero point as llmcompressor's min-max observer + calculate_qparams give them."""
    if args.strategy == "group":
        g = w.unflatten(-1, (w.shape[-1] // args.group_size, args.group_size))
        mn, mx = torch.amin(g, dim=-1), torch.amax(g, dim=-1)
    else:  # channel
        mn, mx = torch.amin(w, dim=-1, keepdim=True), torch.amax(w, dim=-1, keepdim=True)
    return calculate_qparams(mn, mx, args)


def ct_quantize(model, groups, ignore, fmt="pack-quantized"):
    """groups: [(targets, QuantizationArgs)]. Returns the compressor (model compressed in place)."""
    cfg = QuantizationConfig(config_groups={f"group_{i}": QuantizationScheme(targets=t, weights=a)
                                            for i, (t, a) in enumerate(groups)},
                             ignore=ignore, format=fmt)
    apply_quantization_config(model, cfg)
    with torch.no_grad():
        for name, mod in model.named_modules():
            sch = getattr(mod, "quantization_scheme", None)
            if sch is None or sch.weights is None:
                continue
            s, z = rtn_qparams(mod.weight.data, sch.weights)
            mod.weight_scale.data.copy_(s.to(mod.weight_scale.dtype).reshape(mod.weight_scale.shape))
            if hasattr(mod, "weight_zero_point"):
                mod.weight_zero_point.data.copy_(z.to(mod.weight_zero_point.dtype).reshape(mod.weight_zero_point.shape))
    comp = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    comp.compress_model(model)
    return comp


def save_checkpoint(path, model, tensors, qcfg, tokdir, sharded=False):
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    model.config.save_pretrained(path)
    with open(os.path.join(path, "config.json")) as f:
        c = json.load(f)
    if qcfg is not None:
        c["quantization_config"] = qcfg
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(c, f, indent=2, sort_keys=True)
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    if model.config.tie_word_embeddings:  # lm_head is the embedding: stored once
        tensors.pop("lm_head.weight", None)
    if not sharded:
        save_file(tensors, os.path.join(path, "model.safetensors"))
    else:
        # two shards, split so that the parts of one packed weight live in different files
        names = sorted(tensors)
        first = [n for n in names if "layers.0." in n and not n.endswith("weight_scale")] + ["model.embed_tokens.weight"]
        shards = {"model-00001-of-00002.safetensors": first,
                  "model-00002-of-00002.safetensors": [n for n in names if n not in first]}
        wm = {}
        for fn, ns in shards.items():
            save_file({n: tensors[n] for n in ns}, os.path.join(path, fn))
            wm.update({n: fn for n in ns})
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": wm}, f, indent=1, sort_keys=True)
    for fn in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tokdir, fn), os.path.join(path, fn))


# ---- AWQ / GPTQ layouts ------------------------------------------------------------------

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]


def awq_pack(iw):  # iw [rows_in, cols_out] int, packs along the output with AutoAWQ's interleave
    out = torch.zeros(iw.shape[0], iw.shape[1] // 8, dtype=torch.int32)
    for col in range(iw.shape[1] // 8):
        for i in range(8):
            out[:, col] |= (iw[:, col * 8 + AWQ_ORDER[i]].to(torch.int32) << (i * 4))
    return out


def awq_dequantize_gemm(qweight, qzeros, scales, bits, group_size):
    """AutoAWQ's awq/utils/packing_utils.py dequantize_gemm, transcribed."""
    shifts = torch.arange(0, 32, bits)
    iweights = torch.bitwise_right_shift(qweight[:, :, None], shifts[None, None, :]).to(torch.int8)
    iweights = iweights.view(iweights.shape[0], -1)
    izeros = torch.bitwise_right_shift(qzeros[:, :, None], shifts[None, None, :]).to(torch.int8)
    izeros = izeros.view(izeros.shape[0], -1)
    rev = torch.arange(iweights.shape[-1], dtype=torch.int32).view(-1, 32 // bits)[:, AWQ_REVERSE_ORDER].view(-1)
    izeros, iweights = izeros[:, rev], iweights[:, rev]
    iweights = torch.bitwise_and(iweights, (2 ** bits) - 1)
    izeros = torch.bitwise_and(izeros, (2 ** bits) - 1)
    scales = scales.repeat_interleave(group_size, dim=0)
    izeros = izeros.repeat_interleave(group_size, dim=0)
    return (iweights - izeros) * scales  # [in, out], f16


def gptq_pack_rows(iw, bits):  # iw [in, out] -> [in*bits/32, out], packed along the input in order
    pf = 32 // bits
    out = torch.zeros(iw.shape[0] // pf, iw.shape[1], dtype=torch.int64)
    for j in range(pf):
        out |= (iw[j::pf].to(torch.int64) & ((1 << bits) - 1)) << (bits * j)
    return ((out + 2 ** 31) % 2 ** 32 - 2 ** 31).to(torch.int32)


def gptq_pack_cols(iz, bits):  # iz [groups, out] -> [groups, out*bits/32]
    return gptq_pack_rows(iz.t().contiguous(), bits).t().contiguous()


def gptq_dequantize(qweight, qzeros, scales, g_idx, bits, v2):
    """The torch QuantLinear's dequantize_weight (AutoGPTQ / GPTQModel), transcribed; v1 adds 1 to the zeros."""
    pf = 32 // bits
    wf = torch.arange(0, 32, bits, dtype=torch.int32)
    zeros = torch.bitwise_right_shift(qzeros.unsqueeze(2).expand(-1, -1, pf), wf.view(1, 1, -1)).to(torch.int16)
    zeros = torch.bitwise_and(zeros, (2 ** bits) - 1).reshape(scales.shape)
    if not v2:
        zeros = zeros + 1
    weight = torch.bitwise_right_shift(qweight.unsqueeze(1).expand(-1, pf, -1), wf.view(1, -1, 1)).to(torch.int16)
    weight = torch.bitwise_and(weight, (2 ** bits) - 1)
    weight = weight.reshape(weight.shape[0] * weight.shape[1], weight.shape[2])
    g = g_idx.long()
    return scales[g] * (weight - zeros[g])  # [in, out], f16


def rtn_asym_u(w, bits, group, dtype):
    """Unsigned RTN codes, zeros and scales per group of columns of w [out, in] (compressed-tensors' arithmetic)."""
    args = QuantizationArgs(num_bits=bits, symmetric=False, strategy="group", group_size=group)
    wq = w.to(dtype)
    s, z = rtn_qparams(wq, args)
    q = quantize(wq, s, z, args, dtype=torch.int8)
    off = 1 << (bits - 1)
    return q.to(torch.int32) + off, z.to(torch.int32) + off, s.to(dtype)  # [out,in], [out,ng], [out,ng]


# ---- goldens -------------------------------------------------------------------------------

def fnv(t):
    h, mask = 0xcbf29ce484222325, (1 << 64) - 1
    for byte in t.detach().to(torch.float32).contiguous().numpy().astype("<f4").tobytes():
        h = ((h ^ byte) * 0x100000001b3) & mask
    return "%016x" % h


PROMPTS = [[5, 17, 42, 99, 150], [200, 33, 7, 8, 300, 12, 64, 77, 101, 250, 3, 19],
           [60, 61, 62, 63, 10, 20, 30, 40, 50, 70, 80, 90, 110, 120, 130, 140, 160, 170, 180, 190]]


@torch.no_grad()
def golden(dense_sd, config, fmts, name):
    cfg = config.__class__(**{k: v for k, v in config.to_dict().items() if k != "quantization_config"})
    m = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.float32).eval()
    missing, unexpected = m.load_state_dict({k: v.to(torch.float32) for k, v in dense_sd.items()}, strict=True)
    out = {"model": name, "transformers": transformers.__version__, "prompts": [], "weights": []}
    margins = []
    for ids in PROMPTS:
        x = torch.tensor([ids])
        logits = m(x).logits[0].float()
        top = torch.topk(logits, K, dim=-1)
        res = m(x, use_cache=True)
        past, nxt, greedy = res.past_key_values, int(res.logits[0, -1].argmax()), []
        for _ in range(N_GREEDY):
            l = res.logits[0, -1].float()
            t2 = torch.topk(l, 2).values
            margins.append(float(t2[0] - t2[1]))
            greedy.append(nxt)
            res = m(torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
            past, nxt = res.past_key_values, int(res.logits[0, -1].argmax())
        out["prompts"].append({"ids": ids, "top_ids": top.indices.tolist(),
                               "top_logits": [[float(v) for v in row] for row in top.values], "greedy": greedy})
    for k, fmt in fmts.items():
        w = dense_sd[k + ".weight"].to(torch.float32)
        out["weights"].append({"module": k, "format": fmt, "fnv": fnv(w), "row0": [float(v) for v in w[0, :8]]})
    print(f"{name}: min greedy top-1 margin {min(margins):.4f}", flush=True)
    return out


def modules_of(model):
    return [f"model.layers.{l}.{p}" for l in range(model.config.num_hidden_layers) for p in PROJ] + ["lm_head"]


def fmt_of(args, cols, actorder=False):
    """The format sluice reports: from the file, where one group spanning the row is a per-channel scale."""
    if args is None:
        return "bf16"
    g = f"g{args.group_size}" if args.strategy == "group" and args.group_size < cols else "channel"
    return f"int{args.num_bits} {g} {'sym' if args.symmetric else 'asym'}" + (" act-order" if actorder else "")


# ---- the checkpoints -----------------------------------------------------------------------

def A(bits, group=None, sym=True):
    return QuantizationArgs(num_bits=bits, symmetric=sym, strategy="group" if group else "channel",
                            group_size=group)


def make_ct(outdir, tokdir, vocab, name, hidden, ff, seed, groups, ignore, fmt="pack-quantized", sharded=False,
            arch="llama"):
    model = base_model(vocab, hidden, ff, seed, arch)
    comp = ct_quantize(model, groups, ignore, fmt)
    sd = {k: v for k, v in model.state_dict().items()}
    qcfg = comp.quantization_config.model_dump(exclude_none=False)
    qcfg["quant_method"] = "compressed-tensors"
    # the library rebuilds ignore from the modules it skipped (exact names); keep the list as written, patterns
    # included, as a user's recipe has it
    qcfg["ignore"] = list(ignore)
    qcfg = json.loads(json.dumps(qcfg, default=str))
    fmts = {}
    for mod_name, mod in model.named_modules():
        if mod_name in modules_of(model):
            sch = getattr(mod, "quantization_scheme", None)
            fmts[mod_name] = fmt_of(sch.weights if sch else None, mod.in_features) + \
                (" (int-quantized)" if sch and fmt != "pack-quantized" else "")
    path = os.path.join(outdir, name)
    save_checkpoint(path, model, sd, qcfg, tokdir, sharded)
    # the library's own dequantization of what was saved
    comp.decompress_model(model)
    dense = {k: v for k, v in model.state_dict().items()
             if not any(s in k for s in ("weight_scale", "weight_zero_point", "weight_shape", "weight_packed",
                                        "weight_g_idx"))}
    with open(os.path.join(path, "golden.json"), "w") as f:
        json.dump(golden(dense, model.config, fmts, name), f)


def make_ct_actorder(outdir, tokdir, vocab, name, seed, bits, group, sym):
    model = base_model(vocab, 64, 128, seed)
    args = QuantizationArgs(num_bits=bits, symmetric=sym, strategy="group", group_size=group)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    dense = {k: v.clone() for k, v in sd.items()}
    gen = torch.Generator().manual_seed(seed)
    fmts = {}
    for mod in modules_of(model):
        if mod == "lm_head":
            fmts[mod] = "bf16"
            continue
        w = sd.pop(mod + ".weight")
        cols = w.shape[1]
        perm = torch.randperm(cols, generator=gen)
        g_idx = torch.empty(cols, dtype=torch.int32)
        g_idx[perm] = torch.arange(cols, dtype=torch.int32) // group
        wp = w[:, perm]
        s, z = rtn_qparams(wp, args)
        zz = None if sym else z
        qp = quantize(wp, s, zz, args, dtype=torch.int8)
        q = torch.empty_like(qp)
        q[:, perm] = qp
        deq = torch.empty_like(w)
        deq[:, perm] = dequantize(qp, s, zz, args)
        sd[mod + ".weight_packed"] = pack_to_int32(q, bits)
        sd[mod + ".weight_scale"] = s.to(torch.bfloat16)
        sd[mod + ".weight_shape"] = torch.tensor(list(w.shape), dtype=torch.int64)
        sd[mod + ".weight_g_idx"] = g_idx
        if not sym:
            sd[mod + ".weight_zero_point"] = pack_to_int32(z.to(torch.int8), bits, packed_dim=0)
        dense[mod + ".weight"] = deq
        fmts[mod] = fmt_of(args, cols, actorder=True)
    wargs = json.loads(args.model_dump_json())
    wargs["actorder"] = "group"
    qcfg = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": wargs, "input_activations": None,
                                          "output_activations": None, "format": "pack-quantized"}},
            "ignore": ["lm_head"]}
    path = os.path.join(outdir, name)
    save_checkpoint(path, model, sd, qcfg, tokdir)
    with open(os.path.join(path, "golden.json"), "w") as f:
        json.dump(golden(dense, model.config, fmts, name), f)


def make_awq(outdir, tokdir, vocab, name, seed, group):
    model = base_model(vocab, 64, 128, seed)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    dense = {k: v.clone() for k, v in sd.items()}
    fmts = {"lm_head": "bf16"}
    for mod in modules_of(model)[:-1]:
        w = sd.pop(mod + ".weight")
        q, z, s = rtn_asym_u(w, 4, group, torch.float16)      # [out,in], [out,ng], [out,ng]
        qweight, qzeros, scales = awq_pack(q.t().contiguous()), awq_pack(z.t().contiguous()), s.t().contiguous()
        sd[mod + ".qweight"], sd[mod + ".qzeros"], sd[mod + ".scales"] = qweight, qzeros, scales
        deq = awq_dequantize_gemm(qweight, qzeros, scales, 4, group)  # [in, out]
        dense[mod + ".weight"] = deq.t().contiguous()
        fmts[mod] = f"int4 {f'g{group}' if group < w.shape[1] else 'channel'} asym (awq)"
    qcfg = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm",
            "modules_to_not_convert": None}
    path = os.path.join(outdir, name)
    save_checkpoint(path, model, sd, qcfg, tokdir)
    with open(os.path.join(path, "golden.json"), "w") as f:
        json.dump(golden(dense, model.config, fmts, name), f)


def make_gptq(outdir, tokdir, vocab, name, seed, bits, group, sym, desc_act, v2):
    model = base_model(vocab, 64, 128, seed)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    dense = {k: v.clone() for k, v in sd.items()}
    gen = torch.Generator().manual_seed(seed)
    fmts = {"lm_head": "bf16"}
    off = 1 << (bits - 1)
    for mod in modules_of(model)[:-1]:
        w = sd.pop(mod + ".weight")
        cols = w.shape[1]
        perm = torch.randperm(cols, generator=gen) if desc_act else torch.arange(cols)
        g_idx = torch.empty(cols, dtype=torch.int32)
        g_idx[perm] = torch.arange(cols, dtype=torch.int32) // group
        wp = w[:, perm]
        if sym:
            args = QuantizationArgs(num_bits=bits, symmetric=True, strategy="group", group_size=group)
            s, _ = rtn_qparams(wp.to(torch.float16), args)
            qp = quantize(wp.to(torch.float16), s, None, args, dtype=torch.int8).to(torch.int32) + off
            z = torch.full(s.shape, off, dtype=torch.int32)
        else:
            qp, z, s = rtn_asym_u(wp, bits, group, torch.float16)
        q = torch.empty_like(qp)
        q[:, perm] = qp
        zs = z if v2 else z - 1
        qweight = gptq_pack_rows(q.t().contiguous(), bits)          # [in*bits/32, out]
        qzeros = gptq_pack_cols(zs.t().contiguous(), bits)          # [ng, out*bits/32]
        scales = s.t().contiguous().to(torch.float16)               # [ng, out]
        sd[mod + ".qweight"], sd[mod + ".qzeros"], sd[mod + ".scales"], sd[mod + ".g_idx"] = \
            qweight, qzeros, scales, g_idx
        deq = gptq_dequantize(qweight, qzeros, scales, g_idx, bits, v2)
        dense[mod + ".weight"] = deq.t().contiguous()
        fmts[mod] = (f"int{bits} {f'g{group}' if group < cols else 'channel'} {'sym' if sym else 'asym'}" + (" act-order" if desc_act else "") +
                     (" (gptq v2)" if v2 else " (gptq)"))
    qcfg = {"quant_method": "gptq", "bits": bits, "group_size": group, "sym": sym, "desc_act": desc_act,
            "checkpoint_format": "gptq_v2" if v2 else "gptq"}
    path = os.path.join(outdir, name)
    save_checkpoint(path, model, sd, qcfg, tokdir)
    with open(os.path.join(path, "golden.json"), "w") as f:
        json.dump(golden(dense, model.config, fmts, name), f)


def main():
    outdir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "..", "..", "models", "quant")
    os.makedirs(outdir, exist_ok=True)
    tokdir = os.path.join(outdir, "tok")
    vocab = make_tokenizer(tokdir)
    make_ct(outdir, tokdir, vocab, "ct-w4g32-sym", 64, 128, 11, [(["Linear"], A(4, 32))], ["lm_head"])
    make_ct(outdir, tokdir, vocab, "ct-w4g64-asym", 64, 128, 12, [(["Linear"], A(4, 64, sym=False))], ["lm_head"])
    make_ct(outdir, tokdir, vocab, "ct-w4g128-sym", 128, 256, 13, [(["Linear"], A(4, 128))], ["lm_head"])
    make_ct(outdir, tokdir, vocab, "ct-w4-channel-asym", 64, 128, 14, [(["Linear"], A(4, None, sym=False))],
            ["lm_head"])
    make_ct(outdir, tokdir, vocab, "ct-w8-channel-sym", 64, 128, 15, [(["Linear"], A(8))], ["lm_head"])
    # mixed: int4 g32 MLP, int8 channel attention (asym), lm_head quantized int8 (a family usually left bf16),
    # an exact-name group overriding the pattern for one module, and ignore by pattern and by exact name
    make_ct(outdir, tokdir, vocab, "ct-mixed", 64, 128, 16,
            [(["re:.*mlp\\..*_proj"], A(4, 32)), (["re:.*self_attn\\..*_proj"], A(8, None, sym=False)),
             (["lm_head"], A(8)), (["model.layers.0.mlp.up_proj"], A(8, 64))],
            ["re:model\\.layers\\.1\\.self_attn\\.[kv]_proj", "model.layers.0.mlp.down_proj"], sharded=True)
    # int8 stored unpacked (compressed-tensors naive-quantized), with zero points
    make_ct(outdir, tokdir, vocab, "ct-w8-naive-asym", 64, 128, 21, [(["Linear"], A(8, None, sym=False))], ["lm_head"],
            fmt="naive-quantized")
    make_ct(outdir, tokdir, vocab, "ct-qwen3-w4g32-asym", 64, 128, 22, [(["Linear"], A(4, 32, sym=False))],
            ["lm_head"], arch="qwen3")
    make_ct_actorder(outdir, tokdir, vocab, "ct-w4g32-actorder-asym", 17, 4, 32, False)
    make_awq(outdir, tokdir, vocab, "awq-w4g32", 18, 32)
    make_gptq(outdir, tokdir, vocab, "gptq-w4g32-actorder", 19, 4, 32, True, True, False)
    make_gptq(outdir, tokdir, vocab, "gptq-v2-w8g64-asym", 20, 8, 64, False, False, True)
    shutil.rmtree(tokdir)


if __name__ == "__main__":
    main()
