#!/usr/bin/env python3
"""Builds the outside reference for sluice's tokenizer test on the default model.

Reads the vocabulary, merges and token types of models/SmolLM2-135M-Instruct.Q4_1.gguf
with the `gguf` package and builds an HF `tokenizers` (Rust) byte-level BPE from them, the
way transformers' GGUF loader does (integrations/gguf/gguf_tokenizer_mapping.py:
byte_level_tokenizer + add_gguf_special_tokens), with the pre-tokenizer SmolLM2's own
tokenizer.json uses (llama.cpp pre "smollm"): Digits(individual_digits) then the GPT-2
ByteLevel regex. (transformers' GGUF loader has no split for "smollm" and would keep
GPT-2's default, which does not split digits; SmolLM2's published tokenizer does.)

Writes, next to this script:
  smollm2/tokenizer.json, smollm2/tokenizer_config.json, smollm2/generation_config.json
  smollm2.golden: for each test string, a line "<hex of the UTF-8 string> <ids...>"
                  (encoded without BOS, special tokens recognized).

  pip install gguf numpy tokenizers
  python3 tests/golden/tok/make_smollm2.py [path/to/SmolLM2-135M-Instruct.Q4_1.gguf]
"""
import json
import os
import sys

from gguf import GGUFReader
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
path = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")

r = GGUFReader(path)
f = r.fields
tokens = list(f["tokenizer.ggml.tokens"].contents())
types = list(f["tokenizer.ggml.token_type"].contents())
merges = [tuple(m.split(" ", 1)) for m in f["tokenizer.ggml.merges"].contents()]
bos = f["tokenizer.ggml.bos_token_id"].contents()
eos = f["tokenizer.ggml.eos_token_id"].contents()
add_bos = bool(f["tokenizer.ggml.add_bos_token"].contents()) if "tokenizer.ggml.add_bos_token" in f else False

vocab = {t: i for i, t in enumerate(tokens)}
tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
tok.pre_tokenizer = pre_tokenizers.Sequence([
    pre_tokenizers.Digits(individual_digits=True),
    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
])
tok.decoder = decoders.ByteLevel()
tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                        for t, ty in zip(tokens, types) if ty == 3])
user = [AddedToken(t, normalized=False, special=False) for t, ty in zip(tokens, types) if ty == 4]
if user:
    tok.add_tokens(user)

out = os.path.join(HERE, "smollm2")
os.makedirs(out, exist_ok=True)
tok.save(os.path.join(out, "tokenizer.json"))
with open(os.path.join(out, "tokenizer_config.json"), "w") as fp:
    json.dump({"add_bos_token": add_bos, "bos_token": tokens[bos], "eos_token": tokens[eos],
               "model_max_length": 8192}, fp, indent=2)
with open(os.path.join(out, "generation_config.json"), "w") as fp:
    json.dump({"bos_token_id": bos, "eos_token_id": [eos]}, fp, indent=2)

strings = [
    "Hello world",
    "Hello, world! How are you today?",
    " leading space and  double  spaces   ",
    "Numbers: 1234567890 and 3.14159, 1,000,000.",
    "I'm sure you've heard it's what they'd do; we'll see, they're OK.",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "Tabs\tand\nnewlines\r\n\n\nend",
    "Ünïcödé façade naïve café résumé",
    "日本語のテキストと中文文本。한국어 텍스트.",
    "Emoji: 😀🚀👍🏽 👨‍👩‍👧‍👦 and flags 🇫🇷🇯🇵",
    "Ελληνικά και Русский текст, עברית, العربية",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>system\nYou are helpful.<|im_end|>",
    "x<|endoftext|>y",
    "   \n\n   \t\t  ",
    "a\u0301e\u0300o\u0302 combining marks",
    "$$$ ((( ))) [[[ ]]] {{{ }}} !!! ??? ... --- ___ *** ###",
    "https://example.com/path?query=1&x=2#frag",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "",
]
with open(os.path.join(HERE, "smollm2.golden"), "w") as fp:
    for s in strings:
        ids = tok.encode(s, add_special_tokens=False).ids
        fp.write(s.encode("utf-8").hex() + " " + " ".join(map(str, ids)) + "\n")
print("wrote", len(strings), "strings")
