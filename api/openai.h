/* openai.h - OpenAI request bodies in, OpenAI response bodies out, for
 * /v1/chat/completions and /v1/completions. Shared by `sluice run-batch` and
 * the HTTP server.
 *
 * A body is parsed and validated the way the OpenAI server (and vLLM) does it
 * (api_oai_parse): a bad value gets a 400 with a message that names the
 * parameter. The parsed request becomes a prompt (chat template + tokenize)
 * and a sched_request (api_oai_to_sched). While the engine runs it, events
 * are folded into a struct api_oai_result (text, logprobs, finish, usage),
 * which renders the final body (api_oai_response_json).
 *
 * NUL characters (\u0000) inside messages and prompts are kept, not refused:
 * vLLM keeps them (a Python str holds them and byte-level BPE has a token for
 * byte 0), and the long documents batch jobs carry (text pulled out of PDFs)
 * hold them often enough that refusing would fail lines vLLM serves. So a
 * prompt's length travels with it (prompt_len, prompt_lens, api_chat_render's
 * len) and nothing after the JSON decoder measures it with strlen. Only the
 * strings the engine and the server compare as C strings refuse a NUL with a
 * 400 naming the field: stop strings and the model name.
 *
 * Nothing here touches the engine or a thread: every function works on the
 * caller's structs and may be called from any thread.
 */
#ifndef SLUICE_API_OPENAI_H
#define SLUICE_API_OPENAI_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/json.h"
#include "model/model.h"
#include "sched/sched.h"

enum api_oai_endpoint { API_OAI_CHAT, API_OAI_COMPLETIONS };

/* An OpenAI-shaped error: {"error": {"message", "type", "param", "code"}}. */
struct api_oai_error {
    int status;           /* HTTP status: 400, 404, 500 */
    const char *type;     /* "invalid_request_error", "NotFoundError", ... (static) */
    char param[64];       /* the parameter at fault, "" when none */
    char message[512];
};

#define API_OAI_MAX_STOP 64

/* A parsed, validated request. init by api_oai_parse, freed by api_oai_req_free. */
struct api_oai_req {
    enum api_oai_endpoint kind;
    char *model;                /* owned; NULL when absent */
    char *prompt_text;          /* owned: the completion prompt, or the chat rendered by its template;
                                   NUL-terminated, but may hold NULs of its own: prompt_len counts it */
    size_t prompt_len;
    int32_t *prompt_ids;        /* owned: a completion prompt given as token ids (prompt_text NULL) */
    int n_prompt_ids;
    long max_tokens;            /* -1: not given */
    struct model_sampling sampling;
    bool seed_given;
    char *stop[API_OAI_MAX_STOP]; /* owned */
    int n_stop;
    int32_t *stop_token_ids;    /* owned */
    int n_stop_token_ids;
    bool ignore_eos;
    bool logprobs;              /* chat: logprobs; completions: logprobs != null */
    int top_logprobs;           /* chat: top_logprobs; completions: the logprobs integer */
    bool stream;
    bool tools;                 /* chat: tools given and tool_choice is not "none" (tool-call parsing applies) */
    int n;                      /* choices to generate (1..API_OAI_MAX_N), each its own engine request */
    char **prompts;             /* owned [n_prompts]: completions given a list of prompts (prompt_text
                                   NULL); prompt p's choices are p*n .. p*n + n-1 */
    size_t *prompt_lens;        /* owned [n_prompts]: their lengths (they may hold NULs) */
    int n_prompts;
    long min_tokens;            /* vLLM's min_tokens: no stop token id before this many (0: off) */
    bool json_object;           /* response_format {"type": "json_object"} (or structured_outputs.json_object) */
    struct sched_schema *schema; /* owned: response_format {"type": "json_schema"}, or vLLM's structured_outputs
                                   json / regex / choice / grammar (guided_* alike), compiled */
    char *forced_tool;          /* owned: tool_choice named a function (or "required" with one tool): the
                                   output is that call's arguments, guided by its parameters' schema */
    bool forced_required;       /* forced_tool came from "required" (one tool): finish_reason "tool_calls"
                                   as vLLM gives it; a named function keeps "stop" */
    bool forced_list;           /* tool_choice "required" with several tools: the output is a JSON array
                                   of {"name", "parameters"} calls, guided by a union of the tools */
    struct model_logit_bias *logit_bias; /* owned [sampling.n_logit_bias]; sampling.logit_bias points here */
    /* vLLM's extensions (SamplingParams and the completions request) */
    bool echo;                  /* completions: the prompt comes first in each choice's text */
    bool include_stop_str;      /* include_stop_str_in_output */
    bool keep_special_tokens;   /* skip_special_tokens: false */
    int32_t *allowed_ids;       /* owned [n_allowed_ids]: allowed_token_ids */
    int n_allowed_ids;
    char **bad_words;           /* owned [n_bad_words]: bad_words as given */
    int n_bad_words;
    int32_t *bad_ids;           /* owned: bad_words as token sequences (api_oai_prepare), concatenated */
    int *bad_lens;              /* owned [n_bad_seqs] */
    int n_bad_seqs;
    long truncate_prompt_tokens; /* > 0: only the prompt's last this many tokens; -1: max_model_len; 0: off */
    bool tokens_as_ids;         /* return_tokens_as_token_ids: logprobs name tokens "token_id:N" */
    bool add_special_tokens;    /* the tokenizer's BOS before the prompt (vLLM: completions true, chat false) */
    int prompt_logprobs;        /* -1: off; else each prompt token's logprob and this many alternatives */
    int32_t **id_prompts;       /* owned [n_prompts]: completions given a list of token-id lists (prompts
                                   NULL); id_prompt_lens their lengths */
    int *id_prompt_lens;
};
#define API_OAI_MAX_N 64

/* Parses and validates body[0..len) for endpoint kind. served: when not
 * NULL, the names a "model" may give (NULL-terminated); any other is refused
 * (404). On error returns a negative sl_status, fills *e and leaves *r freed
 * (api_oai_req_free is still safe). */
int api_oai_parse(const char *body, size_t len, enum api_oai_endpoint kind, const char *const *served,
                  struct api_oai_req *r, struct api_oai_error *e);
/* Same, on an already parsed document whose value obj is the body. */
int api_oai_parse_doc(const json_doc *d, int obj, enum api_oai_endpoint kind, const char *const *served,
                      struct api_oai_req *r, struct api_oai_error *e);
/* model is one of names (NULL-terminated; NULL: none). */
bool api_oai_model_known(const char *const *names, const char *model);
void api_oai_req_free(struct api_oai_req *r);

/* What parsing leaves to the tokenizer: bad_words into token sequences (each
 * word as it is and after a space, as vLLM does). 0 or a negative status with
 * *e filled. Call it once after api_oai_parse. */
int api_oai_prepare(struct api_oai_req *r, const model_tok *tok, struct api_oai_error *e);
/* Whether r needs the backend's prompt logprobs (prompt_logprobs, or echo
 * with logprobs). */
bool api_oai_wants_prompt_logprobs(const struct api_oai_req *r);

/* Tokenizes the prompt into a new malloc'ed array (*ids, caller frees; BOS
 * added as the tokenizer's metadata says, special tokens parsed for chat).
 * Returns the count, or a negative status with *e filled. */
int api_oai_tokenize(const struct api_oai_req *r, const model_tok *tok, int32_t **ids,
                     struct api_oai_error *e);

/* Before tokenizing: a 400 like api_oai_to_sched's when the prompt's text
 * (prompt p of a list, or -1: the prompt) is so long that its tokens cannot
 * fit max_model_len, whatever they are (model_tok_max_bytes). A long text
 * costs seconds to tokenize; this costs nothing. Returns 0 or a negative
 * status with *e filled. */
int api_oai_check_length(const struct api_oai_req *r, int p, const model_tok *tok, int max_model_len,
                         struct api_oai_error *e);

/* Fills a sched_request from r and its tokenized prompt (borrowed by *out:
 * ids, stop strings). max_tokens defaults to what is left of max_model_len
 * (chat) or 16 (completions); a prompt that leaves no room is a 400 naming
 * the lengths. Returns 0 or a negative status with *e filled. */
int api_oai_to_sched(const struct api_oai_req *r, const int32_t *ids, int n_ids, int max_model_len,
                     struct sched_request *out, struct api_oai_error *e);

/* Choices in the reply: n for each prompt. */
int api_oai_n_choices(const struct api_oai_req *r);
/* Tokenizes prompt p of a list of prompts (r->n_prompts > 0) as api_oai_tokenize does. */
int api_oai_tokenize_prompt(const struct api_oai_req *r, int p, const model_tok *tok, int32_t **ids,
                            struct api_oai_error *e);

/* The sampling of choice i (0 <= i < r->n) of r: the request's own for
 * choice 0; the others draw from RNG streams derived from the seed (a
 * seeded request stays reproducible choice by choice). */
void api_oai_choice_sampling(const struct api_oai_req *r, int i, struct model_sampling *out);

/* The output of one choice, folded from its engine events. init/free. */
struct api_oai_result {
    struct json_buf text;       /* generated text (raw bytes) */
    struct json_buf lp;         /* chat: logprobs.content entries; completions: tokens */
    struct json_buf lp_vals;    /* completions: token_logprobs */
    struct json_buf lp_top;     /* completions: top_logprobs */
    struct json_buf lp_off;     /* completions: text_offset */
    int n_lp;
    size_t offset;              /* completions: text offset of the next token */
    struct json_buf plp;        /* prompt_logprobs: the entries after the first null, vLLM's shape */
    bool has_plp;
    bool done;
    enum sched_finish finish;
    struct sched_usage usage;
    char error[160];
};
void api_oai_result_init(struct api_oai_result *res);
void api_oai_result_free(struct api_oai_result *res);
/* completions with echo: puts prompt ids[0..n) (the prompt as it was given
 * when it was text) at the start of res's text. Call once, before any event. */
void api_oai_result_echo(struct api_oai_result *res, const struct api_oai_req *r, int choice, const model_tok *tok,
                         const int32_t *ids, int n);
/* Folds one event (token or finish) into res. */
void api_oai_result_add(struct api_oai_result *res, const struct api_oai_req *r, const model_tok *tok,
                        const struct sched_event *ev);

/* Appends the response body (chat.completion or text_completion object,
 * usage with prompt_tokens_details.cached_tokens) for the finished results
 * res[0 .. api_oai_n_choices(r)) (choice i = res[i]; usage: each prompt
 * once, the completions summed). */
void api_oai_response_json(struct json_buf *b, const struct api_oai_req *r, const struct api_oai_result *res,
                           const char *id, long created, const char *model_name);
/* The id of choice i's forced tool call (tool_choice named): "call_" and a
 * hash of the response id, so streamed and whole replies agree. */
void api_oai_forced_call_id(const char *response_id, int choice, char out[32]);

/* tool_choice "required" (several tools): appends the tool_calls array items
 * (no brackets) for the generated JSON array text of choice i; with_index:
 * as stream deltas carry them. Returns the number of calls, 0 when the text
 * is not a complete array (a reply cut by max_tokens). */
int api_oai_list_calls(struct json_buf *b, const char *text, size_t len, const char *response_id, int choice,
                       bool with_index);

/* ---- responses.c: POST /v1/responses over chat completions ---- */
/* Translates a Responses API body into the chat-completions body it means
 * (appended to chat). 0, or a negative status with e naming the field. */
int api_resp_to_chat(const char *body, size_t len, struct json_buf *chat, struct api_oai_error *e);
/* Rewrites an error about the translated chat body so it names the
 * Responses field the client sent (max_tokens -> max_output_tokens,
 * response_format -> text.format, messages -> input), param and message. */
void api_resp_chat_error(struct api_oai_error *e);
/* Appends a Response object: status "in_progress" (no output, no usage),
 * "completed" or "incomplete" (finish says why) with the text as one
 * output_text message. rid: the request's id without prefix. */
void api_resp_json(struct json_buf *b, const char *rid, long created, const char *model, const char *status,
                   const char *text, size_t len, const struct sched_usage *u, enum sched_finish finish,
                   const char *echo);
/* The request's settings a Response object echoes (instructions,
 * max_output_tokens, parallel_tool_calls, temperature, tool_choice, tools,
 * top_p, text, metadata, ...: as given, else OpenAI's defaults), as object
 * members without braces, for the echo argument below (NULL: the defaults
 * of a request without tools). 0, or a negative status. */
int api_resp_echo(const char *body, size_t len, struct json_buf *out);

/* Appends the Response object for a finished chat.completion reply (its JSON
 * text): content -> a message item, tool_calls -> function_call items. */
void api_resp_from_chat(struct json_buf *b, const char *chat_json, size_t len, const char *rid, long created,
                        const char *model, const char *echo);

/* A request body must be UTF-8 (RFC 8259): 0, or a 400 naming the byte
 * offset of the first invalid sequence (vLLM refuses such a body too). */
int api_oai_check_utf8(const char *body, size_t len, struct api_oai_error *e);

/* Appends {"error": {...}}. */
void api_oai_error_json(struct json_buf *b, const struct api_oai_error *e);
/* Fills e (printf-style message). Returns SL_EINVAL for convenience. */
int api_oai_errorf(struct api_oai_error *e, int status, const char *param, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* ---- the chat prompt (api/chat.c) ----------------------------------------------
 *
 * Chat requests are rendered with the model's own Jinja chat template
 * (model_chat_template: GGUF tokenizer.chat_template, tokenizer_config.json or
 * chat_template.jinja), or --chat-template, or ChatML when there is none. The
 * template sees messages (content parts joined into strings, tool-call
 * arguments given as JSON strings decoded into objects, as vLLM does), tools,
 * add_generation_prompt (default true), bos_token, eos_token, enable_thinking
 * when the body has it, and the members of chat_template_kwargs. */

/* Chooses the template once per process, before any thread parses requests:
 * template_arg (a file, or the template text itself) when not NULL, else m's
 * own, else ChatML; BOS/EOS text from m's tokenizer (m may be NULL). Returns 0,
 * or a negative sl_status with err (a template that does not parse is named
 * here, at startup). Not thread-safe; api_chat_teardown frees it. */
int api_chat_setup(const model *m, const char *template_arg, char *err, size_t errlen);
void api_chat_teardown(void);
const char *api_chat_source(void); /* "model", "file", "argument" or "chatml" */
/* Appends the template context (a JSON object) for the chat body at obj to
 * ctx. Returns 0 or a negative status with *e (400 naming the parameter). */
int api_chat_context(const json_doc *d, int obj, struct json_buf *ctx, struct api_oai_error *e);
/* 0 when tools (a value of the body, or -1) is absent, null or an array of
 * {"type": "function", "function": {"name", "description", "parameters"}};
 * else a 400 naming the tool. */
int api_chat_check_tools(const json_doc *d, int tools, struct api_oai_error *e);
/* Renders the prompt for the chat body at obj into a new malloc'ed string
 * (*prompt, caller frees) of *len bytes (len may be NULL): a message may hold
 * NUL characters, so the length, not strlen, says where the prompt ends. A
 * template error (raise_exception included) is a 400 whose message is the
 * template's. Thread-safe after setup. */
int api_chat_render(const json_doc *d, int obj, char **prompt, size_t *len, struct api_oai_error *e);
/* --reasoning-parser / --tool-call-parser kinds for chat responses (set once at
 * startup, like api_chat_setup); 0 = off. */
void api_chat_set_parsers(int reasoning_kind, int toolcall_kind);
void api_chat_parsers(int *reasoning_kind, int *toolcall_kind);

/* ---- reasoning and tool calls in the output (api/reasoning.c, api/toolcall.c) ----
 *
 * Incremental parsers over generated text: feed any split of the text (each
 * token's bytes as they come, for streaming), then flush; the result does not
 * depend on the split. Embedded structs, one per request, any thread. */

enum { API_REASONING_NONE, API_REASONING_DEEPSEEK_R1, API_REASONING_QWEN3, API_REASONING_GLM45 };
/* --reasoning-parser name -> kind; NULL -> NONE; unknown -> -1. */
int api_reasoning_lookup(const char *name);

struct api_reasoning {
    int kind;
    bool in_think;   /* text goes to reasoning now */
    bool fresh;      /* nothing emitted since the last switch */
    char hold[16];   /* a tag's beginning, undecided */
    size_t nhold;
};
void api_reasoning_init(struct api_reasoning *p, int kind);
/* Appends thinking to *reasoning and the answer to *content. */
void api_reasoning_feed(struct api_reasoning *p, const char *s, size_t n, struct json_buf *reasoning,
                        struct json_buf *content);
void api_reasoning_flush(struct api_reasoning *p, struct json_buf *reasoning, struct json_buf *content);

enum { API_TOOLS_NONE, API_TOOLS_HERMES, API_TOOLS_GLM47 };
/* --tool-call-parser name -> kind (glm45 is glm47's format); unknown -> -1. */
int api_toolcall_lookup(const char *name);

struct api_toolcall {
    int kind;
    int n_calls;                 /* calls emitted so far */
    struct json_buf pending;     /* owned: text not yet decided (an open call, a partial tag) */
};
void api_toolcall_init(struct api_toolcall *p, int kind);
void api_toolcall_free(struct api_toolcall *p);
/* Appends plain text to *content and each completed call to *calls as
 * {"index","id","type":"function","function":{"name","arguments"}} objects
 * separated by commas (arguments: a JSON string). Malformed calls become
 * content. */
void api_toolcall_feed(struct api_toolcall *p, const char *s, size_t n, struct json_buf *content, struct json_buf *calls);
void api_toolcall_flush(struct api_toolcall *p, struct json_buf *content, struct json_buf *calls);

#endif
