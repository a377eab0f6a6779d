/* quant.c - quantized weights (quant.h): the per-tensor format decision, the
 * quantization_config cross-check, and exact row dequantization.
 *
 * The file is the truth: which tensors exist for a module and their shapes
 * say its format (weight_packed: compressed-tensors; qweight [in][out/8]:
 * AWQ; qweight [in*bits/32][out]: GPTQ; an int8 weight with a weight_scale:
 * compressed-tensors int-quantized; a float weight: dense), its bits (packed
 * width against the columns), its group (scale columns), its zero points and
 * act-order index. The config is a second opinion: it names, for a module,
 * whether it is quantized and how (compressed-tensors resolves config_groups
 * targets and ignore entries the way compressed_tensors.utils.match does:
 * ignore first, then exact names, then re: patterns anchored at the start in
 * sorted order, then class names). Where the two disagree, loading stops
 * with both claims named: code that trusts either one alone is how a module
 * family ends up read in the wrong format.
 *
 * Dequantization: w = (q - zero) * scale with q and zero the stored unsigned
 * codes (compressed-tensors stores q + 2^(bits-1) and its zero points the
 * same way; symmetric weights have the zero 2^(bits-1)). The integer
 * difference times the scale is exact in f32; it is then rounded to the
 * scale's dtype, because every reference dequantizer (compressed-tensors'
 * _dequantize, AutoAWQ's dequantize_gemm, GPTQ's torch path) computes it in
 * that dtype.
 */
#define PCRE2_CODE_UNIT_WIDTH 8
#include "quant.h"

#include <math.h>
#include <pcre2.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/json.h"

enum qmethod { QM_CT, QM_AWQ, QM_GPTQ };

/* What the config says about one module's weight. */
struct claim {
    bool quant;
    int bits;
    int group;      /* 0: per channel */
    bool sym;
    bool act_order;
    bool known_sym; /* false where the file's zeros decide (AWQ/GPTQ store them either way) */
    bool float_type;/* a float scheme (fp8/fp4): not supported */
    const char *why;/* which config entry decided (for messages) */
};

struct target {
    char *text;        /* as written, "re:" included */
    int scheme;        /* index into schemes; -1 for ignore entries */
    pcre2_code *re;    /* compiled pattern for "re:" entries */
};

struct quant_cfg {
    enum qmethod method;
    char format[32];   /* compressed-tensors "format" */
    struct claim *schemes;
    int n_schemes;
    struct target *targets, *ignore;
    int n_targets, n_ignore;
    /* AWQ / GPTQ */
    int bits, group;
    bool sym, desc_act, lm_head, gptq_v2;
    char **not_convert;
    int n_not_convert;
    char why[64];
};

/* ---- dtype helpers -------------------------------------------------------------- */

static uint32_t rd32(const void *p, size_t i)
{
    uint32_t v;
    memcpy(&v, (const char *)p + 4 * i, 4);
    return v;
}

float quant_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else {
        uint32_t e = 113;
        while (!(man & 0x400)) {
            man <<= 1;
            e--;
        }
        bits = sign | (e << 23) | ((man & 0x3FF) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static float scale_at(const struct model_quant *q, size_t i)
{
    const uint8_t *p = q->scales;
    switch (q->scale_dt) {
    case MODEL_DT_F32: {
        float f;
        memcpy(&f, p + 4 * i, 4);
        return f;
    }
    case MODEL_DT_F16: return quant_f16_to_f32((uint16_t)(p[2 * i] | p[2 * i + 1] << 8));
    default: {
        uint32_t bits = (uint32_t)(p[2 * i] | p[2 * i + 1] << 8) << 16;
        float f;
        memcpy(&f, &bits, 4);
        return f;
    }
    }
}

/* f32 -> bf16 -> f32, round to nearest even (finite inputs). */
float quant_round_bf16(float x)
{
    uint32_t u;
    memcpy(&u, &x, 4);
    u += 0x7FFFu + ((u >> 16) & 1u);
    u &= 0xFFFF0000u;
    memcpy(&x, &u, 4);
    return x;
}

/* f32 -> f16 -> f32, round to nearest even, subnormals and overflow to inf
 * as IEEE conversion does. */
static float round_f16(float x)
{
    uint32_t u;
    memcpy(&u, &x, 4);
    uint32_t sign = u & 0x80000000u, a = u & 0x7FFFFFFFu;
    uint16_t h;
    if (a >= 0x7F800000u) {
        h = (uint16_t)(sign >> 16 | 0x7C00 | (a > 0x7F800000u ? 0x200 : 0));
    } else if (a >= 0x477FF000u) { /* rounds to >= 65520: inf */
        h = (uint16_t)(sign >> 16 | 0x7C00);
    } else if (a >= 0x38800000u) { /* normal half */
        uint32_t r = a + 0x0FFFu + ((a >> 13) & 1u);
        h = (uint16_t)(sign >> 16 | ((r - 0x38000000u) >> 13));
    } else { /* subnormal half or zero: units of 2^-24, value = man * 2^(e - 126) units */
        uint32_t e = a >> 23, man = (a & 0x7FFFFFu) | 0x800000u, v = 0;
        uint32_t shift = 126 - e; /* >= 14 here */
        if (e != 0 && shift <= 24) {
            v = man >> shift;
            uint32_t rem = man & ((1u << shift) - 1), halfway = 1u << (shift - 1);
            if (rem > halfway || (rem == halfway && (v & 1))) v++;
        }
        h = (uint16_t)(sign >> 16 | v);
    }
    return quant_f16_to_f32(h);
}

static float round_to(float x, enum model_dtype dt)
{
    return dt == MODEL_DT_BF16 ? quant_round_bf16(x) : dt == MODEL_DT_F16 ? round_f16(x) : x;
}

/* ---- dequantization ------------------------------------------------------------- */

static const int awq_pos[8] = {0, 4, 1, 5, 2, 6, 3, 7}; /* nibble holding column 8c + j */

static inline int group_of(const struct model_quant *q, int64_t k)
{
    if (q->g_idx) return (int)rd32(q->g_idx, (size_t)k);
    return (int)(k / q->group);
}

/* The stored (unsigned) zero code of row r, group g. */
static inline int zero_of(const struct model_quant *q, int64_t r, int64_t g)
{
    int bits = q->bits, mask = (1 << bits) - 1;
    switch (q->layout) {
    case MODEL_QL_CT:
        if (!q->zeros) return 1 << (bits - 1);
        return (int)((rd32(q->zeros, (size_t)((r * bits / 32) * q->n_groups + g)) >> ((r * bits) % 32)) & mask);
    case MODEL_QL_CT_INT:
        return q->zeros ? ((const int8_t *)q->zeros)[r * q->n_groups + g] : 0;
    case MODEL_QL_AWQ:
        return (int)((rd32(q->zeros, (size_t)(g * (q->rows / 8) + r / 8)) >> (4 * awq_pos[r % 8])) & 0xF);
    case MODEL_QL_GPTQ: {
        int pf = 32 / bits;
        return (int)((rd32(q->zeros, (size_t)(g * (q->rows / pf) + r / pf)) >> (bits * (r % pf))) & mask) +
               q->zero_add;
    }
    }
    return 0;
}

/* The stored code of row r, column k. */
static inline int code_of(const struct model_quant *q, int64_t r, int64_t k)
{
    int bits = q->bits, mask = (1 << bits) - 1;
    switch (q->layout) {
    case MODEL_QL_CT:
        return (int)((rd32(q->qweight, (size_t)(r * (q->cols * bits / 32) + k * bits / 32)) >> ((k * bits) % 32)) &
                     mask);
    case MODEL_QL_CT_INT: return ((const int8_t *)q->qweight)[r * q->cols + k];
    case MODEL_QL_AWQ:
        return (int)((rd32(q->qweight, (size_t)(k * (q->rows / 8) + r / 8)) >> (4 * awq_pos[r % 8])) & 0xF);
    case MODEL_QL_GPTQ: {
        int pf = 32 / bits;
        return (int)((rd32(q->qweight, (size_t)((k / pf) * q->rows + r)) >> (bits * (k % pf))) & mask);
    }
    }
    return 0;
}

/* Scale of row r, group g. */
static inline float scale_of(const struct model_quant *q, int64_t r, int64_t g)
{
    if (q->layout == MODEL_QL_AWQ || q->layout == MODEL_QL_GPTQ) return scale_at(q, (size_t)(g * q->rows + r));
    return scale_at(q, (size_t)(r * q->n_groups + g));
}

void quant_deq_row(const struct model_quant *q, int64_t r, float *dst)
{
    int64_t n = q->cols;
    if (q->g_idx) {
        for (int64_t k = 0; k < n; k++) {
            int g = group_of(q, k);
            dst[k] = round_to((float)(code_of(q, r, k) - zero_of(q, r, g)) * scale_of(q, r, g), q->scale_dt);
        }
        return;
    }
    if (q->layout == MODEL_QL_CT && q->bits == 4) {
        /* the common case, one word (8 codes) at a time */
        const uint8_t *row = (const uint8_t *)q->qweight + (size_t)r * (size_t)(n / 8) * 4;
        for (int64_t g = 0; g < q->n_groups; g++) {
            float s = scale_of(q, r, g);
            int z = zero_of(q, r, g);
            int64_t k0 = g * q->group, k1 = k0 + q->group < n ? k0 + q->group : n;
            int64_t k = k0;
#if defined(__AVX2__)
            if (q->scale_dt == MODEL_DT_BF16 && k0 % 8 == 0) {
                /* the same arithmetic 8 lanes wide: exact product, then round to nearest even bf16 */
                const __m256i sh = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28), m4 = _mm256_set1_epi32(0xF),
                              zv = _mm256_set1_epi32(z), one = _mm256_set1_epi32(1),
                              bias = _mm256_set1_epi32(0x7FFF), hi = _mm256_set1_epi32((int)0xFFFF0000u);
                const __m256 sv = _mm256_set1_ps(s);
                for (; k + 8 <= k1; k += 8) {
                    uint32_t w;
                    memcpy(&w, row + (k / 8) * 4, 4);
                    __m256i c = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)w), sh), m4);
                    __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(c, zv)), sv);
                    __m256i b = _mm256_castps_si256(v);
                    b = _mm256_add_epi32(b, _mm256_add_epi32(bias, _mm256_and_si256(_mm256_srli_epi32(b, 16), one)));
                    _mm256_storeu_si256((__m256i *)(dst + k), _mm256_and_si256(b, hi));
                }
            }
#endif
            for (; k < k1; k += 8) {
                uint32_t w;
                memcpy(&w, row + (k / 8) * 4, 4);
                for (int j = 0; j < 8; j++)
                    dst[k + j] = round_to((float)((int)((w >> (4 * j)) & 0xF) - z) * s, q->scale_dt);
            }
        }
        return;
    }
    for (int64_t g = 0; g < q->n_groups; g++) {
        float s = scale_of(q, r, g);
        int z = zero_of(q, r, g);
        int64_t k0 = g * q->group, k1 = k0 + q->group < n ? k0 + q->group : n;
        for (int64_t k = k0; k < k1; k++) dst[k] = round_to((float)(code_of(q, r, k) - z) * s, q->scale_dt);
    }
}

/* ---- the GPU kernels' layout (model_qrepack) ------------------------------------ */

void model_qrepack_free(struct model_qrepack *p)
{
    if (!p) return;
    free(p->qw);
    free(p->scales);
    free(p->zeros);
    free(p->perm);
    memset(p, 0, sizeof *p);
}

/* The raw 16-bit scale of row r, group g (F16 or BF16 scales). */
static uint16_t scale_raw(const struct model_quant *q, int64_t r, int64_t g)
{
    size_t i = q->layout == MODEL_QL_AWQ || q->layout == MODEL_QL_GPTQ ? (size_t)(g * q->rows + r)
                                                                         : (size_t)(r * q->n_groups + g);
    const uint8_t *b = (const uint8_t *)q->scales + 2 * i;
    return (uint16_t)(b[0] | b[1] << 8);
}

int model_quant_repack(const struct model_tensor *t, int64_t r0, int64_t nr, int64_t c0, int64_t nc,
                       struct model_qrepack *out, char *err, size_t errlen)
{
    const struct model_quant *q = t->quant;
    const char *name = t->name ? t->name : "?";
    memset(out, 0, sizeof *out);
    if (t->dtype != MODEL_DT_QPACK || !q || r0 < 0 || nr <= 0 || c0 < 0 || nc <= 0 || r0 + nr > q->rows ||
        c0 + nc > q->cols) {
        sl_seterr(err, errlen, "%s: rows [%lld, %lld) x columns [%lld, %lld) of a packed weight out of range", name,
                  (long long)r0, (long long)(r0 + nr), (long long)c0, (long long)(c0 + nc));
        return SL_EINVAL;
    }
    if (q->scale_dt != MODEL_DT_F16 && q->scale_dt != MODEL_DT_BF16) {
        sl_seterr(err, errlen, "%s: %s scales (the GPU layout holds f16 or bf16)", name, model_dtype_name(q->scale_dt));
        return SL_EUNSUP;
    }
    bool channel = q->n_groups == 1;
    /* the block's columns in the order the kernels read them, and the
     * source group of each of the block's groups */
    int64_t *src_col = malloc((size_t)nc * sizeof *src_col);
    int64_t ng = channel ? 1 : (nc + q->group - 1) / q->group;
    int64_t *src_g = malloc((size_t)ng * sizeof *src_g);
    int rc = SL_ENOMEM;
    if (!src_col || !src_g) {
        sl_seterr(err, errlen, "out of memory");
        goto fail;
    }
    bool permuted = false;
    if (channel) {
        for (int64_t k = 0; k < nc; k++) src_col[k] = c0 + k;
        src_g[0] = 0;
    } else if (q->g_idx && q->act_order) {
        /* stable counting sort of the block's columns by group */
        int64_t *cnt = calloc((size_t)q->n_groups + 1, sizeof *cnt);
        if (!cnt) {
            sl_seterr(err, errlen, "out of memory");
            goto fail;
        }
        for (int64_t k = 0; k < nc; k++) {
            int64_t g = group_of(q, c0 + k);
            if (g < 0 || g >= q->n_groups) {
                free(cnt);
                sl_seterr(err, errlen, "%s: g_idx[%lld] = %lld, outside its %lld groups", name, (long long)(c0 + k),
                          (long long)g, (long long)q->n_groups);
                rc = SL_EINVAL;
                goto fail;
            }
            cnt[g + 1]++;
        }
        for (int64_t g = 0; g < q->n_groups; g++) cnt[g + 1] += cnt[g];
        for (int64_t k = 0; k < nc; k++) src_col[cnt[group_of(q, c0 + k)]++] = c0 + k;
        free(cnt);
        for (int64_t j = 0; j < ng; j++) {
            int64_t a = j * q->group, b = a + q->group < nc ? a + q->group : nc;
            src_g[j] = group_of(q, src_col[a]);
            for (int64_t k = a; k < b; k++)
                if (group_of(q, src_col[k]) != src_g[j]) {
                    sl_seterr(err, errlen,
                              "%s: act-order groups of uneven size in columns [%lld, %lld) (the GPU layout takes "
                              "groups of %d consecutive columns once sorted)",
                              name, (long long)c0, (long long)(c0 + nc), q->group);
                    rc = SL_EUNSUP;
                    goto fail;
                }
        }
        for (int64_t k = 0; k < nc; k++) permuted |= src_col[k] != c0 + k;
    } else {
        if (c0 % q->group) {
            sl_seterr(err, errlen,
                      "%s: a shard of columns [%lld, %lld) cuts its quantization groups of %d columns (a "
                      "tensor-parallel shard of %lld columns must start at a group boundary)",
                      name, (long long)c0, (long long)(c0 + nc), q->group, (long long)nc);
            rc = SL_EINVAL;
            goto fail;
        }
        for (int64_t k = 0; k < nc; k++) src_col[k] = c0 + k;
        for (int64_t j = 0; j < ng; j++) src_g[j] = c0 / q->group + j;
    }
    if (!channel && q->group % 8) {
        sl_seterr(err, errlen, "%s: groups of %d columns (the GPU kernels take multiples of 8)", name, q->group);
        rc = SL_EUNSUP;
        goto fail;
    }
    out->bits = q->bits;
    out->rows = nr, out->cols = nc;
    out->group = channel ? (int)nc : q->group;
    out->n_groups = (int)ng;
    out->row_bytes = ((nc * q->bits + 7) / 8 + 15) / 16 * 16;
    out->f16 = q->scale_dt == MODEL_DT_F16;
    out->qw = calloc((size_t)(nr * out->row_bytes), 1);
    out->scales = malloc((size_t)(nr * ng) * 2);
    out->zeros = malloc((size_t)(nr * ng));
    if (permuted) out->perm = malloc((size_t)nc * 4);
    if (!out->qw || !out->scales || !out->zeros || (permuted && !out->perm)) {
        sl_seterr(err, errlen, "out of memory");
        goto fail;
    }
    if (permuted)
        for (int64_t k = 0; k < nc; k++) out->perm[k] = (int32_t)(src_col[k] - c0);
    /* int-quantized int8 stores q and its zero signed: both move up by 128 */
    int shift = q->layout == MODEL_QL_CT_INT ? 128 : 0, zsym = 1 << (q->bits - 1);
    bool all_sym = true;
    for (int64_t r = 0; r < nr; r++) {
        int64_t sr = r0 + r;
        for (int64_t j = 0; j < ng; j++) {
            int z = zero_of(q, sr, src_g[j]) + shift;
            if (z < 0 || z > 255) {
                sl_seterr(err, errlen, "%s: zero point %d of row %lld (the GPU layout holds 0..255)", name, z - shift,
                          (long long)sr);
                rc = SL_EUNSUP;
                goto fail;
            }
            all_sym &= z == zsym;
            out->zeros[r * ng + j] = (uint8_t)z;
            out->scales[r * ng + j] = scale_raw(q, sr, src_g[j]);
        }
    }
    /* the codes: an 8B model's billions of them, so rows in parallel, and
     * compressed-tensors int4 (the common case) a word at a time */
    bool ct4 = q->layout == MODEL_QL_CT && q->bits == 4 && !permuted && c0 % 8 == 0;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < nr; r++) {
        int64_t sr = r0 + r;
        uint8_t *row = out->qw + r * out->row_bytes;
        int64_t k = 0;
        if (ct4) {
            const uint8_t *src = (const uint8_t *)q->qweight + (size_t)(sr * (q->cols / 8) + c0 / 8) * 4;
            for (; k + 8 <= nc; k += 8) {
                uint32_t w, o = 0;
                memcpy(&w, src + k / 2, 4);
                for (int j = 0; j < 8; j++) o |= ((w >> (4 * j)) & 0xFu) << (4 * (j / 2 + 4 * (j % 2)));
                memcpy(row + k / 2, &o, 4);
            }
        }
        for (; k < nc; k++) {
            int u = code_of(q, sr, src_col[k]) + shift;
            if (q->bits == 8) {
                row[k] = (uint8_t)u;
            } else {
                int nib = (int)(k % 8 / 2 + 4 * (k % 2)); /* see model_qrepack */
                row[k / 8 * 4 + nib / 2] |= (uint8_t)((u & 0xF) << (4 * (nib % 2)));
            }
        }
    }
    if (all_sym) {
        free(out->zeros);
        out->zeros = NULL;
    }
    free(src_col);
    free(src_g);
    return 0;
fail:
    free(src_col);
    free(src_g);
    model_qrepack_free(out);
    return rc;
}

void model_qrepack_row(const struct model_qrepack *p, int64_t r, float *dst)
{
    const uint8_t *row = p->qw + r * p->row_bytes;
    enum model_dtype dt = p->f16 ? MODEL_DT_F16 : MODEL_DT_BF16;
    for (int64_t k = 0; k < p->cols; k++) {
        int g = (int)(k / p->group);
        int nib = (int)(k % 8 / 2 + 4 * (k % 2));
        int u = p->bits == 8 ? row[k] : (row[k / 8 * 4 + nib / 2] >> (4 * (nib % 2))) & 0xF;
        int z = p->zeros ? p->zeros[r * p->n_groups + g] : 1 << (p->bits - 1);
        uint16_t sb = p->scales[r * p->n_groups + g];
        float s;
        if (p->f16) {
            s = quant_f16_to_f32(sb);
        } else {
            uint32_t b = (uint32_t)sb << 16;
            memcpy(&s, &b, 4);
        }
        dst[p->perm ? p->perm[k] : k] = round_to((float)(u - z) * s, dt);
    }
}

void model_quant_describe(const struct model_quant *q, char *out, size_t cap)
{
    char grp[24];
    if (q->group >= q->cols)
        snprintf(grp, sizeof grp, "channel");
    else
        snprintf(grp, sizeof grp, "g%d", q->group);
    const char *lay = q->layout == MODEL_QL_AWQ    ? " (awq)"
                      : q->layout == MODEL_QL_GPTQ ? (q->zero_add ? " (gptq)" : " (gptq v2)")
                      : q->layout == MODEL_QL_CT_INT ? " (int-quantized)"
                                                     : "";
    snprintf(out, cap, "int%d %s %s%s%s", q->bits, grp, q->sym ? "sym" : "asym", q->act_order ? " act-order" : "",
             lay);
}

/* ---- config ---------------------------------------------------------------------- */

static void claim_str(const struct claim *c, char *out, size_t cap)
{
    if (!c->quant) {
        snprintf(out, cap, "not quantized (%s)", c->why ? c->why : "no target matches");
        return;
    }
    char grp[24];
    if (c->group <= 0)
        snprintf(grp, sizeof grp, "channel");
    else
        snprintf(grp, sizeof grp, "g%d", c->group);
    snprintf(out, cap, "int%d %s%s%s (%s)", c->bits, grp, !c->known_sym ? "" : c->sym ? " sym" : " asym",
             c->act_order ? " act-order" : "", c->why ? c->why : "");
}

static void targets_free(struct target *t, int n)
{
    for (int i = 0; i < n; i++) {
        free(t[i].text);
        if (t[i].re) pcre2_code_free(t[i].re);
    }
    free(t);
}

void quant_cfg_free(struct quant_cfg *qc)
{
    if (!qc) return;
    free(qc->schemes);
    targets_free(qc->targets, qc->n_targets);
    targets_free(qc->ignore, qc->n_ignore);
    for (int i = 0; i < qc->n_not_convert; i++) free(qc->not_convert[i]);
    free(qc->not_convert);
    free(qc);
}

static int jint(const json_doc *d, int obj, const char *key, int def)
{
    int i = obj >= 0 ? json_get(d, obj, key) : -1;
    int64_t v;
    return i >= 0 && json_i64(d, i, &v) == 0 && v >= -1 && v <= (1 << 30) ? (int)v : def;
}

static bool jbool(const json_doc *d, int obj, const char *key, bool def)
{
    int i = obj >= 0 ? json_get(d, obj, key) : -1;
    bool v;
    return i >= 0 && json_bool(d, i, &v) == 0 ? v : def;
}

static int add_target(struct target **arr, int *n, const json_doc *d, int tok, int scheme, char *err, size_t errlen)
{
    char *s = json_strdup(d, tok, NULL);
    if (!s) {
        sl_seterr(err, errlen, "quantization_config: a target or ignore entry is not a string");
        return SL_EFORMAT;
    }
    /* a later config group naming the same target replaces the earlier one (an OrderedDict in the library) */
    for (int i = 0; i < *n; i++)
        if (strcmp((*arr)[i].text, s) == 0) {
            (*arr)[i].scheme = scheme;
            free(s);
            return 0;
        }
    struct target *t = realloc(*arr, sizeof **arr * (size_t)(*n + 1));
    if (!t) {
        free(s);
        return SL_ENOMEM;
    }
    *arr = t;
    struct target *e = &t[(*n)++];
    e->text = s;
    e->scheme = scheme;
    e->re = NULL;
    if (strncmp(s, "re:", 3) == 0) {
        int ec;
        PCRE2_SIZE eo;
        e->re = pcre2_compile((PCRE2_SPTR)(s + 3), PCRE2_ZERO_TERMINATED, PCRE2_ANCHORED | PCRE2_UTF, &ec, &eo, NULL);
        if (!e->re) {
            PCRE2_UCHAR msg[128];
            pcre2_get_error_message(ec, msg, sizeof msg);
            sl_seterr(err, errlen, "quantization_config: bad pattern '%s': %s at %zu", s, (char *)msg, (size_t)eo);
            return SL_EFORMAT;
        }
    }
    return 0;
}

/* One config group's "weights" arguments. */
static int parse_scheme(const json_doc *d, int grp, const char *gname, struct claim *c, char *err, size_t errlen)
{
    memset(c, 0, sizeof *c);
    int ia = json_get(d, grp, "input_activations");
    if (ia >= 0 && !json_is_null(d, ia)) {
        /* running such a checkpoint with bf16 activations would not compute what it was made for */
        sl_seterr(err, errlen, "quantization_config: config group %s quantizes input activations (W8A8-style): "
                  "not supported, only weight-only (A16) schemes are", gname);
        return SL_EUNSUP;
    }
    int w = json_get(d, grp, "weights");
    if (w < 0 || json_is_null(d, w)) return 0; /* activations only: the weight stays as it is */
    if (!json_is_obj(d, w)) {
        sl_seterr(err, errlen, "quantization_config: config group %s: weights is not an object", gname);
        return SL_EFORMAT;
    }
    c->quant = true;
    c->known_sym = true;
    c->bits = jint(d, w, "num_bits", 8);
    c->sym = jbool(d, w, "symmetric", true);
    int ty = json_get(d, w, "type");
    c->float_type = ty >= 0 && json_str_eq(d, ty, "float");
    int st = json_get(d, w, "strategy");
    char strat[32] = "";
    if (st >= 0 && json_is_str(d, st)) json_str(d, st, strat, sizeof strat);
    if (strcmp(strat, "group") == 0) {
        c->group = jint(d, w, "group_size", 0);
        if (c->group <= 0) {
            sl_seterr(err, errlen, "quantization_config: config group %s: group strategy without a group_size", gname);
            return SL_EFORMAT;
        }
    } else if (strcmp(strat, "channel") == 0) {
        c->group = 0;
    } else if (!c->float_type) {
        sl_seterr(err, errlen, "quantization_config: config group %s: weight strategy '%s' is not supported "
                  "(group or channel)", gname, strat);
        return SL_EUNSUP;
    }
    int ao = json_get(d, w, "actorder");
    bool aob;
    c->act_order = ao >= 0 && ((json_is_str(d, ao) && json_str_eq(d, ao, "group")) ||
                               (json_bool(d, ao, &aob) == 0 && aob));
    return 0;
}

static int parse_ct(struct quant_cfg *qc, const json_doc *d, int o, char *err, size_t errlen)
{
    int f = json_get(d, o, "format");
    if (f >= 0 && json_is_str(d, f)) json_str(d, f, qc->format, sizeof qc->format);
    int cg = json_get(d, o, "config_groups");
    if (cg >= 0 && json_is_obj(d, cg)) {
        int n = json_size(d, cg);
        qc->schemes = calloc((size_t)n + 1, sizeof *qc->schemes);
        if (!qc->schemes) return SL_ENOMEM;
        int key = cg + 1;
        for (int g = 0; g < n; g++, key = json_skip(d, key + 1)) {
            char gname[64] = "?";
            json_str(d, key, gname, sizeof gname);
            int rc = parse_scheme(d, key + 1, gname, &qc->schemes[g], err, errlen);
            if (rc) return rc;
            qc->n_schemes++;
            int tg = json_get(d, key + 1, "targets");
            if (tg < 0 || !json_is_arr(d, tg)) {
                sl_seterr(err, errlen, "quantization_config: config group %s has no targets list", gname);
                return SL_EFORMAT;
            }
            for (int k = 0; k < json_size(d, tg); k++)
                if ((rc = add_target(&qc->targets, &qc->n_targets, d, json_at(d, tg, k), g, err, errlen))) return rc;
        }
    }
    int ig = json_get(d, o, "ignore");
    if (ig >= 0 && json_is_arr(d, ig))
        for (int k = 0; k < json_size(d, ig); k++) {
            int rc = add_target(&qc->ignore, &qc->n_ignore, d, json_at(d, ig, k), -1, err, errlen);
            if (rc) return rc;
        }
    return 0;
}

int quant_cfg_parse(const char *text, size_t len, struct quant_cfg **out, char *err, size_t errlen)
{
    *out = NULL;
    json_doc d;
    char jerr[128];
    if (json_parse(&d, text, len, jerr, sizeof jerr) != 0) {
        sl_seterr(err, errlen, "config.json: %s", jerr);
        return SL_EFORMAT;
    }
    int o = json_get(&d, 0, "quantization_config");
    int tc = json_get(&d, 0, "text_config");
    if (o < 0 && tc >= 0 && json_is_obj(&d, tc)) o = json_get(&d, tc, "quantization_config");
    if (o < 0 || json_is_null(&d, o)) {
        json_free(&d);
        return 0;
    }
    int rc = SL_EFORMAT;
    struct quant_cfg *qc = calloc(1, sizeof *qc);
    if (!qc) {
        rc = SL_ENOMEM;
        goto fail;
    }
    int m = json_is_obj(&d, o) ? json_get(&d, o, "quant_method") : -1;
    char method[48] = "";
    if (m >= 0) json_str(&d, m, method, sizeof method);
    if (strcmp(method, "compressed-tensors") == 0) {
        qc->method = QM_CT;
        if ((rc = parse_ct(qc, &d, o, err, errlen))) goto fail;
    } else if (strcmp(method, "awq") == 0 || strcmp(method, "gptq") == 0) {
        qc->method = method[0] == 'a' ? QM_AWQ : QM_GPTQ;
        qc->bits = jint(&d, o, "bits", 4);
        qc->group = jint(&d, o, "group_size", 128);
        if (qc->group < 0) qc->group = 0;
        qc->sym = qc->method == QM_AWQ ? !jbool(&d, o, "zero_point", true) : jbool(&d, o, "sym", true);
        qc->desc_act = jbool(&d, o, "desc_act", false);
        qc->lm_head = jbool(&d, o, "lm_head", false);
        char fmt[32] = "";
        int cf = json_get(&d, o, "checkpoint_format");
        if (cf < 0) cf = json_get(&d, o, "format");
        if (cf >= 0 && json_is_str(&d, cf)) json_str(&d, cf, fmt, sizeof fmt);
        qc->gptq_v2 = strcmp(fmt, "gptq_v2") == 0;
        int ver = json_get(&d, o, "version");
        if (qc->method == QM_AWQ && ver >= 0 && !json_str_eq(&d, ver, "gemm") && !json_str_eq(&d, ver, "GEMM")) {
            char v[32] = "";
            json_str(&d, ver, v, sizeof v);
            sl_seterr(err, errlen, "quantization_config: AWQ version '%s' is not supported (gemm)", v);
            rc = SL_EUNSUP;
            goto fail;
        }
        int nc = json_get(&d, o, "modules_to_not_convert");
        if (nc >= 0 && json_is_arr(&d, nc)) {
            qc->not_convert = calloc((size_t)json_size(&d, nc) + 1, sizeof *qc->not_convert);
            if (!qc->not_convert) {
                rc = SL_ENOMEM;
                goto fail;
            }
            for (int k = 0; k < json_size(&d, nc); k++) {
                char *s = json_strdup(&d, json_at(&d, nc, k), NULL);
                if (s) qc->not_convert[qc->n_not_convert++] = s;
            }
        }
    } else {
        sl_seterr(err, errlen, "quantization_config: quant_method '%s' is not supported "
                  "(compressed-tensors, awq, gptq)", method);
        rc = SL_EUNSUP;
        goto fail;
    }
    json_free(&d);
    *out = qc;
    return 0;
fail:
    if (rc == SL_ENOMEM) sl_seterr(err, errlen, "out of memory reading quantization_config");
    quant_cfg_free(qc);
    json_free(&d);
    return rc;
}

static bool re_match(const pcre2_code *re, const char *s)
{
    pcre2_match_data *md = pcre2_match_data_create_from_pattern(re, NULL);
    if (!md) return false;
    int rc = pcre2_match(re, (PCRE2_SPTR)s, strlen(s), 0, 0, md, NULL);
    pcre2_match_data_free(md);
    return rc >= 0;
}

static bool class_match(const char *target, bool linear)
{
    return linear ? strcmp(target, "Linear") == 0 : strcmp(target, "Embedding") == 0;
}

static int cmp_str(const void *a, const void *b)
{
    return strcmp((*(const struct target *const *)a)->text, (*(const struct target *const *)b)->text);
}

/* What the config says about module name. */
static void config_claim(const struct quant_cfg *qc, const char *name, bool linear, struct claim *c)
{
    memset(c, 0, sizeof *c);
    if (qc->method != QM_CT) {
        bool in_layers = linear && strstr(name, "layers.") != NULL;
        c->quant = in_layers || (linear && qc->method == QM_GPTQ && qc->lm_head && strcmp(name, "lm_head") == 0);
        c->why = qc->method == QM_AWQ ? "awq" : "gptq";
        for (int i = 0; i < qc->n_not_convert; i++)
            if (strstr(name, qc->not_convert[i])) {
                c->quant = false;
                c->why = "modules_to_not_convert";
            }
        if (!c->quant) return;
        c->bits = qc->bits;
        c->group = qc->group;
        c->sym = qc->sym;
        c->known_sym = false;
        c->act_order = qc->desc_act;
        return;
    }
    for (int i = 0; i < qc->n_ignore; i++) {
        const struct target *t = &qc->ignore[i];
        if (t->re ? re_match(t->re, name) : (strcmp(t->text, name) == 0 || class_match(t->text, linear))) {
            c->why = "ignore";
            return;
        }
    }
    /* exact names, then patterns in sorted order, then class names */
    const struct target *best = NULL;
    for (int i = 0; i < qc->n_targets && !best; i++)
        if (!qc->targets[i].re && strcmp(qc->targets[i].text, name) == 0) best = &qc->targets[i];
    if (!best) {
        const struct target **sorted = malloc(sizeof *sorted * (size_t)(qc->n_targets + 1));
        int n = 0;
        if (sorted) {
            for (int i = 0; i < qc->n_targets; i++)
                if (qc->targets[i].re) sorted[n++] = &qc->targets[i];
            qsort(sorted, (size_t)n, sizeof *sorted, cmp_str);
            for (int i = 0; i < n && !best; i++)
                if (re_match(sorted[i]->re, name)) best = sorted[i];
            free(sorted);
        }
    }
    for (int i = 0; i < qc->n_targets && !best; i++)
        if (!qc->targets[i].re && class_match(qc->targets[i].text, linear)) best = &qc->targets[i];
    if (!best) return;
    *c = qc->schemes[best->scheme];
    c->why = best->text;
}

int quant_cfg_scheme(const struct quant_cfg *qc, const char *module, bool linear, int *bits, int *group, bool *sym,
                     bool *act_order, char *err, size_t errlen)
{
    struct claim c;
    if (!qc) return 0;
    config_claim(qc, module, linear, &c);
    if (!c.quant) return 0;
    if (c.float_type || (c.bits != 4 && c.bits != 8)) {
        sl_seterr(err, errlen, "quantization_config: %s: %s%d weights are not supported (int4 and int8 are)", module,
                  c.float_type ? "float" : "int", c.bits);
        return SL_EUNSUP;
    }
    *bits = c.bits, *group = c.group, *sym = c.known_sym ? c.sym : true, *act_order = c.act_order;
    return 1;
}

/* ---- the format of one weight ------------------------------------------------------ */

static const char *dt_name(enum model_dtype dt)
{
    return dt == MODEL_DT_BF16 ? "bf16" : dt == MODEL_DT_F16 ? "f16" : dt == MODEL_DT_F32 ? "f32"
                                                                                           : model_dtype_name(dt);
}

static const struct st_tensor *find2(const st_set *st, const char *module, const char *suffix)
{
    char name[512];
    snprintf(name, sizeof name, "%s.%s", module, suffix);
    return st_find(st, name);
}

static bool is2d(const struct st_tensor *t, int64_t a, int64_t b)
{
    return t->ndim == 2 && t->shape[0] == a && t->shape[1] == b;
}

static bool float_dt(enum model_dtype dt)
{
    return dt == MODEL_DT_F32 || dt == MODEL_DT_F16 || dt == MODEL_DT_BF16;
}

/* Scales [rows][ng] (compressed-tensors) or [ng][rows] (AWQ/GPTQ): sets
 * q->n_groups, q->group, q->scale_dt. */
static int take_scales(struct model_quant *q, const struct st_tensor *s, bool transposed, const struct claim *c,
                       const char *sname, char *err, size_t errlen)
{
    int64_t ng = s ? (transposed ? s->shape[0] : (s->ndim == 1 ? 1 : s->shape[1])) : 0;
    bool shape_ok = s && (transposed ? (s->ndim == 2 && s->shape[1] == q->rows)
                                     : ((s->ndim == 2 && s->shape[0] == q->rows) ||
                                        (s->ndim == 1 && s->shape[0] == q->rows)));
    if (!s || !shape_ok || ng <= 0 || !float_dt(s->dtype)) {
        sl_seterr(err, errlen, "tensor %s: %s (expected a float tensor with %lld %s)", sname,
                  !s ? "missing" : "bad shape or dtype", (long long)q->rows, transposed ? "columns" : "rows");
        return SL_EFORMAT;
    }
    q->n_groups = ng;
    q->scale_dt = s->dtype;
    q->scales = s->data;
    if (ng == 1) {
        q->group = (int)q->cols;
    } else if (q->cols % ng == 0) {
        q->group = (int)(q->cols / ng);
    } else if (c->quant && c->group > 0 && (q->cols + c->group - 1) / c->group == ng) {
        q->group = c->group; /* a last partial group */
    } else {
        sl_seterr(err, errlen, "tensor %s: %lld groups do not divide %lld columns", sname, (long long)ng,
                  (long long)q->cols);
        return SL_EFORMAT;
    }
    return 0;
}

static int take_g_idx(struct model_quant *q, const struct st_tensor *g, const char *gname, char *err, size_t errlen)
{
    if (!g) return 0;
    if (g->dtype != MODEL_DT_I32 || g->ndim != 1 || g->shape[0] != q->cols) {
        sl_seterr(err, errlen, "tensor %s: expected int32 [%lld]", gname, (long long)q->cols);
        return SL_EFORMAT;
    }
    bool trivial = true;
    for (int64_t k = 0; k < q->cols; k++) {
        int32_t v = (int32_t)rd32(g->data, (size_t)k);
        if (v < 0 || v >= q->n_groups) {
            sl_seterr(err, errlen, "tensor %s: column %lld names group %d of %lld", gname, (long long)k, v,
                      (long long)q->n_groups);
            return SL_EFORMAT;
        }
        if (v != k / q->group) trivial = false;
    }
    q->g_idx = g->data;
    q->act_order = !trivial;
    return 0;
}

/* Builds the descriptor from what the file holds for module. Returns 0, 1
 * when the file has no packed form of it, or an error. */
static int file_packed(const st_set *st, const char *module, const struct claim *c, const struct quant_cfg *qc,
                       struct model_quant *q, char *fname, size_t fcap, char *err, size_t errlen)
{
    char sn[512], gn[512];
    int64_t rows = q->rows, cols = q->cols;
    const struct st_tensor *p = find2(st, module, "weight_packed");
    const struct st_tensor *iw = find2(st, module, "weight");
    if (p || (iw && iw->dtype == MODEL_DT_I8)) {
        bool packed = p != NULL;
        snprintf(fname, fcap, "%s.%s", module, packed ? "weight_packed" : "weight");
        if (packed) {
            if (p->dtype != MODEL_DT_I32 || p->ndim != 2 || p->shape[0] != rows ||
                (p->shape[1] * 8 != cols && p->shape[1] * 4 != cols)) {
                sl_seterr(err, errlen, "tensor %s: %s [%lld, %lld] is neither int4 nor int8 packing of [%lld, %lld]",
                          fname, model_dtype_name(p->dtype), (long long)p->shape[0],
                          (long long)(p->ndim > 1 ? p->shape[1] : 0), (long long)rows, (long long)cols);
                return SL_EFORMAT;
            }
            q->layout = MODEL_QL_CT;
            q->bits = p->shape[1] * 8 == cols ? 4 : 8;
            q->qweight = p->data;
            const struct st_tensor *ws = find2(st, module, "weight_shape");
            if (ws) {
                int64_t dims[2] = {0, 0};
                if (ws->ndim == 1 && ws->shape[0] == 2 && (ws->dtype == MODEL_DT_I64 || ws->dtype == MODEL_DT_I32))
                    for (int i = 0; i < 2; i++) {
                        if (ws->dtype == MODEL_DT_I64)
                            memcpy(&dims[i], (const char *)ws->data + 8 * i, 8);
                        else
                            dims[i] = (int32_t)rd32(ws->data, (size_t)i);
                    }
                if (dims[0] != rows || dims[1] != cols) {
                    sl_seterr(err, errlen, "tensor %s.weight_shape says [%lld, %lld], expected [%lld, %lld]", module,
                              (long long)dims[0], (long long)dims[1], (long long)rows, (long long)cols);
                    return SL_EFORMAT;
                }
            }
        } else {
            if (!is2d(iw, rows, cols)) {
                sl_seterr(err, errlen, "tensor %s: int8 shape is not [%lld, %lld]", fname, (long long)rows,
                          (long long)cols);
                return SL_EFORMAT;
            }
            q->layout = MODEL_QL_CT_INT;
            q->bits = 8;
            q->qweight = iw->data;
        }
        snprintf(sn, sizeof sn, "%s.weight_scale", module);
        int rc = take_scales(q, st_find(st, sn), false, c, sn, err, errlen);
        if (rc) return rc;
        const struct st_tensor *z = find2(st, module, "weight_zero_point");
        q->sym = z == NULL;
        if (z) {
            snprintf(sn, sizeof sn, "%s.weight_zero_point", module);
            int64_t zr = packed ? (rows * q->bits + 31) / 32 : rows;
            if (z->dtype != (packed ? MODEL_DT_I32 : MODEL_DT_I8) ||
                !((z->ndim == 2 && z->shape[0] == zr && z->shape[1] == q->n_groups) ||
                  (z->ndim == 1 && q->n_groups == 1 && z->shape[0] == zr))) {
                sl_seterr(err, errlen, "tensor %s: expected %s [%lld, %lld]", sn, packed ? "int32" : "int8",
                          (long long)zr, (long long)q->n_groups);
                return SL_EFORMAT;
            }
            q->zeros = z->data;
        }
        snprintf(gn, sizeof gn, "%s.weight_g_idx", module);
        return take_g_idx(q, st_find(st, gn), gn, err, errlen);
    }
    const struct st_tensor *qw = find2(st, module, "qweight");
    if (!qw) return 1;
    snprintf(fname, fcap, "%s.qweight", module);
    bool awq = qw->ndim == 2 && qw->shape[0] == cols && qw->shape[1] * 8 == rows;
    bool gptq = qw->ndim == 2 && qw->shape[1] == rows && (qw->shape[0] * 8 == cols || qw->shape[0] * 4 == cols);
    if (qw->dtype != MODEL_DT_I32 || (!awq && !gptq)) {
        sl_seterr(err, errlen, "tensor %s: [%lld, %lld] is neither AWQ [%lld, %lld] nor GPTQ [%lld or %lld, %lld] "
                  "packing", fname, (long long)qw->shape[0], (long long)(qw->ndim > 1 ? qw->shape[1] : 0),
                  (long long)cols, (long long)rows / 8, (long long)cols / 8, (long long)cols / 4, (long long)rows);
        return SL_EFORMAT;
    }
    if (qc && qc->method != QM_CT && (qc->method == QM_AWQ) != awq) {
        sl_seterr(err, errlen, "tensor %s: the file holds %s packing but quantization_config says quant_method %s",
                  fname, awq ? "AWQ" : "GPTQ", qc->method == QM_AWQ ? "awq" : "gptq");
        return SL_EFORMAT;
    }
    q->layout = awq ? MODEL_QL_AWQ : MODEL_QL_GPTQ;
    q->bits = awq ? 4 : (qw->shape[0] * 8 == cols ? 4 : 8);
    q->qweight = qw->data;
    q->zero_add = (!awq && !(qc && qc->gptq_v2)) ? 1 : 0;
    snprintf(sn, sizeof sn, "%s.scales", module);
    int rc = take_scales(q, st_find(st, sn), true, c, sn, err, errlen);
    if (rc) return rc;
    snprintf(sn, sizeof sn, "%s.qzeros", module);
    const struct st_tensor *z = st_find(st, sn);
    int pf = 32 / q->bits;
    if (rows % pf) {
        sl_seterr(err, errlen, "tensor %s: %lld output rows do not fill whole %d-bit zero words", fname,
                  (long long)rows, q->bits);
        return SL_EFORMAT;
    }
    if (!z || z->dtype != MODEL_DT_I32 || !is2d(z, q->n_groups, rows / pf)) {
        sl_seterr(err, errlen, "tensor %s: %s (expected int32 [%lld, %lld])", sn, z ? "bad shape or dtype" : "missing",
                  (long long)q->n_groups, (long long)rows / pf);
        return SL_EFORMAT;
    }
    q->zeros = z->data;
    /* AWQ/GPTQ store zeros for symmetric weights too: sym is what they hold */
    q->sym = true;
    for (int64_t g = 0; g < q->n_groups && q->sym; g++)
        for (int64_t r = 0; r < rows && q->sym; r++)
            if (zero_of(q, r, g) != 1 << (q->bits - 1)) q->sym = false;
    if (awq) return 0;
    snprintf(gn, sizeof gn, "%s.g_idx", module);
    return take_g_idx(q, st_find(st, gn), gn, err, errlen);
}

int quant_load_weight(const st_set *st, const struct quant_cfg *qc, const char *module, bool linear, int64_t rows,
                      int64_t cols, struct model_tensor *t, struct model_quant *q, char *fname, size_t fcap,
                      char *err, size_t errlen)
{
    return quant_load_weight_as(st, qc, module, module, linear, rows, cols, t, q, fname, fcap, err, errlen);
}

int quant_load_weight_as(const st_set *st, const struct quant_cfg *qc, const char *module, const char *claim,
                         bool linear, int64_t rows, int64_t cols, struct model_tensor *t, struct model_quant *q,
                         char *fname, size_t fcap, char *err, size_t errlen)
{
    struct claim c = {0};
    if (qc) config_claim(qc, claim, linear, &c);
    memset(q, 0, sizeof *q);
    q->rows = rows;
    q->cols = cols;
    int rc = file_packed(st, module, &c, qc, q, fname, fcap, err, errlen);
    if (rc < 0) return rc;
    char cs[160], fs[96];
    if (rc == 1) {
        /* a dense weight */
        const struct st_tensor *w = find2(st, module, "weight");
        if (!w) return 1;
        snprintf(fname, fcap, "%s.weight", module);
        if (c.quant) {
            claim_str(&c, cs, sizeof cs);
            sl_seterr(err, errlen, "tensor %s: the file holds %s but quantization_config says %s", fname,
                      dt_name(w->dtype), cs);
            return SL_EFORMAT;
        }
        if (w->ndim != 2 || !float_dt(w->dtype)) {
            sl_seterr(err, errlen, "tensor %s: %s with %d dimensions is not a weight matrix", fname,
                      model_dtype_name(w->dtype), w->ndim);
            return SL_EFORMAT;
        }
        memset(t, 0, sizeof *t);
        t->dtype = w->dtype;
        t->ndim = 2;
        t->ne[0] = w->shape[1];
        t->ne[1] = w->shape[0];
        t->ne[2] = t->ne[3] = 1;
        t->data = w->data;
        t->nbytes = w->nbytes;
        return 0;
    }
    model_quant_describe(q, fs, sizeof fs);
    bool agree = c.quant && !c.float_type && c.bits == q->bits &&
                 (c.group <= 0 ? q->group == q->cols : c.group == q->group) &&
                 (!c.known_sym || c.sym == q->sym) && (c.act_order || !q->act_order) &&
                 (!c.act_order || q->g_idx || q->layout != MODEL_QL_CT);
    if (qc && !agree) {
        claim_str(&c, cs, sizeof cs);
        sl_seterr(err, errlen, "tensor %s: the file holds %s but quantization_config says %s", fname, fs, cs);
        return SL_EFORMAT;
    }
    if (qc && qc->method == QM_CT && qc->format[0] && strcmp(qc->format, "mixed-precision") != 0 &&
        (q->layout == MODEL_QL_CT) != (strcmp(qc->format, "pack-quantized") == 0)) {
        sl_seterr(err, errlen, "tensor %s: the file holds %s weights but quantization_config says format %s", fname,
                  q->layout == MODEL_QL_CT ? "pack-quantized" : "unpacked int8", qc->format);
        return SL_EFORMAT;
    }
    memset(t, 0, sizeof *t);
    t->dtype = MODEL_DT_QPACK;
    t->ndim = 2;
    t->ne[0] = cols;
    t->ne[1] = rows;
    t->ne[2] = t->ne[3] = 1;
    t->data = q->qweight;
    const struct st_tensor *qt = st_find(st, fname);
    t->nbytes = qt ? qt->nbytes : 0; /* the packed codes (scales and zeros are a few percent more) */
    return 0;
}

/* ---- round-to-nearest quantization (sluice quantize) ------------------------------------ */

static uint16_t bf16_bits(float x) /* x already a bf16 value */
{
    uint32_t u;
    memcpy(&u, &x, 4);
    return (uint16_t)(u >> 16);
}

void quant_rtn_row(const float *w, int64_t cols, int bits, int group, uint32_t *packed, uint16_t *scales)
{
    float qmax = (float)((1 << (bits - 1)) - 1), qmin = -qmax - 1, half_range = ((float)(1 << bits) - 1) / 2;
    int64_t ng = (cols + group - 1) / group;
    memset(packed, 0, (size_t)(cols * bits / 32) * 4);
    for (int64_t g = 0; g < ng; g++) {
        int64_t k0 = g * group, k1 = k0 + group < cols ? k0 + group : cols;
        float mn = 0, mx = 0; /* zero stays representable: the range includes it */
        for (int64_t k = k0; k < k1; k++) {
            if (w[k] < mn) mn = w[k];
            if (w[k] > mx) mx = w[k];
        }
        float amax = -mn > mx ? -mn : mx;
        float s = quant_round_bf16(amax / half_range);
        if (s == 0) s = 0.0078125f; /* torch.finfo(bfloat16).eps, as the library substitutes */
        scales[g] = bf16_bits(s);
        for (int64_t k = k0; k < k1; k++) {
            float x = quant_round_bf16(w[k] / s); /* the division happens in the weight's dtype */
            x = x < qmin ? qmin : x > qmax ? qmax : x;
            int q = (int)nearbyintf(x) + (1 << (bits - 1));
            packed[k * bits / 32] |= (uint32_t)q << ((k * bits) % 32);
        }
    }
}
