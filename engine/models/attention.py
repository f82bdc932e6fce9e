"""Decode attention over a KV pool on CPU fp32: every short sequence of a batched step (a decode row,
a chain, a draft tree) attends over exactly its own length, each sequence's keys and values read once
for all of its query rows and the g query heads that share a kv head.

Why: the pooled SDPA call (engine.models.batchplan.PooledAttention) pads every sequence of a call to the
longest one and reads the pool well below the copy bandwidth; docs/design.md has the measurements.

One task is one (sequence, kv head), over torch's OpenMP threads: the scores of its n x g query rows
against 16 keys at a time (the block read from memory once, then from L1 for every query row; each
dot product kept as a vector of partial sums, and one transposing reduction summing 16 of them at
once), the masked softmax per query row, then the values weighted by 4 query rows at a time (their
accumulators in registers, each value row loaded once per 4). A row sees the sequence's committed
prefix and, within its own tree, the nodes its `visible` matrix marks (causal when there is none).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from engine.models import native
from tuner.schema.precision import NATIVE_HEAD_DIMS

# head sizes the kernel is built for (SmolLM2 64, Llama/Qwen 64-128, tiny test models 16); the config reads them too
HEAD_DIMS = NATIVE_HEAD_DIMS

# One (sequence, kv head) task: `attend_one`. Shared with the native decode step
# (engine.models.decode_step), which runs it inside its own parallel region.
TASK_SOURCE = r"""
#include <vector>

static inline vf splat(float x) { return (vf){} + x; }

/* the sum of a vector's lanes as a tree of halves (a scalar loop would be VW - 1 dependent adds) */
static inline float hsum(vf a) {
#if VW == 16
  auto h8 = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  auto h8 = a;
#endif
  auto h4 = __builtin_shufflevector(h8, h8, 0, 1, 2, 3) + __builtin_shufflevector(h8, h8, 4, 5, 6, 7);
  auto h2 = __builtin_shufflevector(h4, h4, 0, 1) + __builtin_shufflevector(h4, h4, 2, 3);
  return h2[0] + h2[1];
}

/* the query rows whose outputs accumulate together in registers */
#define QB 4

#if VW == 16
static const int BITREV[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
#else
static const int BITREV[8] = {0, 4, 2, 6, 1, 5, 3, 7};
#endif

/* lane l of the result: the sum of the lanes of a[BITREV[l]]. Each level halves the vectors, adding
   the lower halves of a pair to their upper halves side by side; after log2(VW) levels the lanes
   come out in bit-reversed order of the inputs, which the caller's indexing undoes. */
static inline vf lane_sums(const vf* a) {
#if VW == 16
  vf c[8], d[4], e[2];
  for (int i = 0; i < 8; ++i)
    c[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
         + __builtin_shufflevector(a[2 * i], a[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    d[i] = __builtin_shufflevector(c[2 * i], c[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27)
         + __builtin_shufflevector(c[2 * i], c[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    e[i] = __builtin_shufflevector(d[2 * i], d[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29)
         + __builtin_shufflevector(d[2 * i], d[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  return __builtin_shufflevector(e[0], e[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30)
       + __builtin_shufflevector(e[0], e[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
#else
  vf c[4], d[2];
  for (int i = 0; i < 4; ++i)
    c[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11)
         + __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int i = 0; i < 2; ++i)
    d[i] = __builtin_shufflevector(c[2 * i], c[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13)
         + __builtin_shufflevector(c[2 * i], c[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  return __builtin_shufflevector(d[0], d[1], 0, 8, 2, 10, 4, 12, 6, 14)
       + __builtin_shufflevector(d[0], d[1], 1, 9, 3, 11, 5, 13, 7, 15);
#endif
}

static inline float hmax(vf a) {
  float m = a[0];
  for (int l = 1; l < VW; ++l) m = a[l] > m ? a[l] : m;
  return m;
}

/* e^x for x <= 0 (0 below -87): 2^(x log2 e) split into 2^n (exponent bits) and 2^f, |f| <= 1/2, by a
   degree-7 Taylor polynomial of e^(f ln 2) (relative error < 1e-7) */
static inline vf exp_le0(vf x) {
  vf t = x * 1.4426950408889634f;
  vf lo = splat(-126.f);
  t = t < lo ? lo : t;
  vf n = (t + 12582912.f) - 12582912.f;  /* round to nearest: 1.5 * 2^23 pushes the fraction out */
  vf f = (t - n) * 0.6931471805599453f;
  vf p = splat(1.f / 5040);
  p = p * f + 1.f / 720; p = p * f + 1.f / 120; p = p * f + 1.f / 24;
  p = p * f + 1.f / 6; p = p * f + 0.5f; p = p * f + 1.f; p = p * f + 1.f;
  vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  vf r = p * (vf)bits;
  return x < splat(-87.f) ? splat(0.f) : r;
}

/* Attention of the n x g query rows of one sequence over one kv head, positions [c0, c1) of its L: query
   qi (row qi / g, head h g + qi % g) at q + (start + qi / g) * q_row + (h g + qi % g) * D; K / V this kv
   head's [capacity, D] (capacity a multiple of VW: the last block of scores reads up to VW - 1
   positions past c1, masked; c0 a multiple of VW); the tree part (the last n positions, those of it
   within [c0, c1)) along vis [n, n] (null: causal). Out, unnormalised: po [Q, D] the values weighted by e^(score - pm),
   pm [Q] each row's largest score here (-inf where it sees nothing here: weights 0), ps [Q] the sum of
   its weights. `sc` is the caller's scratch. Split over positions, the parts merge as
   sum_c e^(pm_c - M) po_c / sum_c e^(pm_c - M) ps_c (M the largest pm_c). */
template <int D>
static void attend_range(const float* q, long q_row, long start, long h, long g, const float* K, const float* V,
                         long n, long L, long c0, long c1, const unsigned char* vis, float scale, float* po,
                         float* pm, float* ps, std::vector<float>& sc) {
  long p = L - n, Q = n * g;
  long len = c1 - c0, Lp = (len + VW - 1) / VW * VW;  /* rows of scores padded to whole vectors with -inf */
  long Qp = (Q + QB - 1) / QB * QB;
  sc.resize(Qp * Lp);
  for (long i = Q * Lp; i < Qp * Lp; ++i) sc[i] = 0.f;
  /* scores, VW positions at a time: each position's dot product stays a vector of partial sums
     (D / VW fused multiply-adds), and one transposing reduction sums VW of them at once */
  for (long t0 = 0; t0 < len; t0 += VW) {
    const float* kb = K + (c0 + t0) * D;
    for (long qi = 0; qi < Q; ++qi) {
      const float* qv = q + (start + qi / g) * q_row + (h * g + qi % g) * D;
      vf a[VW];
      _Pragma("GCC unroll 16")
      for (int l = 0; l < VW; ++l) {
        vf x = {};
        for (int i = 0; i < D; i += VW) x += *(const vfu*)(qv + i) * *(const vfu*)(kb + l * D + i);
        a[BITREV[l]] = x;
      }
      *(vfu*)(sc.data() + qi * Lp + t0) = lane_sums(a) * scale;
    }
  }
  for (long r = 0; r < n; ++r) {
    for (long j = 0; j < g; ++j) {
      long qi = r * g + j;
      float* row = sc.data() + qi * Lp;
      for (long t = len; t < Lp; ++t) row[t] = -__builtin_inff();
      for (long c = p > c0 ? 0 : c0 - p; c < n && p + c < c1; ++c) {  /* the tree part here: only what this row sees */
        bool seen = vis == nullptr ? c <= r : vis[r * n + c] != 0;
        if (!seen) row[p - c0 + c] = -__builtin_inff();
      }
      vf vm = splat(-__builtin_inff());
      for (long t = 0; t < Lp; t += VW) {
        vf x = *(vfu*)(row + t);
        vm = x > vm ? x : vm;
      }
      float mx = hmax(vm), base = mx == -__builtin_inff() ? 0.f : mx;
      vf vs = {};
      for (long t = 0; t < Lp; t += VW) {
        vf e = exp_le0(*(vfu*)(row + t) - base);
        *(vfu*)(row + t) = e;
        vs += e;
      }
      pm[qi] = mx;
      ps[qi] = hsum(vs);
    }
  }
  /* the weighted values, QB query rows at a time: their accumulators stay in registers while each
     value row is loaded once per block (rows past Q carry zero weights) */
  for (long q0 = 0; q0 < Q; q0 += QB) {
    vf acc[QB][D / VW] = {};
    for (long t = 0; t < len; ++t) {
      const float* vt = V + (c0 + t) * D;
      vf vv[D / VW];
      for (int i = 0; i < D / VW; ++i) vv[i] = *(const vfu*)(vt + i * VW);
      _Pragma("GCC unroll 4")
      for (int b = 0; b < QB; ++b) {
        float w = sc[(q0 + b) * Lp + t];
        for (int i = 0; i < D / VW; ++i) acc[b][i] += w * vv[i];
      }
    }
    for (int b = 0; b < QB && q0 + b < Q; ++b)
      for (int i = 0; i < D / VW; ++i) *(vfu*)(po + (q0 + b) * D + i * VW) = acc[b][i];
  }
}

/* one (sequence, kv head) task: the n x g query rows of the sequence's rows start..start+n-1 (row r's
   head h * g + j at q + (start + r) * q_row + (h * g + j) * D) over its L positions of K / V
   (attend_range over all of them), the tree part along vis [n, n] (null: causal); outputs at the same
   places in o (row stride o_row). `sc` and `part` are the caller's scratch. */
template <int D>
static void attend_one(const float* q, long q_row, const float* K, const float* V, float* o, long o_row,
                       long start, long n, long L, const unsigned char* vis, long h, long g, float scale,
                       std::vector<float>& sc, std::vector<float>& part) {
  long Q = n * g;
  part.resize(Q * (D + 2));
  float *po = part.data(), *pm = po + Q * D, *ps = pm + Q;
  attend_range<D>(q, q_row, start, h, g, K, V, n, L, 0, L, vis, scale, po, pm, ps, sc);
  for (long qi = 0; qi < Q; ++qi) {
    float inv = 1.f / ps[qi];
    float* out = o + (start + qi / g) * o_row + (h * g + qi % g) * D;
    for (long i = 0; i < D; ++i) out[i] = po[qi * D + i] * inv;
  }
}
"""

_SOURCE = native.VECTORS + TASK_SOURCE + r"""
/* meta per sequence: slot, first query row of the step, rows n, length L (prefix L - n plus the n
   rows just written), offset of its n x n visibility bytes (-1: causal) */
template <int D>
static void run(const float* q, long q_row, const float* kc, const float* vc, float* o, long o_row,
                long nseq, const long* meta, const unsigned char* vis, long n_kv, long g, long cap,
                float scale, int threads) {
  long tasks = nseq * n_kv;
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> sc, part;
#pragma omp for schedule(dynamic, 1)
    for (long task = 0; task < tasks; ++task) {
      long s = task / n_kv, h = task % n_kv;
      const long* m = meta + 5 * s;
      long slot = m[0], voff = m[4];
      attend_one<D>(q, q_row, kc + (slot * n_kv + h) * cap * D, vc + (slot * n_kv + h) * cap * D, o, o_row,
                    m[1], m[2], m[3], voff < 0 ? nullptr : vis + voff, h, g, scale, sc, part);
    }
  }
}

extern "C" int decode_attention(const float* q, long q_row, const float* kc, const float* vc, float* o, long o_row,
                                long nseq, const long* meta, const unsigned char* vis, long n_kv, long g, long cap,
                                long d, float scale, int threads) {
  switch (d) {
#define HEAD(D) case D: run<D>(q, q_row, kc, vc, o, o_row, nseq, meta, vis, n_kv, g, cap, scale, threads); return 0;
    HEAD(16) HEAD(32) HEAD(64) HEAD(128)
  }
  return 1;
}
"""


def _bind(lib: ctypes.CDLL) -> None:
    lib.decode_attention.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p,
                                     ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p,
                                     ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.c_long,
                                     ctypes.c_float, ctypes.c_int]
    lib.decode_attention.restype = ctypes.c_int


_NATIVE = native.Native("attention", _SOURCE, [f"-DVW={16 if native.avx512() else 8}"], _bind)
TAG = _NATIVE.tag


def library() -> ctypes.CDLL | None:
    """The built kernel, or None when this machine cannot build it (`error()` says why)."""
    return _NATIVE.library()


def error() -> str | None:
    """Why the kernel could not be built (None when it was, or was not tried yet)."""
    return _NATIVE.error


def usable(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether a pool of this device, dtype and head size attends through the kernel."""
    return device.type == "cpu" and dtype == torch.float32 and head_dim in HEAD_DIMS and library() is not None


@dataclass
class DecodeBatch:
    """The sequences of a step that attend through the kernel: per sequence (slot, first row, rows,
    length, offset of its visibility bytes or -1), and the visibility bytes of the trees."""

    meta: torch.Tensor  # int64 [seqs, 5]
    vis: torch.Tensor  # uint8 [sum of n*n over sequences with a tree] (at least one byte)

    @classmethod
    def of(cls, rows: list[tuple[int, int, int, int, torch.Tensor | None]]) -> "DecodeBatch":
        """From (slot, first row, rows n, length, visible [n, n] bool or None for causal) per sequence."""
        meta, vis, off = [], [], 0
        for slot, start, n, length, visible in rows:
            if visible is None:
                meta.append((slot, start, n, length, -1))
                continue
            meta.append((slot, start, n, length, off))
            vis.append(visible.reshape(-1).to(device="cpu", dtype=torch.uint8))
            off += n * n
        return cls(torch.tensor(meta, dtype=torch.long).reshape(-1, 5),
                   torch.cat(vis) if vis else torch.zeros(1, dtype=torch.uint8))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, batch: DecodeBatch) -> None:
    """o[row, head] for the rows of `batch`: q [rows, H, d] (any row stride, heads and d contiguous)
    over one layer's pool k/v [slots, kv_heads, capacity, d] (contiguous), written into o [rows, H, d]
    (contiguous). Rows of the step outside `batch` are left as they are."""
    lib = _NATIVE.library()
    if lib is None:
        raise RuntimeError(f"decode attention kernel unavailable: {_NATIVE.error}")
    slots, n_kv, cap, d = k.shape
    heads = q.shape[1]
    if q.stride(2) != 1 or q.stride(1) != d or not (k.is_contiguous() and v.is_contiguous() and o.is_contiguous()):
        raise ValueError("decode attention: q needs contiguous heads, k/v/o contiguous")
    if cap % 16:  # scores are computed 16 positions at a time (the last block reads up to 15 past a length)
        raise ValueError(f"decode attention: capacity {cap} is not a multiple of 16")
    rc = lib.decode_attention(q.data_ptr(), q.stride(0), k.data_ptr(), v.data_ptr(), o.data_ptr(), heads * d,
                              batch.meta.shape[0], batch.meta.data_ptr(), batch.vis.data_ptr(), n_kv,
                              heads // n_kv, cap, d, d ** -0.5, torch.get_num_threads())
    if rc:
        raise ValueError(f"decode attention: head size {d} not built (built: {HEAD_DIMS})")
