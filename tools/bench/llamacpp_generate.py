#!/usr/bin/env python3
"""The llama.cpp side of the `sluice generate` benchmark (BENCHMARKS.md).

  pip install llama-cpp-python   # builds llama.cpp from source
  python3 tools/bench/llamacpp_generate.py MODEL.gguf PROMPT_FILE MAX_TOKENS THREADS

Greedy, EOS ignored (logit bias), no prompt cache: prints prompt tokens, prompt tok/s,
generated tokens, generation tok/s from llama.cpp's own timers.
"""
import sys, time
import numpy as np
from llama_cpp import Llama

model, prompt_file, n_gen, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
prompt = open(prompt_file).read()
llm = Llama(model_path=model, n_ctx=2048, n_threads=threads, n_threads_batch=threads, n_batch=512,
            verbose=False, logits_all=False)
ids = llm.tokenize(prompt.encode(), add_bos=False, special=True)
for rep in range(2):  # the first run warms caches; report the second
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(ids)
    t1 = time.perf_counter()
    out = []
    for _ in range(n_gen):
        # the last token's logits, straight from llama.cpp (llm.scores is only
        # filled for every row with logits_all, which would slow the prompt down)
        logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))
        tok = int(logits.argmax())
        out.append(tok)
        llm.eval([tok])
    t2 = time.perf_counter()
print(f"llama.cpp: prompt tokens: {len(ids)} ({len(ids)/(t1-t0):.1f} tok/s), "
      f"generated tokens: {n_gen} ({n_gen/(t2-t1):.1f} tok/s)")
print("text:", llm.detokenize(out[:24]).decode(errors="replace").replace("\n", " "))
