/* Decode-time kernels for caches that hold packed low-bit codes (TurboQuant, KIVI): dot products
 * with, and weighted sums of, each token's code values, read straight from the packed bytes; and,
 * at the end, two encode-side helpers (a quantizer's codes, bit packing).
 *
 * The torch path unpacks every code of the cache to an fp32 tensor each step (megabytes per layer
 * at 4K tokens), then a matmul reads it back. Here W codes at a time (16 with AVX-512, 8 with AVX2)
 * are taken from the bytes into vector lanes, turned into values by an in-register table lookup and
 * used at once; nothing the size of the cache is written. Same fp32 products as the torch path,
 * summed in another order.
 *
 * Layouts (as `kvbench.methods.packing` writes them; one row of bytes per token, `dim` codes):
 *   FLAT (`pack`, bits 1/2/4): byte j holds codes j*per .. j*per+per-1, code k at bit k*bits;
 *   SIGN_MAGNITUDE (`pack_sign_magnitude`, bits 3): a 2-bit FLAT magnitude row and a 1-bit FLAT sign
 *     row (`signs`); the code's value is values[magnitude | sign << 2];
 *   PLANES (`pack_planes`, bits 1/2/4): with w = dim * bits / 8, byte j holds codes j, j+w, j+2w, ...
 * `values` holds 16 floats: the value of each code (or of each magnitude | sign << 2).
 *
 * Built by `kvbench.methods.native` with the host compiler (-O3 -march=native -fopenmp): which
 * vector width runs is what that CPU has (`kernel_isa`); without AVX2 or for a shape the vector
 * code does not take, a kernel returns UNSUPPORTED and the caller runs its torch path.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

enum { FLAT = 0, SIGN_MAGNITUDE = 1, PLANES = 2 };
enum { OK = 0, UNSUPPORTED = -1, NO_MEMORY = -2 };

#define CHUNK 256    /* tokens per work item */
#define MAX_ROWS 16  /* query rows scored per pass over a token (more take several passes) */

#if defined(__AVX512F__)
#define W 16
typedef __m512 vf;
typedef __m512i vi;
static inline vi lanes_from_bytes(const uint8_t *b) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)b)); }
static inline vi lanes_from_word(uint64_t x) { return _mm512_cvtepu8_epi32(_mm_cvtsi64_si128((long long)x)); }
static inline vi lane_index(void) { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
static inline vi pick(vi x, vi index) { return _mm512_permutexvar_epi32(index, x); }
static inline vi shift_right(vi x, vi count) { return _mm512_srlv_epi32(x, count); }
static inline vi and_(vi x, int mask) { return _mm512_and_si512(x, _mm512_set1_epi32(mask)); }
static inline vi or_shifted(vi x, vi y, int shift) { return _mm512_or_si512(x, _mm512_slli_epi32(y, shift)); }
static inline vi splat_i(int x) { return _mm512_set1_epi32(x); }
static inline vi mul_i(vi x, int k) { return _mm512_mullo_epi32(x, _mm512_set1_epi32(k)); }
static inline vi srli3(vi x) { return _mm512_srli_epi32(x, 3); }
static inline vf lookup(const float *values, vi code) { return _mm512_permutexvar_ps(code, _mm512_loadu_ps(values)); }
static inline vf load(const float *p) { return _mm512_loadu_ps(p); }
static inline void store(float *p, vf x) { _mm512_storeu_ps(p, x); }
static inline vf fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf splat(float x) { return _mm512_set1_ps(x); }
static inline vf zero(void) { return _mm512_setzero_ps(); }
static inline float sum(vf x) { return _mm512_reduce_add_ps(x); }
#elif defined(__AVX2__)
#define W 8
typedef __m256 vf;
typedef __m256i vi;
static inline vi lanes_from_bytes(const uint8_t *b) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)b)); }
static inline vi lanes_from_word(uint64_t x) { return _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)x)); }
static inline vi lane_index(void) { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
static inline vi pick(vi x, vi index) { return _mm256_permutevar8x32_epi32(x, index); }
static inline vi shift_right(vi x, vi count) { return _mm256_srlv_epi32(x, count); }
static inline vi and_(vi x, int mask) { return _mm256_and_si256(x, _mm256_set1_epi32(mask)); }
static inline vi or_shifted(vi x, vi y, int shift) { return _mm256_or_si256(x, _mm256_slli_epi32(y, shift)); }
static inline vi splat_i(int x) { return _mm256_set1_epi32(x); }
static inline vi mul_i(vi x, int k) { return _mm256_mullo_epi32(x, _mm256_set1_epi32(k)); }
static inline vi srli3(vi x) { return _mm256_srli_epi32(x, 3); }
static inline vf lookup(const float *values, vi code) { /* 16 entries: two 8-entry lookups, bit 3 picks */
    const vf low = _mm256_permutevar8x32_ps(_mm256_loadu_ps(values), code);
    const vf high = _mm256_permutevar8x32_ps(_mm256_loadu_ps(values + 8), code);
    return _mm256_blendv_ps(low, high, _mm256_castsi256_ps(_mm256_slli_epi32(code, 28)));
}
static inline vf load(const float *p) { return _mm256_loadu_ps(p); }
static inline void store(float *p, vf x) { _mm256_storeu_ps(p, x); }
static inline vf fmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf splat(float x) { return _mm256_set1_ps(x); }
static inline vf zero(void) { return _mm256_setzero_ps(); }
static inline float sum(vf x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}
#endif

int kernel_isa(void) {
#if defined(W)
    return W * 32;
#else
    return 0;
#endif
}

#if defined(W)
/* Codes d0 .. d0+W-1 of a FLAT row, one per lane. Reads only the row's own bytes. */
static inline vi flat_codes(const uint8_t *row, int64_t d0, int bits) {
    uint64_t word = 0; /* W * bits / 8 <= 8 bytes, through a register (no store-to-load stall) */
    memcpy(&word, row + d0 * bits / 8, W * bits / 8);
    const vi at = mul_i(lane_index(), bits); /* bit offset of each lane's code */
    return and_(shift_right(pick(lanes_from_word(word), srli3(at)), and_(at, 7)), (1 << bits) - 1);
}

/* The values of codes d0 .. d0+W-1 of a token. `bits` is a literal at every call (see `row_values`). */
static inline vf values_at(int layout, int bits, const uint8_t *row, const uint8_t *signs, int64_t dim, int64_t d0,
                           const float *values) {
    if (layout == SIGN_MAGNITUDE)
        return lookup(values, or_shifted(flat_codes(row, d0, 2), flat_codes(signs, d0, 1), 2));
    if (layout == FLAT) return lookup(values, flat_codes(row, d0, bits));
    const int64_t w = dim * bits / 8; /* PLANES: codes d0.. are bytes d0 % w.. of plane d0 / w */
    return lookup(values, and_(shift_right(lanes_from_bytes(row + d0 % w), splat_i((int)(d0 / w) * bits)),
                               (1 << bits) - 1));
}

typedef struct {
    int64_t groups, tokens, rows, dim;
    int layout, bits;
    const uint8_t *packed, *signs;
    const float *values;
} codes_t;

static int64_t row_bytes(const codes_t *c) { return c->layout == SIGN_MAGNITUDE ? c->dim / 4 : c->dim * c->bits / 8; }

static int supported(const codes_t *c) {
    const int bits_ok = c->layout == SIGN_MAGNITUDE ? c->bits == 3 : (c->bits == 1 || c->bits == 2 || c->bits == 4);
    const int64_t w = c->dim * c->bits / 8;
    return bits_ok && c->dim % W == 0 && (c->layout != PLANES || w % W == 0);
}

/* One token's dot products with R query rows. Expanded per (layout, bits) so each is compiled with
 * its widths as constants. */
#define DOTS(LAYOUT, BITS)                                                                              \
    for (int64_t v = 0; v < c->dim; v += W) {                                                          \
        const vf x = values_at(LAYOUT, BITS, row, sign_row, c->dim, v, c->values);                    \
        for (int64_t r = 0; r < c->rows; r++) acc[r] = fmadd(load(q + r * c->dim + v), x, acc[r]);    \
    }

static inline void token_dots(const codes_t *c, const uint8_t *row, const uint8_t *sign_row, const float *q,
                              vf *acc) {
    switch (c->layout * 8 + c->bits) {
    case FLAT * 8 + 1: DOTS(FLAT, 1) break;
    case FLAT * 8 + 2: DOTS(FLAT, 2) break;
    case FLAT * 8 + 4: DOTS(FLAT, 4) break;
    case SIGN_MAGNITUDE * 8 + 3: DOTS(SIGN_MAGNITUDE, 3) break;
    case PLANES * 8 + 1: DOTS(PLANES, 1) break;
    case PLANES * 8 + 2: DOTS(PLANES, 2) break;
    case PLANES * 8 + 4: DOTS(PLANES, 4) break;
    }
}

/* One token's values, weighted per row (and per channel group of `span` codes), added to acc[R][dim]. */
#define SUMS(LAYOUT, BITS)                                                                              \
    for (int64_t col = 0, v = 0; v < c->dim; col++)                                                    \
        for (const int64_t stop = v + span; v < stop; v += W) {                                        \
            const vf x = values_at(LAYOUT, BITS, row, sign_row, c->dim, v, c->values);                \
            for (int64_t r = 0; r < c->rows; r++) {                                                    \
                float *a = acc + r * c->dim + v;                                                       \
                store(a, fmadd(splat(w[r * w_stride + col]), x, load(a)));                             \
            }                                                                                          \
        }

static inline void token_sums(const codes_t *c, const uint8_t *row, const uint8_t *sign_row, const float *w,
                              int64_t w_stride, int64_t span, float *acc) {
    switch (c->layout * 8 + c->bits) {
    case FLAT * 8 + 1: SUMS(FLAT, 1) break;
    case FLAT * 8 + 2: SUMS(FLAT, 2) break;
    case FLAT * 8 + 4: SUMS(FLAT, 4) break;
    case SIGN_MAGNITUDE * 8 + 3: SUMS(SIGN_MAGNITUDE, 3) break;
    case PLANES * 8 + 1: SUMS(PLANES, 1) break;
    case PLANES * 8 + 2: SUMS(PLANES, 2) break;
    case PLANES * 8 + 4: SUMS(PLANES, 4) break;
    }
}
#endif

/* out[g, r, t] = sum_d query[g, t / span, r, d] * value(g, t, d): G groups (KV heads) of T tokens,
 * R query rows each; one query per `span` tokens (T for one query; KIVI: one per group of tokens,
 * its per-channel scales folded in). */
int level_dots(int64_t groups, int64_t tokens, int64_t rows, int64_t dim, int layout, int bits,
               const uint8_t *packed, const uint8_t *signs, const float *values, const float *query, int64_t span,
               float *out, int threads) {
#if defined(W)
    const codes_t c = {groups, tokens, rows, dim, layout, bits, packed, signs, values};
    if (!supported(&c) || span < 1) return UNSUPPORTED;
    const int64_t rb = row_bytes(&c), sb = dim / 8, chunks = (tokens + CHUNK - 1) / CHUNK;
    const int64_t blocks = (tokens + span - 1) / span;
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads)
    for (int64_t g = 0; g < groups; g++)
        for (int64_t k = 0; k < chunks; k++) {
            const int64_t end = (k + 1) * CHUNK < tokens ? (k + 1) * CHUNK : tokens;
            for (int64_t t = k * CHUNK; t < end; t++) {
                const int64_t token = g * tokens + t;
                const float *q = query + (g * blocks + t / span) * rows * dim;
                for (int64_t r0 = 0; r0 < rows; r0 += MAX_ROWS) { /* MAX_ROWS accumulators at a time */
                    codes_t part = c;
                    part.rows = rows - r0 < MAX_ROWS ? rows - r0 : MAX_ROWS;
                    vf acc[MAX_ROWS];
                    for (int64_t r = 0; r < part.rows; r++) acc[r] = zero();
                    token_dots(&part, packed + token * rb, signs ? signs + token * sb : NULL, q + r0 * dim, acc);
                    for (int64_t r = 0; r < part.rows; r++) out[(g * rows + r0 + r) * tokens + t] = sum(acc[r]);
                }
            }
        }
    return OK;
#else
    return UNSUPPORTED;
#endif
}

/* out[g, r, d] = sum_t weights[g, r, t, d / (dim / cols)] * value(g, t, d): one weight per token and
 * row (cols 1), or per group of dim / cols channels (KIVI's per-token scales folded in). Each work
 * item (group, token chunk) sums into its own partial rows, added up in chunk order afterwards, so
 * the result does not depend on the thread count. */
int level_sums(int64_t groups, int64_t tokens, int64_t rows, int64_t dim, int layout, int bits,
               const uint8_t *packed, const uint8_t *signs, const float *values, const float *weights, int64_t cols,
               float *out, int threads) {
#if defined(W)
    const codes_t c = {groups, tokens, rows, dim, layout, bits, packed, signs, values};
    if (!supported(&c) || cols < 1 || dim % cols || (dim / cols) % W) return UNSUPPORTED;
    const int64_t rb = row_bytes(&c), sb = dim / 8, chunks = (tokens + CHUNK - 1) / CHUNK, span = dim / cols;
    float *partial = calloc((size_t)(groups * chunks * rows * dim), sizeof(float));
    if (!partial) return NO_MEMORY;
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads)
    for (int64_t g = 0; g < groups; g++)
        for (int64_t k = 0; k < chunks; k++) {
            float *acc = partial + (g * chunks + k) * rows * dim;
            const int64_t end = (k + 1) * CHUNK < tokens ? (k + 1) * CHUNK : tokens;
            for (int64_t t = k * CHUNK; t < end; t++) {
                const int64_t token = g * tokens + t;
                token_sums(&c, packed + token * rb, signs ? signs + token * sb : NULL,
                           weights + (g * rows * tokens + t) * cols, tokens * cols, span, acc);
            }
        }
    for (int64_t g = 0; g < groups; g++) {
        float *o = out + g * rows * dim;
        memset(o, 0, (size_t)(rows * dim) * sizeof(float));
        for (int64_t k = 0; k < chunks; k++) {
            const float *p = partial + (g * chunks + k) * rows * dim;
            for (int64_t i = 0; i < rows * dim; i++) o[i] += p[i];
        }
    }
    free(partial);
    return OK;
#else
    return UNSUPPORTED;
#endif
}

/* Encode side (plain C: the compiler vectorizes it for the host; results do not depend on it).
 *
 * out[i] = how many of the `n_edges` edges lie strictly below x[i] (NaN: 0): a scalar quantizer's
 * code, as the torch path's `codes += x > edge` computes it, in one pass over x instead of one
 * comparison pass and one conversion pass per edge. */
int count_below(int64_t n, const float *x, const float *edges, int n_edges, uint8_t *out, int threads) {
    if (n_edges < 0 || n_edges > 255) return UNSUPPORTED;
    const int64_t blocks = (n + 4095) / 4096;
#pragma omp parallel for schedule(static) num_threads(threads) if (blocks > 4)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t start = b * 4096, end = start + 4096 < n ? start + 4096 : n;
        memset(out + start, 0, (size_t)(end - start));
        for (int j = 0; j < n_edges; j++) {
            const float e = edges[j];
            for (int64_t i = start; i < end; i++) out[i] += x[i] > e;
        }
    }
    return OK;
}

/* `pack` (FLAT, bits 1/2/4) of n codes already in [0, 2**bits): byte j holds codes j*per ..
 * j*per+per-1, code k at bit k*bits; the last byte's missing codes are 0. */
int pack_codes(int64_t n, const uint8_t *codes, int bits, uint8_t *out, int threads) {
    if (bits != 1 && bits != 2 && bits != 4) return UNSUPPORTED;
    const int per = 8 / bits;
    const int64_t whole = n / per, bytes = (n + per - 1) / per;
#pragma omp parallel for schedule(static) num_threads(threads) if (whole > (1 << 16))
    for (int64_t j = 0; j < whole; j++) {
        uint8_t byte = 0;
        for (int k = 0; k < per; k++) byte |= (uint8_t)(codes[j * per + k] << (k * bits));
        out[j] = byte;
    }
    if (bytes > whole) {
        uint8_t byte = 0;
        for (int64_t k = 0; whole * per + k < n; k++) byte |= (uint8_t)(codes[whole * per + k] << (k * bits));
        out[whole] = byte;
    }
    return OK;
}
