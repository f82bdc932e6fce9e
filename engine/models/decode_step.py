"""The native decode step: one C++ call runs a whole target forward of a few rows on CPU fp32, every
decoder layer and the lm_head: a decode row, a chain or a draft tree of one sequence (batch 1), or
the rows of several sequences (a batched step), up to MAX_ROWS rows in all (a larger step runs as
several calls: engine.models.forward.native_calls).

Why: a one-row step of SmolLM2 is bound by reading its weights, and the compiled layer-by-layer
step took well over that read time on the AMX Xeon (docs/results.md, "Figures behind the code"), the
rest being 30 compiled-graph calls and their guards, each linear's own OpenMP region, SDPA and the
rotations between them. Here one OpenMP region spans the step: the linears are the few-row kernel's
blocks (engine.models.smallm) split over the threads by bytes, the attention is the decode attention
kernel's range of positions (engine.models.attention) per kv head, in chunks of 128 positions merged
afterwards (a few kv heads would leave a thread idle; each chunk's thread fixed for the step, which
prefetches the chunk's keys and values for the next layer as it reaches the attention's barrier: the
next layer's linears then stream them in beside their weights), and each thread computes the norms, residual adds and (up to 8 rows) the
activation itself, so a layer has 5 barriers (it had 10). Past 8 rows each weight block is read from
memory once and the further rows pass over it while it is still in the core's cache (a bf16 or fp8
block widened once into fp32 for all of them).

The weights are the few-row kernel's packed copies (`_smallm_packed`, made by kernels.pack_weights
where memory allows); the KV cache is the lean forward's `KVCache` (a lone cache or a pool slot).
Results match the lean forward's to fp32 rounding (another summation order), which tests check
against it and against transformers' greedy output.
"""

from __future__ import annotations

import ctypes

import torch

from engine.models import attention, native, smallm
from engine.models.eagle3_head import aux_features

MAX_ROWS = 160  # rows of one call: up to here it measured faster than the torch path (equal at 200-256 rows)

_SOURCE = native.VECTORS + smallm.BLOCK_SOURCE + attention.TASK_SOURCE + r"""
#include <math.h>
#include <algorithm>
#include <string.h>
#include <omp.h>
/* rows a pass over a block takes at most: 6 at 8 lanes, where 6 rows run two blocks side by side
   (smallm's Group: 12 accumulators) and 7 only one; steps of 40-150 rows measured faster in passes of
   6 than of 7 (docs/results.md, issue 40) */
#ifndef PASS_ROWS
#define PASS_ROWS (VW == 8 ? 6 : 7)
#endif

/* STEP_PARTS (benchmarks/step_parts.py only): each thread's CPU time (ns) per part of the step, summed
   over calls (CPU time: on a shared machine the time others take the core is not counted); the step as
   served is built without it. */
#ifdef STEP_PARTS
#include <time.h>
static inline unsigned long long part_now() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec * 1000000000ull + t.tv_nsec;
}
enum { P_NORM, P_QKV, P_ATTN, P_MERGE, P_O, P_W13, P_SILU, P_W2, P_LM, P_BARRIER, P_PARTS };
static unsigned long long step_parts_t[64][P_PARTS];
static thread_local unsigned long long part_t0;
static thread_local long part_lin, part_lins;  /* linears run in this step so far, of part_lins */
static inline void part_add(int i) {
  unsigned long long now = part_now();
  step_parts_t[omp_get_thread_num() & 63][i] += now - part_t0;
  part_t0 = now;
}
#define PART(i) part_add(i)
#define PART_LINEAR() part_add(part_lin == part_lins ? P_LM : (int[]){P_QKV, P_O, P_W13, P_W2}[part_lin % 4]), ++part_lin
extern "C" void step_parts(unsigned long long* out, int threads) {
  for (int t = 0; t < threads; ++t)
    for (int i = 0; i < P_PARTS; ++i) out[t * P_PARTS + i] = step_parts_t[t][i];
}
#else
#define PART(i)
#define PART_LINEAR()
#endif

/* y[r, :N] = x[r] . W^T for R rows over the blocks of the packed W [Npad / BW, K, BW], split over the
   team by bytes and the tail by who asks first (blocks_share; `next` the call's own counter, zero
   before it); a barrier ends it. Each block is read from memory once: up to 8 rows in one
   pass; more rows in passes of at most PASS_ROWS (balanced) over the block while it is still in this
   core's cache. Past one pass the block is compute-bound, and 8 rows' accumulators and weights do not
   fit the registers (measured: 8 five-row chains 80 -> 72 ms in passes of 7). */
template <typename W>
static void linear_rows(long R, const float* x, long ldx, const W* wp, float* y, long ldy, long N, long K, float scale,
                        std::vector<float>& buf, long* next) {
  long blocks = (N + BW - 1) / BW;
  long passes = R <= 8 ? 1 : (R + PASS_ROWS - 1) / PASS_ROWS, per = (R + passes - 1) / passes, ld;
  const void* xa = activations<W>(R, x, ldx, K, buf, ld);  /* this thread's copy: no barrier */
  blocks_share(R, per, xa, ld, wp, y, ldy, blocks, K, scale, next);
  PART_LINEAR();
#pragma omp barrier
  PART(P_BARRIER);
}

/* F.rms_norm: x * rsqrt(mean(x^2) + eps) * w. The squares (exact in double) are summed in 16 running
   sums, then those in order: independent sums vectorise, where one sum waited on each add (a step
   runs 2 L + 1 of these on every thread). */
static inline void rms_norm(const float* x, const float* w, float* y, long h, float eps) {
  double part[16] = {}, ss = 0;
  long i = 0;
  for (; i + 16 <= h; i += 16)
    for (int j = 0; j < 16; ++j) part[j] += (double)x[i + j] * x[i + j];
  for (; i < h; ++i) ss += (double)x[i] * x[i];
  for (int j = 0; j < 16; ++j) ss += part[j];
  float r = 1.f / sqrtf((float)(ss / h) + eps);
  for (long i = 0; i < h; ++i) y[i] = x[i] * r * w[i];
}

/* numpy's argmax of v[a, b) (a < b): the first NaN where there is one, else the first of the largest.
   One pass: each lane keeps its largest value and where it first saw it (strictly larger replaces),
   then the lanes' winners by value, the earlier index among equals. */
static long first_max(const float* v, long a, long b) {
  vf m = splat(-__builtin_inff());
  vi at, lane, nan = {};
  for (int l = 0; l < VW; ++l) lane[l] = l;
  at = lane + (int)a;
  long i = a;
  for (; i + VW <= b; i += VW) {
    vf x = *(const vfu*)(v + i);
    vi more = x > m;
    m = more ? x : m;
    at = more ? lane + (int)i : at;
    nan |= x != x;
  }
  long best = at[0];
  float top = m[0];
  bool any = nan[0] != 0;
  for (int l = 1; l < VW; ++l) {
    if (m[l] > top || (m[l] == top && at[l] < best)) best = at[l], top = m[l];
    any |= nan[l] != 0;
  }
  for (; i < b; ++i) {
    if (v[i] > top) best = i, top = v[i];
    any |= v[i] != v[i];
  }
  if (any)
    for (long j = a; j < b; ++j)
      if (v[j] != v[j]) return j;
  return best;
}

/* of two candidates of first_max, `e` from an earlier slice than `l`: the one numpy's argmax takes */
static inline long first_of(const float* v, long e, long l) {
  if (v[e] != v[e]) return e;
  return v[l] != v[l] || v[l] > v[e] ? l : e;
}

/* HF's rotation: x * cos + cat(-x[d/2:], x[:d/2]) * sin */
static inline void rotate(float* x, const float* cos, const float* sin, long d) {
  long half = d / 2;
  for (long i = 0; i < half; ++i) {
    float a = x[i], b = x[i + half];
    x[i] = a * cos[i] - b * sin[i];
    x[i + half] = b * cos[i + half] + a * sin[i + half];
  }
}

static inline long up(long n) { return (n + BW - 1) / BW * BW; }

/* Positions per attention chunk: a (sequence, kv head) splits its positions at fixed multiples of
   CHUNK, so that a few kv heads share the team (3 over 2 threads left one idle for a third of the
   attention). Fixed positions, not a share of the step's: a row's chunks then hold the same
   positions whatever else the step runs (a decode row alone, the same row in a verified chain, beside
   other sequences; positions it does not see weigh exactly 0), and its attention is bit-identical
   in every one of them (chunks sized by the step's rows made greedy n-gram output differ from AR at
   fp8). */
#ifndef CHUNK
#define CHUNK 128
#endif

/* out[i] = silu(a[i]) b[i]: a sigmoid(a) with e^-|a| (exp_le0), VW at a time (a scalar expf a row cost
   more than the barrier it saves) */
static inline void silu_mul(const float* a, const float* b, float* out, long n) {
  long i = 0;
  for (; i + VW <= n; i += VW) {
    vf x = *(const vfu*)(a + i), ax = x < 0 ? -x : x, t = exp_le0(-ax);
    *(vfu*)(out + i) = x * ((x >= 0 ? splat(1.f) : t) / (1.f + t)) * *(const vfu*)(b + i);
  }
  for (; i < n; ++i) {
    float x = a[i], t = exp_le0(splat(x < 0 ? x : -x))[0];
    out[i] = x * ((x >= 0 ? 1.f : t) / (1.f + t)) * b[i];
  }
}

/* One attention chunk: sequence s, kv head j, positions [c0, c1) of its L; its unnormalised output
   [Q, D], row maxima and sums [Q] (Q = n g query rows) at offsets o / ms of the step's partials. */
struct Chunk { long s, j, c0, c1, o, ms; };

/* chunk c's committed keys and values at layer l into this core's caches (prefetches): issued by the
   chunk's thread when it ends the layer before, as it reaches the barrier, so that the layer's
   linears stream them in while they read their weights */
static inline void kv_ahead(const Chunk& c, const long* meta, float* const* kp, float* const* vp, long l, long D) {
  const long* m = meta + 6 * c.s;
  long off = l * m[4] + c.j * m[5], end = c.c1 < m[2] ? c.c1 : m[2];
  const char *k = (const char*)(kp[c.s] + off + c.c0 * D), *v = (const char*)(vp[c.s] + off + c.c0 * D);
  for (long b = 0, n = (end - c.c0) * D * (long)sizeof(float); b < n; b += 64) {
    __builtin_prefetch(k + b, 0, 2);
    __builtin_prefetch(v + b, 0, 2);
  }
}

/* the chunk's part of attention for the n x g query rows of sequence s over kv head j (attend_range):
   the queries (with bias, rotated) into qr; the keys and values of this step's rows whose positions
   fall in the chunk (with bias; keys rotated) first into the cache: no other task reads them. */
template <int D>
static void attend_chunk(const Chunk& c, const long* m, const float* qkv, long ldq, const float* bqkv, long H,
                         long KV, long g, float* kc, float* vc, const long* posi, const float* cos, const float* sin,
                         const unsigned char* vis, float scale, float* po, float* pm, float* ps,
                         std::vector<float>& qr, std::vector<float>& sc) {
  long start = m[0], n = m[1], p = m[2], L = p + n, Q = n * g, j = c.j;
  qr.resize(Q * D);
  for (long r = 0; r < n; ++r) {
    const float* row = qkv + (start + r) * ldq;
    for (long e = 0; e < g; ++e) {
      long head = j * g + e;
      float* qv = qr.data() + (r * g + e) * D;
      for (long i = 0; i < D; ++i) qv[i] = row[head * D + i] + (bqkv ? bqkv[head * D + i] : 0.f);
      rotate(qv, cos + posi[start + r] * D, sin + posi[start + r] * D, D);
    }
    if (p + r >= c.c0 && p + r < c.c1) {  /* this row's key and value fall in this chunk */
      float* kt = kc + (p + r) * D;
      float* vt = vc + (p + r) * D;
      long ko = (H + j) * D, vo = (H + KV + j) * D;
      for (long i = 0; i < D; ++i) {
        kt[i] = row[ko + i] + (bqkv ? bqkv[ko + i] : 0.f);
        vt[i] = row[vo + i] + (bqkv ? bqkv[vo + i] : 0.f);
      }
      rotate(kt, cos + posi[start + r] * D, sin + posi[start + r] * D, D);
    }
  }
  attend_range<D>(qr.data(), g * D, 0, 0, g, kc, vc, n, L, c.c0, c.c1, vis, scale, po + c.o, pm + c.ms, ps + c.ms, sc);
}

/* R rows of S sequences. meta per sequence (6 longs): first row, rows n, committed prefix p,
   offset of its n x n visibility bytes in vis (-1: causal), the cache's layer and head strides;
   its cache entry (layer l, kv head j, position t) at kp / vp[s] + l * lstride + j * hstride + t * D.
   w per layer: ln1, wqkv (packed), bqkv (or null), wo (packed), ln2, w13 (packed), w2 (packed); the
   packed ones of element type W with scales ws per layer (wqkv, wo, w13, w2), the lm_head of LW.
   Row r is token tok[r] (its embedding row of `embed`) at rotary position posi[r] (its row of the
   cos / sin tables [>= positions, D]). Out: hidden [R, h] (final normed), logits
   [P, ldl] of the rows `pick`, aux [L, R, h] each layer's input (or null).

   Barriers per layer: after each linear (4) and after the attention (the chunks' partials). Each thread
   keeps its own copy of the residual stream and computes the norms, residual adds, the merge of the
   attention chunks and (up to 8 rows) the activation for every row itself, the same operations in the
   same order on every thread, so the copies stay identical: that work is a few thousand operations a
   row, less than the barrier it replaces. */
template <int D, typename W, typename LW>
static void forward(const float* embed, const long* tok, const long* posi, long R, long S, const long* meta,
                    float* const* kp, float* const* vp, const void* const* w, const float* ws, long L, long h, long H, long KV, long I, const float* cos,
                    const float* sin, const unsigned char* vis, float eps, const float* norm, const void* lmv,
                    float lms, long V, const long* pick, long P, float* hidden, float* logits, long ldl, float* aux,
                    int threads, long* best) {
  const LW* lm = (const LW*)lmv;
  long g = H / KV, nq = (H + 2 * KV) * D, ldq = up(nq), ldh = up(h), ld13 = up(2 * I);
  bool own_act = R <= 8;  /* the activation on every thread (more rows: split, then a barrier) */
  std::vector<float> qkv(R * ldq), tmp(R * ldh), gu(R * ld13), act(own_act ? 0 : R * I);
  std::vector<Chunk> chunks;
  long po_n = 0, pm_n = 0;
  for (long s = 0; s < S; ++s) {
    const long* m = meta + 6 * s;
    long n = m[1], L = m[2] + n, nc = (L + CHUNK - 1) / CHUNK;
    for (long j = 0; j < KV; ++j)
      for (long c = 0; c < nc; ++c) {
        chunks.push_back({s, j, c * CHUNK, c + 1 == nc ? L : (c + 1) * CHUNK, po_n, pm_n});
        po_n += n * g * D;
        pm_n += n * g;
      }
  }
  std::vector<float> po(po_n), pm(pm_n), ps(pm_n);
  /* each chunk's thread, fixed for the step (longest first, to the thread with the fewest positions
     so far), so that a thread fetches its own chunks' keys and values ahead (kv_ahead); a chunk's
     result does not depend on which thread computes it. Owners count modulo the team's size: a
     smaller team than asked for still runs every chunk. */
  std::vector<int> owner(chunks.size());
  {
    std::vector<long> order(chunks.size()), load(threads, 0);
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(), [&](long a, long b) {
      return chunks[a].c1 - chunks[a].c0 > chunks[b].c1 - chunks[b].c0; });
    for (long i : order) {
      long t = std::min_element(load.begin(), load.end()) - load.begin();
      owner[i] = t;
      load[t] += chunks[i].c1 - chunks[i].c0;
    }
  }
  std::vector<long> next(4 * L + 1, 0);  /* each linear's tail counter (blocks_share): 4 a layer, the lm_head */
  std::vector<long> cand(best ? threads : 0, -1);  /* with `best`: each thread's argmax of its slice of the logits */
  float scale = 1.f / sqrtf((float)D);
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> sc, qr, xbuf, x(R * h), hn(R * h), att(R * H * D), own(own_act ? R * I : 0),
        hp(P * h);
    bool first = omp_get_thread_num() == 0;
#ifdef STEP_PARTS
    part_t0 = part_now();
    part_lin = 0;
    part_lins = 4 * L;
#endif
    for (long r = 0; r < R; ++r) memcpy(x.data() + r * h, embed + tok[r] * h, h * sizeof(float));
    for (long l = 0; l < L; ++l) {
      const void* const* lw = w + 7 * l;
      const float *ln1 = (const float*)lw[0], *bqkv = (const float*)lw[2], *ln2 = (const float*)lw[4];
      const W *wqkv = (const W*)lw[1], *wo = (const W*)lw[3], *w13 = (const W*)lw[5], *w2 = (const W*)lw[6];
      const float* s = ws + 4 * l;
      if (aux && first) memcpy(aux + l * R * h, x.data(), R * h * sizeof(float));
      for (long r = 0; r < R; ++r) rms_norm(x.data() + r * h, ln1, hn.data() + r * h, h, eps);
      PART(P_NORM);
      linear_rows(R, hn.data(), h, wqkv, qkv.data(), ldq, nq, h, s[0], xbuf, &next[4 * l]);
      for (size_t i = 0; i < chunks.size(); ++i) {
        if (owner[i] % omp_get_num_threads() != omp_get_thread_num()) continue;
        const Chunk& c = chunks[i];
        const long* m = meta + 6 * c.s;
        long off = l * m[4] + c.j * m[5];
        attend_chunk<D>(c, m, qkv.data(), ldq, bqkv, H, KV, g, kp[c.s] + off, vp[c.s] + off, posi, cos, sin,
                        m[3] < 0 ? nullptr : vis + m[3], scale, po.data(), pm.data(), ps.data(), qr, sc);
      }
      if (l + 1 < L)
        for (size_t i = 0; i < chunks.size(); ++i)
          if (owner[i] % omp_get_num_threads() == omp_get_thread_num()) kv_ahead(chunks[i], meta, kp, vp, l + 1, D);
      PART(P_ATTN);
#pragma omp barrier
      PART(P_BARRIER);
      /* the chunks merged, in order: out = sum_c e^(m_c - M) o_c / sum_c e^(m_c - M) s_c */
      for (size_t i = 0; i < chunks.size();) {
        const Chunk& c0 = chunks[i];
        const long* m = meta + 6 * c0.s;
        long n = m[1], Q = n * g, e = i;
        while (e < (long)chunks.size() && chunks[e].s == c0.s && chunks[e].j == c0.j) ++e;
        for (long qi = 0; qi < Q; ++qi) {
          float M = -__builtin_inff(), den = 0.f;
          for (long k = i; k < e; ++k) M = pm[chunks[k].ms + qi] > M ? pm[chunks[k].ms + qi] : M;
          float* out = att.data() + (m[0] + qi / g) * H * D + (c0.j * g + qi % g) * D;
          for (long d = 0; d < D; ++d) out[d] = 0.f;
          for (long k = i; k < e; ++k) {
            float f = expf(pm[chunks[k].ms + qi] - M);
            den += f * ps[chunks[k].ms + qi];
            const float* o = po.data() + chunks[k].o + qi * D;
            for (long d = 0; d < D; ++d) out[d] += f * o[d];
          }
          float inv = 1.f / den;
          for (long d = 0; d < D; ++d) out[d] *= inv;
        }
        i = e;
      }
      PART(P_MERGE);
      linear_rows(R, att.data(), H * D, wo, tmp.data(), ldh, h, H * D, s[1], xbuf,
                  &next[4 * l + 1]);
      for (long r = 0; r < R; ++r) {
        float* xr = x.data() + r * h;
        const float* t = tmp.data() + r * ldh;
        for (long i = 0; i < h; ++i) xr[i] += t[i];
        rms_norm(xr, ln2, hn.data() + r * h, h, eps);
      }
      PART(P_NORM);
      linear_rows(R, hn.data(), h, w13, gu.data(), ld13, 2 * I, h, s[2], xbuf,
                  &next[4 * l + 2]);
      float* a = own_act ? own.data() : act.data();
      if (own_act) {
        for (long r = 0; r < R; ++r) silu_mul(gu.data() + r * ld13, gu.data() + r * ld13 + I, a + r * I, I);
      } else {
#pragma omp for schedule(static)
        for (long r = 0; r < R; ++r) silu_mul(gu.data() + r * ld13, gu.data() + r * ld13 + I, a + r * I, I);
      }
      PART(P_SILU);
      linear_rows(R, a, I, w2, tmp.data(), ldh, h, I, s[3], xbuf, &next[4 * l + 3]);
      for (long r = 0; r < R; ++r)  /* row by row: no division per element, the same adds */
        for (long i = 0; i < h; ++i) x[r * h + i] += tmp[r * ldh + i];
      PART(P_NORM);
    }
#pragma omp for schedule(static) nowait
    for (long r = 0; r < R; ++r) rms_norm(x.data() + r * h, norm, hidden + r * h, h, eps);
    for (long i = 0; i < P; ++i) rms_norm(x.data() + pick[i] * h, norm, hp.data() + i * h, h, eps);
    PART(P_NORM);
    linear_rows(P, hp.data(), h, lm, logits, ldl, V, h, lms, xbuf, &next[4 * L]);
    /* the one row's argmax, each thread over its slice (most of it the part of the lm_head it just
       wrote, still in its cache), rather than one thread over all after the region */
    long T = omp_get_num_threads(), t = omp_get_thread_num();
    if (best && V * t / T < V * (t + 1) / T) cand[t] = first_max(logits, V * t / T, V * (t + 1) / T);
  }
  if (best) {  /* the slices' winners merged in slice order */
    long b = -1;
    for (long c : cand)
      if (c >= 0) b = b < 0 ? c : first_of(logits, b, c);
    *best = b;
  }
}

/* fmt: the decoder weights' format and the lm_head's: 0 fp32 and fp32, 1 bf16 and bf16, 2 e4m3 and bf16.
   best: null, or (P = 1) where the picked row's argmax goes (first_max) */
static int step(const float* embed, const long* tok, const long* posi, long R, long S, const long* meta,
                float* const* kp, float* const* vp, const void* const* w, const float* ws, int fmt, long L, long h,
                long H, long KV, long D, long I, const float* cos, const float* sin, const unsigned char* vis,
                float eps, const float* norm, const void* lm, float lms, long V, const long* pick, long P,
                float* hidden, float* logits, long ldl, float* aux, int threads, long* best) {
  if (R < 1 || S < 1 || P < 1 || (best && P != 1)) return 2;
#define HEAD(DD, W, LW) case DD: forward<DD, W, LW>(embed, tok, posi, R, S, meta, kp, vp, w, ws, L, h, H, KV, I, cos, sin, vis, eps, \
                                                    norm, lm, lms, V, pick, P, hidden, logits, ldl, aux, threads, best); return 0;
#define HEADS(W, LW) switch (D) { HEAD(16, W, LW) HEAD(32, W, LW) HEAD(64, W, LW) HEAD(128, W, LW) } return 1;
  switch (fmt) {
    case 0: HEADS(float, float)
#ifdef HAS_BF16_W
    case 1: HEADS(bf16_t, bf16_t)
#endif
#ifdef HAS_E4M3_W
    case 2: HEADS(e4m3_t, bf16_t)
#endif
  }
  return 3;
}

extern "C" int decode_forward(const float* embed, const long* tok, const long* posi, long R, long S, const long* meta,
                              float* const* kp, float* const* vp,
                              const void* const* w, const float* ws, int fmt, long L, long h, long H, long KV, long D,
                              long I, const float* cos, const float* sin, const unsigned char* vis, float eps,
                              const float* norm, const void* lm, float lms, long V, const long* pick, long P,
                              float* hidden, float* logits, long ldl, float* aux, int threads) {
  return step(embed, tok, posi, R, S, meta, kp, vp, w, ws, fmt, L, h, H, KV, D, I, cos, sin, vis, eps, norm, lm, lms, V,
              pick, P, hidden, logits, ldl, aux, threads, nullptr);
}

/* Up to k greedy autoregressive steps of one sequence in one call (speculation off): each step is
   decode_forward's one-row step (R = S = P = 1, the same arguments), and the first of its largest
   logits (numpy's argmax: the first NaN where there is one; first_max, taken inside the step's
   region) is the next step's token, at the next position. It stops after k steps, or after a token
   of `stops`. The tokens go to out; returns the steps run, or decode_forward's error code negated. Why: after each step's stream of every weight
   through the caches, the interpreter that picks the token and makes the next call starts cold, a
   cost a step run on from here does not pay (docs/results.md, issue 40). */
extern "C" long decode_greedy(const float* embed, long tok0, long p, const long* strides, float* kp, float* vp,
                              const void* const* w, const float* ws, int fmt, long L, long h, long H, long KV, long D,
                              long I, const float* cos, const float* sin, float eps, const float* norm,
                              const void* lm, float lms, long V, float* hidden, float* logits, long ldl, long k,
                              const long* stops, long nstops, long* out, int threads) {
  long tok = tok0, pos = p, meta[6] = {0, 1, p, -1, strides[0], strides[1]}, pick = 0;
  float* const kps[1] = {kp};
  float* const vps[1] = {vp};
  for (long i = 0; i < k; ++i) {
    meta[2] = p + i;
    pos = p + i;
    long best;
    int rc = step(embed, &tok, &pos, 1, 1, meta, kps, vps, w, ws, fmt, L, h, H, KV, D, I, cos, sin, nullptr, eps, norm,
                  lm, lms, V, &pick, 1, hidden, logits, ldl, nullptr, threads, &best);
    if (rc) return -rc;
    out[i] = tok = best;
    for (long j = 0; j < nstops; ++j)
      if (stops[j] == best) return i + 1;
  }
  return k;
}
"""


def _bind(lib: ctypes.CDLL) -> None:
    p, n = ctypes.c_void_p, ctypes.c_long
    lib.decode_forward.argtypes = [p, p, p, n, n, p, p, p, p, p, ctypes.c_int, n, n, n, n, n, n, p, p, p, ctypes.c_float,
                                   p, p, ctypes.c_float, n, p, n, p, p, n, p, ctypes.c_int]
    lib.decode_forward.restype = ctypes.c_int
    lib.decode_greedy.argtypes = [p, n, n, p, p, p, p, p, ctypes.c_int, n, n, n, n, n, n, p, p, ctypes.c_float, p, p,
                                  ctypes.c_float, n, p, p, n, n, p, n, p, ctypes.c_int]
    lib.decode_greedy.restype = ctypes.c_long
    lib.weight_formats.restype = ctypes.c_int


_NATIVE = native.Native("decode_step", _SOURCE, [f"-DVW={smallm.VW}", f"-DNB={smallm.NB}"], _bind)
TAG = _NATIVE.tag


def library() -> ctypes.CDLL | None:
    """The built step, or None when this machine cannot build it (`error()` says why)."""
    return _NATIVE.library()


def error() -> str | None:
    """Why the step could not be built (None when it was, or was not tried yet)."""
    return _NATIVE.error


def weights_refusal(weights: str, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why `weights` cannot be read in its own format by the engine here (None: it can). On CPU only
    the native step reads bf16 and fp8 at 2 and 1 bytes a weight; without it the engine would measure
    the rounded values at fp32 speed, another speed than the format's, so it is refused instead. bf16
    at dtype=bfloat16 is the model's own dtype. On CUDA the rounded values are what is measured (the
    acceptance of the served weights), read at `dtype` (docs/engine.md)."""
    if weights in ("fp32", "auto") or device.type != "cpu" or (weights == "bf16" and dtype == torch.bfloat16):
        return None
    if dtype != torch.float32:
        return f"on CPU the native step reads {weights} weights, and it runs at dtype=float32 only (dtype: {dtype})"
    lib = library()
    if lib is None:
        return f"the native step that reads them could not be built here ({error()})"
    if weights not in smallm.built_formats(lib):
        return f"this CPU lacks {FORMAT_NEEDS[weights]}, which widening {weights} weights in the native step needs"
    return None


# the instructions the native step's widening of a format needs (engine.models.smallm: HAS_BF16_W, HAS_E4M3_W)
FORMAT_NEEDS = {"bf16": "AVX2 (or AVX-512F)", "fp8": "AVX2 (or AVX-512F)"}


class NativeStep:
    """The native step over one LeanLlama's packed weights (see the module doc). Build it with `of`."""

    def __init__(self, model) -> None:
        self.model = model
        ptrs, scales = [], []
        for b in model.blocks:
            ptrs += [b.ln1, b.wqkv._smallm_packed, b.bqkv, b.wo._smallm_packed, b.ln2, b.w13._smallm_packed,
                     b.w2._smallm_packed]
            scales += [w._smallm_scale for w in (b.wqkv, b.wo, b.w13, b.w2)]
        self._keep = [t for t in ptrs if t is not None]  # the tensors the pointers point into
        self._ptrs = (ctypes.c_void_p * len(ptrs))(*[None if t is None else t.data_ptr() for t in ptrs])
        self._scales = (ctypes.c_float * len(scales))(*scales)
        self.fmt = smallm.FORMATS[model.blocks[0].wqkv._smallm_packed.dtype]
        self.lm = model.lm_head._smallm_packed
        self.lm_scale = model.lm_head._smallm_scale
        if smallm.FORMATS[self.lm.dtype] != min(self.fmt, 1):  # the pairs decode_forward is built for
            raise ValueError(f"native decode step: lm_head packed as {self.lm.dtype} beside decoder weights "
                             f"of format {self.fmt}")
        self.vocab = model.lm_head.shape[0]
        self.embed = model.embed.contiguous()  # rows read by token id in the step
        self.intermediate = model.blocks[0].w2.shape[1]
        self.width = self.lm.shape[0] * smallm.BW  # the logits' row stride (the packed lm_head's padded rows)
        # what every call passes the same (pointers as c_void_p: ctypes converts nothing per call)
        vp, h = ctypes.c_void_p, self.embed.shape[1]
        self._fn = library().decode_forward
        self._greedy = library().decode_greedy
        self._weights = (vp(self.embed.data_ptr()),)
        self._layers = (self._ptrs, self._scales, self.fmt, len(model.blocks), h, model.n_heads, model.n_kv,
                        model.head_dim, self.intermediate)
        self._head = (model.eps, vp(model.norm.data_ptr()), vp(self.lm.data_ptr()), self.lm_scale, self.vocab)
        self.hidden_size = h

    @classmethod
    def of(cls, model) -> "NativeStep | None":
        """The step for `model` (a LeanLlama), or None where it cannot run: not CPU fp32, a head size the
        attention task is not built for, a layer without an input norm (draft heads), weights without
        the few-row kernel's packed copy, or no compiler."""
        if model.device.type != "cpu" or model.dtype != torch.float32 or model.head_dim not in attention.HEAD_DIMS:
            return None
        if any(b.ln1 is None for b in model.blocks) or getattr(model.lm_head, "_smallm_packed", None) is None:
            return None
        if any(getattr(w, "_smallm_packed", None) is None for b in model.blocks for w in (b.wqkv, b.wo, b.w13, b.w2)):
            return None
        return cls(model) if library() is not None else None

    def greedy(self, cache, token: int, k: int, stops: tuple[int, ...]) -> list[int]:
        """Up to k greedy decode steps of one sequence in one C++ call (decode_greedy): `token` at the
        cache's committed prefix p, then each step's greedy token at the next position, until k steps
        or a token of `stops`. Returns the tokens chosen (the last one not yet run); the cache then
        holds p + len(tokens) positions. Each step is `__call__`'s one-row step with the same
        arguments, and the token argmax_rows' (the first of the largest logits), so the tokens are
        those of as many calls."""
        m, p = self.model, cache.length
        if p + k > cache.capacity:
            raise ValueError(f"KV cache full: {p}+{k} > {cache.capacity}")
        kc, vc = cache.k, cache.v
        ks = kc.stride()
        if ks[3] != 1 or ks[2] != m.head_dim or ks != vc.stride():
            raise ValueError("native decode step: a cache needs [layers, kv heads, capacity, d], d contiguous")
        cos_t, sin_t = m.rope(p + k)
        emb = self.embed
        hidden, logits = emb.new_empty(1, self.hidden_size), emb.new_empty(1, self.width)
        out, longs = (ctypes.c_long * k)(), ctypes.c_long
        ran = self._greedy(self._weights[0], token, p, (longs * 2)(ks[0], ks[1]), kc.data_ptr(),
                           vc.data_ptr(), *self._layers, cos_t.data_ptr(), sin_t.data_ptr(), *self._head,
                           hidden.data_ptr(), logits.data_ptr(), self.width, k, (longs * len(stops))(*stops),
                           len(stops), out, torch.get_num_threads())
        if ran < 0:
            raise ValueError(f"native decode step: head size {m.head_dim} not built (code {-ran})")
        cache.length = p + ran
        return out[:ran]

    def __call__(self, caches: list, ids: list[list[int]], depths: list[list[int] | None],
                 ancestors: list[torch.Tensor | None], last_only: list[bool], aux_layers: tuple[int, ...] | None
                 ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        """One forward over the rows of several sequences: sequence i runs tokens ids[i] after caches[i]'s
        committed prefix p, at rotary positions p + depths[i] (p, p + 1, ... where None: a prompt or a
        chain), attention causal or along ancestors[i] [n, n] bool, and gets logits of every row or,
        when last_only[i], of its last. Writes their keys and values after each prefix and sets each
        cache's length. Returns per sequence (final normed hidden [n, h], logits [n or 1, V], the
        inputs of `aux_layers` concatenated [n, len*h] or None). The rows' tokens, positions and the
        sequences' layout go to the C++ step as plain integer arrays (a decode row's step is a few
        milliseconds: tensors built and indexed per call were a few percent of it)."""
        m = self.model
        d = m.head_dim
        meta, kp, vp, vis, pick, posi, tok = [], [], [], [], [], [], []
        at = off = 0
        for cache, toks, dep, anc, last in zip(caches, ids, depths, ancestors, last_only):
            n, p = len(toks), cache.length
            if p + n > cache.capacity:
                raise ValueError(f"KV cache full: {p}+{n} > {cache.capacity}")
            k, v = cache.k, cache.v
            ks = k.stride()
            if ks[3] != 1 or ks[2] != d or ks != v.stride():
                raise ValueError("native decode step: a cache needs [layers, kv heads, capacity, d], d contiguous")
            meta += (at, n, p, -1 if anc is None else off, ks[0], ks[1])
            if anc is not None:
                vis.append(anc.reshape(-1).to(dtype=torch.uint8))
                off += n * n
            kp.append(k.data_ptr())
            vp.append(v.data_ptr())
            if last:
                pick.append(at + n - 1)
            else:
                pick += range(at, at + n)
            posi += range(p, p + n) if dep is None else [p + t for t in dep]
            tok += toks
            at += n
        cos_t, sin_t = m.rope(max(posi) + 1)
        vis_t = torch.cat(vis) if vis else None
        # the embedding's dtype and device, never the default device (tests/engine/test_device.py)
        emb = self.embed
        hidden = emb.new_empty(at, self.hidden_size)
        logits = emb.new_empty(len(pick), self.width)
        aux = emb.new_empty(len(m.blocks), at, self.hidden_size) if aux_layers else None
        longs, ptrs = ctypes.c_long * at, ctypes.c_void_p * len(kp)
        rc = self._fn(*self._weights, longs(*tok), longs(*posi), at, len(caches), (ctypes.c_long * len(meta))(*meta),
                      ptrs(*kp), ptrs(*vp), *self._layers, cos_t.data_ptr(), sin_t.data_ptr(),
                      None if vis_t is None else vis_t.data_ptr(), *self._head, (ctypes.c_long * len(pick))(*pick),
                      len(pick), hidden.data_ptr(), logits.data_ptr(), self.width,
                      None if aux is None else aux.data_ptr(), torch.get_num_threads())
        if rc:
            raise ValueError(f"native decode step: head size {d} not built (code {rc})")
        if self.width != self.vocab:
            logits = logits[:, :self.vocab]
        out, start, li = [], 0, 0
        for cache, toks, last in zip(caches, ids, last_only):
            n, nl = len(toks), 1 if last else len(toks)
            cache.length += n
            feats = aux_features(aux, aux_layers, slice(start, start + n))
            out.append((hidden[start:start + n], logits[li:li + nl], feats))
            start, li = start + n, li + nl
        return out
