/* server_metrics.c - GET /metrics: the Prometheus text exposition of
 * vLLM's families (vllm:*, with model_name and finished_reason, what its
 * Grafana dashboard reads) and sluice's own (sluice:*: the scheduler, its
 * cost model, per-class latencies, the batch queue). Counters of finished
 * requests are kept by srv_metrics_finish (api thread); the engine's come
 * from sched_engine_get_stats. Api thread only. */
#include <event2/buffer.h>
#include <event2/http.h>
#include <stdio.h>
#include <string.h>

#include "server.h"

static void hist_out(struct evbuffer *o, const char *name, const char *help, const struct srv_hist *h)
{
    evbuffer_add_printf(o, "# HELP %s %s\n# TYPE %s histogram\n", name, help, name);
    for (int i = 0; i < SRV_HIST_BUCKETS; i++)
        evbuffer_add_printf(o, "%s_bucket{le=\"%g\"} %llu\n", name, srv_hist_bounds[i], (unsigned long long)h->le[i]);
    evbuffer_add_printf(o, "%s_bucket{le=\"+Inf\"} %llu\n%s_sum %.6f\n%s_count %llu\n", name,
                        (unsigned long long)h->count, name, h->sum, name, (unsigned long long)h->count);
}

/* An engine histogram, one series per label value (labels[i] for hs[i]; a
 * NULL label: no label). */
static void sched_hist_out(struct evbuffer *o, const char *name, const char *help, const char *label,
                           const char *const *values, const struct sched_hist *hs, int n)
{
    evbuffer_add_printf(o, "# HELP %s %s\n# TYPE %s histogram\n", name, help, name);
    for (int k = 0; k < n; k++) {
        const struct sched_hist *h = &hs[k];
        char l[96] = "", lc[100] = "";
        if (label) {
            snprintf(l, sizeof l, "%s=\"%s\"", label, values[k]);
            snprintf(lc, sizeof lc, "{%s}", l);
        }
        for (int i = 0; i < SCHED_HIST_BUCKETS; i++)
            evbuffer_add_printf(o, "%s_bucket{%s%sle=\"%g\"} %llu\n", name, l, label ? "," : "", sched_hist_bounds[i],
                                (unsigned long long)h->le[i]);
        evbuffer_add_printf(o, "%s_bucket{%s%sle=\"+Inf\"} %llu\n%s_sum%s %.6f\n%s_count%s %llu\n", name, l,
                            label ? "," : "", (unsigned long long)h->count, name, lc, h->sum, name, lc,
                            (unsigned long long)h->count);
    }
}

/* ---- vLLM's metric families ---- */

/* vLLM's buckets: request latencies (seconds), time per output token, and
 * its 1-2-5 series for token counts. */
static const double lat_bounds[] = {0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                                    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0};
static const double tpot_bounds[] = {0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                                     5.0, 7.5, 10.0, 20.0, 40.0, 80.0};
static const double tok_bounds[] = {1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000,
                                    100000, 200000, 500000, 1000000};
#define NB(a) ((int)(sizeof a / sizeof *a))

static void vhist_add(struct srv_vhist *h, const double *bounds, int nb, double v)
{
    SL_ASSERT(nb <= SRV_VHIST_MAX);
    if (!(v >= 0)) v = 0;
    h->sum += v;
    h->count++;
    for (int i = 0; i < nb; i++)
        if (v <= bounds[i]) h->le[i]++;
}

void srv_metrics_finish(struct server *s, const struct sched_event *ev, bool batch)
{
    const struct sched_usage *u = &ev->usage;
    pthread_mutex_lock(&s->vm_mu); /* chats count here from the api thread, batch rows from the store thread */
    struct srv_req_metrics *m = &s->vm;
    int f = ev->finish == SCHED_FINISH_STOP ? SRV_FIN_STOP : ev->finish == SCHED_FINISH_LENGTH ? SRV_FIN_LENGTH
          : ev->finish == SCHED_FINISH_ERROR ? SRV_FIN_ERROR : SRV_FIN_ABORT;
    m->finished[batch][f]++;
    m->prompt_tokens += (uint64_t)u->prompt_tokens;
    m->gen_tokens += (uint64_t)u->completion_tokens;
    vhist_add(&m->e2e, lat_bounds, NB(lat_bounds), u->total_s);
    vhist_add(&m->queue, lat_bounds, NB(lat_bounds), u->queue_s);
    double first = u->ttft_s >= 0 ? u->ttft_s : u->total_s;
    vhist_add(&m->prefill, lat_bounds, NB(lat_bounds), first - u->queue_s);
    vhist_add(&m->decode, lat_bounds, NB(lat_bounds), u->total_s - first);
    vhist_add(&m->inference, lat_bounds, NB(lat_bounds), u->total_s - u->queue_s);
    if (u->completion_tokens > 1)
        vhist_add(&m->tpot, tpot_bounds, NB(tpot_bounds), (u->total_s - first) / (u->completion_tokens - 1));
    vhist_add(&m->prompt_len, tok_bounds, NB(tok_bounds), u->prompt_tokens);
    vhist_add(&m->gen_len, tok_bounds, NB(tok_bounds), u->completion_tokens);
    pthread_mutex_unlock(&s->vm_mu);
}

/* "model_name=\"...\"" with the name escaped as the exposition format wants. */
static void model_label(struct server *s, char *out, size_t cap)
{
    size_t n = (size_t)snprintf(out, cap, "model_name=\"");
    for (const char *p = s->model_name ? s->model_name : ""; *p && n + 4 < cap; p++) {
        if (*p == '"' || *p == '\\') out[n++] = '\\';
        if (*p == '\n') {
            out[n++] = '\\', out[n++] = 'n';
            continue;
        }
        out[n++] = *p;
    }
    snprintf(out + n, cap - n, "\"");
}

static void vhist_out(struct evbuffer *o, const char *name, const char *help, const char *lbl,
                      const struct srv_vhist *h, const double *bounds, int nb)
{
    evbuffer_add_printf(o, "# HELP %s %s\n# TYPE %s histogram\n", name, help, name);
    for (int i = 0; i < nb; i++)
        evbuffer_add_printf(o, "%s_bucket{%s,le=\"%g\"} %llu\n", name, lbl, bounds[i], (unsigned long long)h->le[i]);
    evbuffer_add_printf(o, "%s_bucket{%s,le=\"+Inf\"} %llu\n%s_sum{%s} %.6f\n%s_count{%s} %llu\n", name, lbl,
                        (unsigned long long)h->count, name, lbl, h->sum, name, lbl, (unsigned long long)h->count);
}

/* An engine histogram (per class) summed over the classes, under a vLLM name. */
static void sched_hist_sum_out(struct evbuffer *o, const char *name, const char *help, const char *lbl,
                               const struct sched_hist *h, int n)
{
    struct sched_hist t;
    memset(&t, 0, sizeof t);
    for (int c = 0; c < n; c++) {
        t.sum += h[c].sum, t.count += h[c].count;
        for (int i = 0; i < SCHED_HIST_BUCKETS; i++) t.le[i] += h[c].le[i];
    }
    evbuffer_add_printf(o, "# HELP %s %s\n# TYPE %s histogram\n", name, help, name);
    for (int i = 0; i < SCHED_HIST_BUCKETS; i++)
        evbuffer_add_printf(o, "%s_bucket{%s,le=\"%g\"} %llu\n", name, lbl, sched_hist_bounds[i],
                            (unsigned long long)t.le[i]);
    evbuffer_add_printf(o, "%s_bucket{%s,le=\"+Inf\"} %llu\n%s_sum{%s} %.6f\n%s_count{%s} %llu\n", name, lbl,
                        (unsigned long long)t.count, name, lbl, t.sum, name, lbl, (unsigned long long)t.count);
}

/* vLLM's names and labels (model_name on every series, finished_reason on
 * request_success_total), so its Grafana dashboard reads sluice unchanged;
 * chats and batch rows alike, as vLLM counts every request its engine runs. */
static void vllm_metrics(struct server *s, struct evbuffer *o, const struct sched_engine_stats *st)
{
    char lbl[600];
    model_label(s, lbl, sizeof lbl);
    static struct srv_req_metrics snap; /* a consistent copy (api thread only; too large for the stack) */
    pthread_mutex_lock(&s->vm_mu);
    snap = s->vm;
    pthread_mutex_unlock(&s->vm_mu);
    const struct srv_req_metrics *m = &snap;
    double usage = st->kv.blocks_total ? (double)st->kv.blocks_used / st->kv.blocks_total : 0.0;
#define VG(n, h, fmt, v) evbuffer_add_printf(o, "# HELP vllm:" n " " h "\n# TYPE vllm:" n " gauge\nvllm:" n "{%s} " fmt "\n", lbl, v)
#define VC(n, h, v) evbuffer_add_printf(o, "# HELP vllm:" n " " h "\n# TYPE vllm:" n " counter\nvllm:" n "{%s} %llu\n", lbl, (unsigned long long)(v))
    VG("num_requests_running", "Number of requests in model execution batches.", "%d", st->sched.n_running);
    VG("num_requests_waiting", "Number of requests waiting to be processed.", "%d", st->sched.n_waiting);
    VG("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", "%.6f", usage);
    VG("gpu_cache_usage_perc", "KV-cache usage (the name older dashboards read). 1 means 100 percent usage.", "%.6f",
       usage);
    VC("prefix_cache_queries_total", "Prefix cache queries, in terms of number of queried tokens.", st->kv.query_tokens);
    VC("prefix_cache_hits_total", "Prefix cache hits, in terms of number of cached tokens.", st->kv.hit_tokens);
    VC("num_preemptions_total", "Cumulative number of preemption from the engine.", st->sched.preemptions);
    VC("prompt_tokens_total", "Number of prefill tokens processed.", m->prompt_tokens);
    VC("generation_tokens_total", "Number of generation tokens processed.", m->gen_tokens);
    if (s->eng && sched_engine_config(s->eng)->spec.method != SCHED_SPEC_NONE) {
        /* speculative decoding, as vLLM names it: mean accepted length = 1 + accepted / drafts */
        const struct sched_stats *ss = &st->sched;
        VC("spec_decode_num_drafts_total", "Number of spec decoding drafts.", ss->spec_drafts);
        VC("spec_decode_num_draft_tokens_total", "Number of draft tokens.", ss->spec_draft_tokens);
        VC("spec_decode_num_accepted_tokens_total", "Number of accepted tokens.", ss->spec_accepted_tokens);
        evbuffer_add_printf(o, "# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft "
                               "position.\n# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter\n");
        for (int i = 0; i < sched_engine_config(s->eng)->spec.num_speculative_tokens; i++)
            evbuffer_add_printf(o, "vllm:spec_decode_num_accepted_tokens_per_pos_total{%s,position=\"%d\"} %llu\n", lbl,
                                i, (unsigned long long)ss->spec_accepted_per_pos[i]);
    }
#undef VG
#undef VC
    static const char *const fin[SRV_N_FIN] = {"stop", "length", "abort", "error"};
    evbuffer_add_printf(o, "# HELP vllm:request_success_total Count of successfully processed requests.\n"
                           "# TYPE vllm:request_success_total counter\n");
    for (int f = 0; f < SRV_N_FIN; f++)
        evbuffer_add_printf(o, "vllm:request_success_total{%s,finished_reason=\"%s\"} %llu\n", lbl, fin[f],
                            (unsigned long long)(m->finished[0][f] + m->finished[1][f]));
    vhist_out(o, "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", lbl, &m->e2e,
              lat_bounds, NB(lat_bounds));
    vhist_out(o, "vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", lbl,
              &m->queue, lat_bounds, NB(lat_bounds));
    vhist_out(o, "vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.", lbl,
              &m->prefill, lat_bounds, NB(lat_bounds));
    vhist_out(o, "vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.", lbl,
              &m->decode, lat_bounds, NB(lat_bounds));
    vhist_out(o, "vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.", lbl,
              &m->inference, lat_bounds, NB(lat_bounds));
    vhist_out(o, "vllm:request_time_per_output_token_seconds", "Histogram of time_per_output_token_seconds per request.",
              lbl, &m->tpot, tpot_bounds, NB(tpot_bounds));
    vhist_out(o, "vllm:request_prompt_tokens", "Number of prefill tokens processed.", lbl, &m->prompt_len, tok_bounds,
              NB(tok_bounds));
    vhist_out(o, "vllm:request_generation_tokens", "Number of generation tokens processed.", lbl, &m->gen_len,
              tok_bounds, NB(tok_bounds));
    /* one sequence per request here (each choice of n is its own): its generation tokens */
    vhist_out(o, "vllm:request_max_num_generation_tokens", "Histogram of maximum number of requested generation tokens.",
              lbl, &m->gen_len, tok_bounds, NB(tok_bounds));
    sched_hist_sum_out(o, "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", lbl,
                       st->sched.ttft, SCHED_N_PRIO);
    sched_hist_sum_out(o, "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", lbl,
                       st->sched.itl, SCHED_N_PRIO);
    sched_hist_sum_out(o, "vllm:time_per_output_token_seconds",
                       "Histogram of time per output token in seconds (the name older dashboards read).", lbl,
                       st->sched.itl, SCHED_N_PRIO);
    /* sluice's own split of the same requests: chat against batch */
    static const char *const cls[2] = {"interactive", "batch"};
    evbuffer_add_printf(o, "# HELP sluice:requests_finished_total Engine requests finished, per class (chat or "
                           "batch) and finish reason.\n# TYPE sluice:requests_finished_total counter\n");
    for (int c = 0; c < 2; c++)
        for (int f = 0; f < SRV_N_FIN; f++)
            evbuffer_add_printf(o, "sluice:requests_finished_total{class=\"%s\",finished_reason=\"%s\"} %llu\n", cls[c],
                                fin[f], (unsigned long long)m->finished[c][f]);
}

void srv_handle_metrics(struct server *s, struct evhttp_request *req)
{
    struct evbuffer *o = evbuffer_new();
    if (!o) return;
    struct sched_engine_stats st;
    memset(&st, 0, sizeof st);
    if (s->eng) sched_engine_get_stats(s->eng, &st);
    double hit = st.kv.query_tokens ? (double)st.kv.hit_tokens / (double)st.kv.query_tokens : 0.0;
#define GAUGE(n, h, fmt, v) evbuffer_add_printf(o, "# HELP sluice:" n " " h "\n# TYPE sluice:" n " gauge\nsluice:" n " " fmt "\n", v)
#define COUNTER(n, h, v) evbuffer_add_printf(o, "# HELP sluice:" n " " h "\n# TYPE sluice:" n " counter\nsluice:" n " %llu\n", (unsigned long long)(v))
    /* what the web page's status panel shows beside the gauges */
    evbuffer_add_printf(o, "# HELP sluice:server_info The server: version, backend, GPUs per model.\n# TYPE "
                        "sluice:server_info gauge\nsluice:server_info{version=\"%s\",backend=\"%s\","
                        "tensor_parallel_size=\"%ld\"} 1\n", SLUICE_VERSION, s->be ? s->be->ops->name : "",
                        s->o.tensor_parallel_size);
    GAUGE("num_requests_running", "Requests running in the engine.", "%d", st.sched.n_running);
    GAUGE("num_requests_waiting", "Requests waiting to be scheduled.", "%d", st.sched.n_waiting);
    GAUGE("kv_blocks_total", "KV cache blocks in the pool.", "%d", st.kv.blocks_total);
    GAUGE("kv_blocks_used", "KV cache blocks held by running requests.", "%d", st.kv.blocks_used);
    GAUGE("kv_blocks_cached", "Free KV blocks still holding a cached prefix.", "%d", st.kv.blocks_cached);
    GAUGE("kv_cache_usage_perc", "Fraction of KV blocks in use.", "%.6f",
          st.kv.blocks_total ? (double)st.kv.blocks_used / st.kv.blocks_total : 0.0);
    GAUGE("prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / prompt tokens looked up.", "%.6f", hit);
    COUNTER("prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.", st.kv.query_tokens);
    COUNTER("prefix_cache_hits_total", "Prompt tokens served from the prefix cache.", st.kv.hit_tokens);
    COUNTER("prompt_tokens_total", "Prompt tokens of finished requests.", s->prompt_tokens_total);
    COUNTER("generation_tokens_total", "Generated tokens of finished requests.", s->generation_tokens_total);
    COUNTER("prefill_tokens_computed_total", "Prompt tokens run through the model (recomputation included).",
            st.sched.prompt_tokens_computed);
    COUNTER("decode_tokens_total", "Decode tokens run through the model.", st.sched.decode_tokens);
    COUNTER("engine_steps_total", "Engine steps run.", st.sched.steps);
    COUNTER("num_preemptions_total", "Sequences preempted (for KV blocks, or to free a slot for interactive work).", st.sched.preemptions);
    COUNTER("request_success_total", "Requests answered.", s->n_requests_ok);
    COUNTER("request_failure_total", "Requests refused or failed.", s->n_requests_err);
    GAUGE("avg_seqs_per_step", "Sequences per engine step, on average (tokens run / steps, decode only).", "%.4f",
          st.sched.steps ? (double)(st.sched.decode_tokens) / (double)st.sched.steps : 0.0);
    /* the scheduler's side: per class (chat against batch), its step plans against what ran */
    static const char *const cls[SCHED_N_PRIO] = {"interactive", "batch"};
    static const char *const terms[SCHED_COST_N] = {"step", "prefill_token", "prefill_pair", "decode_token",
                                                    "decode_key", "sample"};
    const struct sched_stats *ss = &st.sched;
    evbuffer_add_printf(o, "# HELP sluice:tokens_computed_total Prompt and decode tokens run through the model, per "
                           "class.\n# TYPE sluice:tokens_computed_total counter\n");
    for (int c = 0; c < SCHED_N_PRIO; c++)
        evbuffer_add_printf(o, "sluice:tokens_computed_total{class=\"%s\"} %llu\n", cls[c],
                            (unsigned long long)ss->class_tokens[c]);
    GAUGE("batch_throughput_tokens_per_second", "Batch tokens (prompt and decode) run a second, over the last ~10 s of "
          "steps.", "%.1f", ss->batch_tok_s);
    COUNTER("batch_decodes_sat_out_total", "Batch decodes left out of a step to keep it within the latency targets "
            "(their KV stays).", ss->decodes_sat_out);
    GAUGE("step_time_planned_last_seconds", "The last step's time as the cost model planned it.", "%.6f",
          ss->last_planned_s);
    GAUGE("step_time_measured_last_seconds", "The last step's time as it ran.", "%.6f", ss->last_measured_s);
    GAUGE("step_time_limit_last_seconds", "The last step's time limit from the latency targets (0: none).", "%.6f",
          ss->last_limit_s);
    evbuffer_add_printf(o, "# HELP sluice:step_cost_coefficient_seconds The step cost model, calibrated from the "
                           "measured steps: seconds per unit of each term.\n"
                           "# TYPE sluice:step_cost_coefficient_seconds gauge\n");
    for (int i = 0; i < SCHED_COST_N; i++)
        evbuffer_add_printf(o, "sluice:step_cost_coefficient_seconds{term=\"%s\"} %.9g\n", terms[i], ss->cost[i]);
    sched_hist_out(o, "sluice:time_to_first_token_seconds", "Time to first token, per class (engine side).", "class",
                   cls, ss->ttft, SCHED_N_PRIO);
    sched_hist_out(o, "sluice:inter_token_latency_seconds", "Time between a sequence's tokens, per class (engine "
                   "side).", "class", cls, ss->itl, SCHED_N_PRIO);
    sched_hist_out(o, "sluice:step_time_planned_seconds", "Engine step time as the cost model planned it.", NULL,
                   NULL, &ss->step_planned, 1);
    sched_hist_out(o, "sluice:step_time_seconds", "Engine step time as measured (plan, forward, sampling).", NULL,
                   NULL, &ss->step_measured, 1);
#undef GAUGE
#undef COUNTER
    srv_batch_metrics(s, o);
    vllm_metrics(s, o, &st);
    hist_out(o, "sluice:e2e_request_latency_seconds", "Request latency.", &s->e2e);
    hist_out(o, "sluice:request_queue_time_seconds", "Time a request waited before the engine first admitted it.",
             &s->queue);
    evhttp_add_header(evhttp_request_get_output_headers(req), "Content-Type", "text/plain; version=0.0.4");
    evhttp_send_reply(req, 200, "OK", o);
    evbuffer_free(o);
}
