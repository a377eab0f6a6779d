#!/usr/bin/env python3
"""Expected checksums for `sluice quantize --scheme w4a16-g32` of the default model,
made by compressed-tensors' own round-to-nearest from the same weights.

  python3 tests/golden/quant/make_smollm2_w4a16.py models/SmolLM2-135M-Instruct.Q4_1.gguf \
      > tests/golden/quant/smollm2_w4a16_g32.json

transformers reads the GGUF (dequantized by gguf-py, Q/K rows un-permuted into
Hugging Face order) into a bfloat16 LlamaForCausalLM; compressed-tensors then
quantizes every Linear but lm_head (W4A16: int4, symmetric, group 32) with the
scale and rounding of llmcompressor's round-to-nearest (min-max observer ->
calculate_qparams; no calibration data) and packs it (ModelCompressor,
pack-quantized). Written: the FNV-1a 64 hash of the raw little-endian bytes of
weight_packed and weight_scale of three families in every layer (q_proj and
k_proj, whose rows GGUF stores permuted, and gate_proj), one hash per family
over the layers in order. tests/test_quant.c compares them with what sluice
writes.
"""
import json, os, sys

import torch
from transformers import AutoModelForCausalLM

from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                             apply_quantization_config)
from compressed_tensors.quantization.utils.helpers import calculate_qparams

FAMILIES = ["self_attn.q_proj", "self_attn.k_proj", "mlp.gate_proj"]


class Fnv:
    def __init__(self):
        self.h = 0xcbf29ce484222325

    def update(self, b):
        h, mask = self.h, (1 << 64) - 1
        for byte in b:
            h = ((h ^ byte) * 0x100000001b3) & mask
        self.h = h


def main():
    path = os.path.abspath(sys.argv[1])
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.bfloat16).eval()
    args = QuantizationArgs(num_bits=4, symmetric=True, strategy="group", group_size=32)
    apply_quantization_config(model, QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)}, ignore=["lm_head"],
        format="pack-quantized"))
    with torch.no_grad():
        for name, mod in model.named_modules():
            if getattr(mod, "quantization_scheme", None) is None:
                continue
            w = mod.weight.data
            g = w.unflatten(-1, (w.shape[-1] // 32, 32))
            s, _ = calculate_qparams(torch.amin(g, dim=-1), torch.amax(g, dim=-1), args)
            mod.weight_scale.data.copy_(s.reshape(mod.weight_scale.shape))
    ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized").compress_model(model)
    sd = model.state_dict()
    out = {"model": os.path.basename(path), "scheme": "w4a16-g32", "families": {}}
    n_layer = model.config.num_hidden_layers
    for fam in FAMILIES:
        for part in ("weight_packed", "weight_scale"):
            h = Fnv()
            for l in range(n_layer):
                t = sd[f"model.layers.{l}.{fam}.{part}"].contiguous()
                raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
                h.update(raw.numpy().tobytes())
            out["families"][f"{fam}.{part}"] = "%016x" % h.h
    json.dump(out, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
