/* hc.c - the step's residual for hyper-connection layers (cuda/hc.h): the
 * sites' weights on each rank, the streams, and the calls enqueue() makes
 * around a block. */
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/cuda_internal.h"
#include "cuda/hc.h"

int cuda_hc_check(const struct model_config *c, char *err, size_t errlen)
{
    if (c->hc.mult > CUDA_HC_MAX_N) {
        sl_seterr(err, errlen, "cuda: hc_mult %d: the GPU backend takes up to %d hyper-connection streams (use --device cpu)",
                  c->hc.mult, CUDA_HC_MAX_N);
        return SL_EUNSUP;
    }
    return 0;
}

int cuda_hc_upload(struct rank *k, int l, char *err, size_t errlen)
{
    const struct cuda_backend *b = k->b;
    const struct model_config *c = &b->c;
    const struct model_layer_weights *lw = &b->w->layers[l];
    size_t N = (size_t)c->hc.mult, E = (size_t)c->n_embd, M = (2 + N) * N, T = (size_t)b->max_tokens;
    if (!k->hcx) {
        struct cuda_hc_rank *h = k->hcx = calloc(1, sizeof *h);
        if (!h) {
            sl_seterr(err, errlen, "out of host memory");
            return SL_ENOMEM;
        }
        if (cuda_dmalloc((void **)&h->xs, T * N * E * 4, err, errlen) ||
            cuda_dmalloc((void **)&h->part, cuda_hc_part_elems((int)T, (int)N, (int)E) * 4, err, errlen) ||
            cuda_dmalloc((void **)&h->post, T * N * 4, err, errlen) ||
            cuda_dmalloc((void **)&h->comb, T * N * N * 4, err, errlen))
            return SL_ENOMEM;
    }
    struct cuda_hc_layer *s = k->L[l].hc = calloc(1, sizeof *s);
    if (!s) {
        sl_seterr(err, errlen, "out of host memory");
        return SL_ENOMEM;
    }
    const struct model_hc_weights *ws[2] = {&lw->hc_attn, &lw->hc_ffn};
    for (int i = 0; i < 2; i++) {
        int rc;
        if ((rc = cuda_upload_vec(&ws[i]->fn, 0, M * N * E, NULL, &s->fn[i], err, errlen)) ||
            (rc = cuda_upload_vec(&ws[i]->base, 0, M, NULL, &s->base[i], err, errlen)) ||
            (rc = cuda_upload_vec(&ws[i]->scale, 0, 3, NULL, &s->scale[i], err, errlen)))
            return rc;
    }
    return 0;
}

void cuda_hc_free(struct rank *k, int l)
{
    struct cuda_hc_layer *s = k->L ? k->L[l].hc : NULL;
    if (s) {
        for (int i = 0; i < 2; i++) cudaFree(s->fn[i]), cudaFree(s->base[i]), cudaFree(s->scale[i]);
        free(s);
        k->L[l].hc = NULL;
    }
    struct cuda_hc_rank *h = k->hcx;
    if (h) {
        cudaFree(h->xs), cudaFree(h->part), cudaFree(h->post), cudaFree(h->comb);
        free(h);
        k->hcx = NULL;
    }
}

/* Trace entry `at` (rank 0, when asked): the streams of the step's T tokens. */
static int trace(struct rank *k, int at, int T, char *err, size_t errlen)
{
    const struct cuda_hc_rank *h = k->hcx;
    if (!h->trace || k->id != 0) return 0;
    enum cudaStreamCaptureStatus cs;
    if (cudaStreamIsCapturing(k->st, &cs) != cudaSuccess || cs != cudaStreamCaptureStatusNone) {
        sl_seterr(err, errlen, "cuda: the hidden-state trace needs a backend made with enforce_eager");
        return SL_EINVAL;
    }
    size_t n = (size_t)T * k->b->c.hc.mult * k->b->c.n_embd;
    CK(cudaMemcpyAsync(h->trace + (size_t)at * n, h->xs, n * sizeof(float), cudaMemcpyDeviceToHost, k->st));
    CK(cudaStreamSynchronize(k->st));
    return 0;
fail:
    return SL_EDEVICE;
}

int cuda_hc_begin(struct rank *k, int T, char *err, size_t errlen)
{
    const struct model_config *c = &k->b->c;
    CK(cuda_hc_expand(k->x, T, c->hc.mult, c->n_embd, k->hcx->xs, k->st));
    return trace(k, 0, T, err, errlen);
fail:
    return SL_EDEVICE;
}

int cuda_hc_in(struct rank *k, int l, int site, int T, char *err, size_t errlen)
{
    const struct model_config *c = &k->b->c;
    const struct cuda_hc_layer *s = k->L[l].hc;
    struct cuda_hc_rank *h = k->hcx;
    CK(cuda_hc_collapse(h->xs, s->fn[site], s->base[site], s->scale[site], T, c->hc.mult, c->n_embd,
                        c->hc.sinkhorn_iters, c->hc.eps, c->norm_eps, h->part, k->x, h->post, h->comb, k->st));
    CK(cuda_add_rmsnorm(k->x, NULL, site ? k->L[l].ffn_norm : k->L[l].attn_norm, NULL, T, c->n_embd, c->norm_eps,
                        k->xn, k->st));
    return 0;
fail:
    return SL_EDEVICE;
}

int cuda_hc_out(struct rank *k, int l, int site, int T, char *err, size_t errlen)
{
    const struct model_config *c = &k->b->c;
    struct cuda_hc_rank *h = k->hcx;
    CK(cuda_hc_writeback(h->xs, k->delta, h->post, h->comb, T, c->hc.mult, c->n_embd, k->st));
    return site ? trace(k, l + 1, T, err, errlen) : 0;
fail:
    return SL_EDEVICE;
}

int cuda_hc_final(struct rank *k, int T, char *err, size_t errlen)
{
    const struct model_config *c = &k->b->c;
    CK(cuda_hc_mean(k->hcx->xs, T, c->hc.mult, c->n_embd, k->x, k->st));
    return 0;
fail:
    return SL_EDEVICE;
}

void cuda_backend_trace(struct model_backend *mb, float *dst)
{
    struct cuda_backend *b = (struct cuda_backend *)mb;
    if (b && b->r && b->r[0].hcx) b->r[0].hcx->trace = dst;
}
