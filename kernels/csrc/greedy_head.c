/* Greedy tokens straight from the last hidden states: each row's first largest logit of a float32 LM
 * head, without writing the logits anywhere.
 *
 * A thin head (hidden size 64: 64 multiply-adds per logit) spends a GEMM library's time on storing its
 * output and the argmax on reading it back. Here the head's weight is packed once in panels of LANES
 * vocabulary rows (lanes.h: 16 with AVX-512, else 8), k-major (`greedy_head_pack`), and a tile of ROWS
 * hidden rows meets one panel at a time in one register per row: ROWS accumulators stay in registers for
 * the whole dot product, and are folded at once into each row's per-lane running maximum. Vectors wider
 * than a register would spill: 16 lanes on AVX2 ran 10x slower (139 ms for 128 rows of a 49,152 x 64
 * head on one Zen 3 core, against 13 ms with 8). Each thread takes a contiguous range of panels,
 * CHUNK_PANELS at a time (256 vocabulary rows, 64 KB of weight at hidden 64, in L2), across every row
 * tile.
 *
 * The reference is torch's `max(dim=-1).indices` over the whole logits: the first index of the largest.
 * A lane's maximum moves only to a strictly larger logit, so within a lane the first index wins; across
 * lanes and threads the largest value wins, and among equal values the lowest index. NaN never wins (a
 * comparison with it is false), as in `argmax_rows`; a row with no logit above -inf gets -1, for the
 * caller to resolve. The products are summed in order of the hidden index with fused multiply-adds, so
 * a logit may differ from a GEMM library's in its last bits.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "lanes.h"

#define ROWS 8
#define CHUNK_PANELS (256 / LANES)

/* The packed layout's panel width, for the caller to size `packed`. */
int greedy_head_lanes(void) { return LANES; }

static int64_t num_panels(int64_t vocab) { return (vocab + LANES - 1) / LANES; }

/* packed[p][h][l] = weight[p * LANES + l][h], zero past the vocabulary; packed holds
 * num_panels(vocab) * hidden * LANES floats. */
int greedy_head_pack(float *packed, const float *weight, int64_t vocab, int64_t hidden) {
    int64_t panels = num_panels(vocab);
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++)
        for (int64_t h = 0; h < hidden; h++)
            for (int64_t l = 0; l < LANES; l++) {
                int64_t v = p * LANES + l;
                packed[(p * hidden + h) * LANES + l] = v < vocab ? weight[v * hidden + h] : 0.0f;
            }
    return 0;
}

/* One tile of ROWS rows (x: ROWS x hidden) against panels [first, end): folds into the tile's per-lane
 * maxima best / best_id (ROWS x LANES each). */
static void tile(const float *restrict x, int64_t hidden, const float *restrict packed, int64_t first, int64_t end,
                 int64_t vocab, float *restrict best, int32_t *restrict best_id) {
    vfloat top[ROWS];
    vint top_id[ROWS];
    for (int r = 0; r < ROWS; r++) {
        top[r] = *(const vfloat *)(best + r * LANES);
        top_id[r] = *(const vint *)(best_id + r * LANES);
    }
    vint lane;
    for (int l = 0; l < LANES; l++)
        lane[l] = l;
    for (int64_t p = first; p < end; p++) {
        const float *w = packed + p * hidden * LANES;
        vfloat acc[ROWS];
        for (int r = 0; r < ROWS; r++)
            acc[r] = (vfloat){0};
        for (int64_t h = 0; h < hidden; h++) {
            vfloat wv = *(const vfloat *)(w + h * LANES);
            for (int r = 0; r < ROWS; r++)
                acc[r] += x[r * hidden + h] * wv;
        }
        vint ids = lane + (int32_t)(p * LANES);
        vint valid = ids < (int32_t)vocab;
        for (int r = 0; r < ROWS; r++) {
            vint larger = (acc[r] > top[r]) & valid;
            top[r] = (vfloat)(((vint)acc[r] & larger) | ((vint)top[r] & ~larger));
            top_id[r] = (ids & larger) | (top_id[r] & ~larger);
        }
    }
    for (int r = 0; r < ROWS; r++) {
        *(vfloat *)(best + r * LANES) = top[r];
        *(vint *)(best_id + r * LANES) = top_id[r];
    }
}

/* out[r] = the first index of row r's largest logit x[r] . weight[v] (-1 where none is above -inf).
 * x: rows x hidden, rows a multiple of ROWS; packed: greedy_head_pack's. Returns 1 where the scratch
 * memory could not be had. */
int greedy_head_argmax(int64_t *out, const float *x, int64_t rows, int64_t hidden, const float *packed,
                       int64_t vocab) {
    if (rows % ROWS)
        return 2;
    int64_t panels = num_panels(vocab), per_thread = rows * LANES;
    int threads = omp_get_max_threads();
    float *best = aligned_alloc(64, sizeof(float) * threads * per_thread);
    int32_t *best_id = aligned_alloc(64, sizeof(int32_t) * threads * per_thread);
    if (best == NULL || best_id == NULL) {
        free(best);
        free(best_id);
        return 1;
    }
    int used = threads;
#pragma omp parallel num_threads(threads)
    {
        int t = omp_get_thread_num(), team = omp_get_num_threads();
#pragma omp single
        used = team;
        float *my_best = best + t * per_thread;
        int32_t *my_id = best_id + t * per_thread;
        for (int64_t i = 0; i < per_thread; i++) {
            my_best[i] = -INFINITY;
            my_id[i] = -1;
        }
        int64_t first = panels * t / team, last = panels * (t + 1) / team;
        for (int64_t chunk = first; chunk < last; chunk += CHUNK_PANELS) {
            int64_t end = chunk + CHUNK_PANELS < last ? chunk + CHUNK_PANELS : last;
            for (int64_t r = 0; r < rows; r += ROWS)
                tile(x + r * hidden, hidden, packed, chunk, end, vocab, my_best + r * LANES, my_id + r * LANES);
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        float top = -INFINITY;
        int32_t top_id = -1;
        for (int t = 0; t < used; t++)
            for (int l = 0; l < LANES; l++) {
                float v = best[t * per_thread + r * LANES + l];
                int32_t id = best_id[t * per_thread + r * LANES + l];
                if (id >= 0 && (v > top || (v == top && id < top_id))) {
                    top = v;
                    top_id = id;
                }
            }
        out[r] = top_id;
    }
    free(best);
    free(best_id);
    return 0;
}
