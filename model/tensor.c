/* tensor.c - the tensor helpers of model.h: element counts, dtype names, and
 * conversion of every stored dtype to f32.
 *
 * Block layouts are ggml's (ggml-common.h), little-endian, packed:
 *   Q8_0: 32 elements in 34 bytes { f16 d; int8 q[32]; }         x = d*q
 *   Q4_0: 32 elements in 18 bytes { f16 d; u8 qs[16]; }          x = d*(q-8)
 *   Q4_1: 32 elements in 20 bytes { f16 d; f16 m; u8 qs[16]; }   x = d*q + m
 * For the 4-bit types, element j < 16 is the low nibble of qs[j] and element
 * j + 16 its high nibble. Every value is computed in f32 with one rounding per
 * operation (no fused multiply-add), which is what ggml's reference
 * dequantizers and gguf-py's numpy ones compute, so results are bit-exact.
 */
#include <stdlib.h>
#include <string.h>

#include "model.h"
#include "quant.h"

/* FMA contraction would change the rounding of d*q + m. */
#pragma GCC optimize("fp-contract=off")

#define QK 32

static float bf16_to_f32(uint16_t h)
{
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

static void deq_q8_0(const uint8_t *b, float *y)
{
    float d = quant_f16_to_f32(rd16(b));
    const int8_t *q = (const int8_t *)(b + 2);
    for (int j = 0; j < QK; j++) y[j] = (float)q[j] * d;
}

static void deq_q4_0(const uint8_t *b, float *y)
{
    float d = quant_f16_to_f32(rd16(b));
    const uint8_t *qs = b + 2;
    for (int j = 0; j < QK / 2; j++) {
        y[j] = (float)((qs[j] & 0x0F) - 8) * d;
        y[j + QK / 2] = (float)((qs[j] >> 4) - 8) * d;
    }
}

static void deq_q4_1(const uint8_t *b, float *y)
{
    float d = quant_f16_to_f32(rd16(b));
    float m = quant_f16_to_f32(rd16(b + 2));
    const uint8_t *qs = b + 4;
    for (int j = 0; j < QK / 2; j++) {
        float lo = (float)(qs[j] & 0x0F) * d;
        float hi = (float)(qs[j] >> 4) * d;
        y[j] = lo + m;
        y[j + QK / 2] = hi + m;
    }
}

int64_t model_tensor_nelem(const struct model_tensor *t)
{
    int nd = t->ndim < 0 ? 0 : t->ndim > 4 ? 4 : t->ndim;
    int64_t n = 1;
    for (int d = 0; d < nd; d++) n *= t->ne[d];
    return n;
}

const char *model_dtype_name(enum model_dtype dt)
{
    switch (dt) {
    case MODEL_DT_F32: return "F32";
    case MODEL_DT_F16: return "F16";
    case MODEL_DT_BF16: return "BF16";
    case MODEL_DT_Q8_0: return "Q8_0";
    case MODEL_DT_Q4_0: return "Q4_0";
    case MODEL_DT_Q4_1: return "Q4_1";
    case MODEL_DT_QPACK: return "packed";
    case MODEL_DT_I8: return "I8";
    case MODEL_DT_I32: return "I32";
    case MODEL_DT_I64: return "I64";
    }
    return "unknown";
}

void model_tensor_to_f32(const struct model_tensor *t, int64_t first, int64_t n, float *out)
{
    SL_ASSERT(t && t->data && first >= 0 && n >= 0);
    SL_ASSERT(first + n <= model_tensor_nelem(t));
    const uint8_t *p = t->data;
    switch (t->dtype) {
    case MODEL_DT_F32:
        memcpy(out, p + first * 4, (size_t)n * 4);
        return;
    case MODEL_DT_F16:
        for (int64_t i = 0; i < n; i++) out[i] = quant_f16_to_f32(rd16(p + (first + i) * 2));
        return;
    case MODEL_DT_BF16:
        for (int64_t i = 0; i < n; i++) out[i] = bf16_to_f32(rd16(p + (first + i) * 2));
        return;
    case MODEL_DT_Q8_0:
    case MODEL_DT_Q4_0:
    case MODEL_DT_Q4_1: {
        SL_ASSERT(first % QK == 0);
        size_t bsz = t->dtype == MODEL_DT_Q8_0 ? 34 : t->dtype == MODEL_DT_Q4_0 ? 18 : 20;
        void (*deq)(const uint8_t *, float *) =
            t->dtype == MODEL_DT_Q8_0 ? deq_q8_0 : t->dtype == MODEL_DT_Q4_0 ? deq_q4_0 : deq_q4_1;
        const uint8_t *b = p + (size_t)(first / QK) * bsz;
        int64_t i = 0;
        for (; i + QK <= n; i += QK, b += bsz) deq(b, out + i);
        if (i < n) { /* a partial last block */
            float tmp[QK];
            deq(b, tmp);
            memcpy(out + i, tmp, (size_t)(n - i) * sizeof(float));
        }
        return;
    }
    case MODEL_DT_QPACK: {
        /* whole rows (the scales and zeros are per row and group) */
        const struct model_quant *q = t->quant;
        SL_ASSERT(q && first % q->cols == 0);
        int64_t r = first / q->cols, i = 0;
        for (; i + q->cols <= n; i += q->cols, r++) quant_deq_row(q, r, out + i);
        if (i < n) {
            float *tmp = malloc((size_t)q->cols * sizeof *tmp);
            SL_ASSERT(tmp);
            quant_deq_row(q, r, tmp);
            memcpy(out + i, tmp, (size_t)(n - i) * sizeof *tmp);
            free(tmp);
        }
        return;
    }
    case MODEL_DT_I8:
        for (int64_t i = 0; i < n; i++) out[i] = (float)((const int8_t *)p)[first + i];
        return;
    case MODEL_DT_I32:
        for (int64_t i = 0; i < n; i++) {
            int32_t v;
            memcpy(&v, p + (first + i) * 4, 4);
            out[i] = (float)v;
        }
        return;
    case MODEL_DT_I64:
        for (int64_t i = 0; i < n; i++) {
            int64_t v;
            memcpy(&v, p + (first + i) * 8, 8);
            out[i] = (float)v;
        }
        return;
    }
    SL_ASSERT(!"unknown dtype");
}
