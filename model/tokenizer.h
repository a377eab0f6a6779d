/* tokenizer.h - constructing a tokenizer (internal to model/; the rest of
 * the API is in model.h under model_tok_*).
 *
 * Byte-level BPE (GPT-2 style: gpt2, llama-3, qwen2, smollm/starcoder,
 * deepseek, falcon, ... pre-tokenizers, chosen by tokenizer.ggml.pre or by
 * tokenizer.json's pre_tokenizer). A model_tok copies everything it needs, so
 * the source file may be closed afterwards. Immutable after construction:
 * any thread may encode/decode concurrently.
 */
#ifndef SLUICE_TOKENIZER_H
#define SLUICE_TOKENIZER_H

#include "gguf.h"
#include "model.h"

/* From GGUF metadata (tokenizer.ggml.*). NULL with a message on failure
 * (e.g. an unsupported tokenizer.ggml.model or pre-tokenizer name). */
model_tok *model_tok_from_gguf(const gguf_file *f, char *err, size_t errlen);
/* From an HF directory: tokenizer.json, tokenizer_config.json (special tokens,
 * add_bos_token), generation_config.json (eos ids), when present. */
model_tok *model_tok_from_hf_dir(const char *dir, char *err, size_t errlen);
void model_tok_free(model_tok *t);

#endif
