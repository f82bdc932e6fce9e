"""The native decode step: one C++ call runs a whole target forward of a few rows (1-8: a decode row,
a chain, a draft tree) of ONE sequence on CPU fp32, every decoder layer and the lm_head.

Why: a one-row step of SmolLM2 reads 538 MB of weights, which this machine kind streams in about
19-21 ms; the compiled layer-by-layer step took 32-35 ms on the AMX Xeon (docs/results.md), the rest
being 30 compiled-graph calls and their guards, each linear's own OpenMP region, SDPA and the
rotations between them. Here one OpenMP region spans the step: the linears are the few-row kernel's
blocks (engine.models.smallm) split over the threads, the attention is the decode attention kernel's
task (engine.models.attention) per kv head, and the norms, rotations and activations run between
barriers of the same threads.

The weights are the few-row kernel's packed copies (`_smallm_packed`, made by kernels.pack_weights
where memory allows); the KV cache is the lean forward's `KVCache` (a lone cache or a pool slot).
Results match the lean forward's to fp32 rounding (another summation order), which tests check
against it and against transformers' greedy output.
"""

from __future__ import annotations

import ctypes

import torch

from engine.models import attention, native, smallm

MAX_ROWS = 8  # rows of one step (the few-row kernel's largest block)

_SOURCE = native.VECTORS + smallm.BLOCK_SOURCE + attention.TASK_SOURCE + r"""
#include <math.h>
#include <string.h>
#include <omp.h>

/* y[m, :N] = x[m] . W^T over the blocks of the packed W [Npad / BW, K, BW], split over the team (the
   omp for's barrier ends it); y's rows are ldy apart (ldy >= the padded width) */
template <int M>
static void linear(const float* x, long ldx, const float* wp, float* y, long ldy, long N, long K) {
  long blocks = (N + BW - 1) / BW;
#pragma omp for schedule(static)
  for (long b = 0; b < blocks; ++b) block<M>(x, ldx, wp + b * K * BW, y + b * BW, ldy, K);
}

static void linear_rows(long M, const float* x, long ldx, const float* wp, float* y, long ldy, long N, long K) {
  switch (M) {
    case 1: linear<1>(x, ldx, wp, y, ldy, N, K); break;
    case 2: linear<2>(x, ldx, wp, y, ldy, N, K); break;
    case 3: linear<3>(x, ldx, wp, y, ldy, N, K); break;
    case 4: linear<4>(x, ldx, wp, y, ldy, N, K); break;
    case 5: linear<5>(x, ldx, wp, y, ldy, N, K); break;
    case 6: linear<6>(x, ldx, wp, y, ldy, N, K); break;
    case 7: linear<7>(x, ldx, wp, y, ldy, N, K); break;
    default: linear<8>(x, ldx, wp, y, ldy, N, K); break;
  }
}

/* F.rms_norm: x * rsqrt(mean(x^2) + eps) * w */
static inline void rms_norm(const float* x, const float* w, float* y, long h, float eps) {
  double ss = 0;
  for (long i = 0; i < h; ++i) ss += (double)x[i] * x[i];
  float r = 1.f / sqrtf((float)(ss / h) + eps);
  for (long i = 0; i < h; ++i) y[i] = x[i] * r * w[i];
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

/* w: per layer ln1, wqkv (packed), bqkv (or null), wo (packed), ln2, w13 (packed), w2 (packed).
   Cache entry (layer l, kv head j, position t) at ck / cv + l * lstride + j * hstride + t * d.
   Rows write positions prefix..prefix+M-1 and see the prefix plus, among themselves, vis [M, M]
   (null: causal); cos / sin [M, d] at their rotary positions. Out: hidden [M, h] (final normed),
   logits [lm_rows, Vpad] of the last lm_rows rows, aux [L, M, h] each layer's input (or null). */
template <int D>
static void step(const float* emb, long M, const float* const* w, long L, long h, long H, long KV, long I,
                 float* ck, float* cv, long lstride, long hstride, long prefix, const float* cos,
                 const float* sin, const unsigned char* vis, float eps, const float* norm, const float* lm,
                 long V, long lm_rows, float* hidden, float* logits, long ldl, float* aux, int threads) {
  long g = H / KV, nq = (H + 2 * KV) * D, ldq = up(nq), ldh = up(h), ld13 = up(2 * I);
  std::vector<float> x(emb, emb + M * h), hn(M * h), qkv(M * ldq), att(M * H * D), tmp(M * ldh), gu(M * ld13),
      act(M * I);
  float scale = 1.f / sqrtf((float)D);
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> sc;
    for (long l = 0; l < L; ++l) {
      const float* const* lw = w + 7 * l;
      const float *ln1 = lw[0], *wqkv = lw[1], *bqkv = lw[2], *wo = lw[3], *ln2 = lw[4], *w13 = lw[5], *w2 = lw[6];
      float *kl = ck + l * lstride, *vl = cv + l * lstride;
#pragma omp single
      {
        if (aux) memcpy(aux + l * M * h, x.data(), M * h * sizeof(float));
        for (long r = 0; r < M; ++r) rms_norm(x.data() + r * h, ln1, hn.data() + r * h, h, eps);
      }
      linear_rows(M, hn.data(), h, wqkv, qkv.data(), ldq, nq, h);
      /* bias, rotation of q and k heads, this step's keys and values into the cache */
#pragma omp for schedule(static)
      for (long u = 0; u < M * (H + 2 * KV); ++u) {
        long r = u / (H + 2 * KV), c = u % (H + 2 * KV);
        float* seg = qkv.data() + r * ldq + c * D;
        if (bqkv)
          for (long i = 0; i < D; ++i) seg[i] += bqkv[c * D + i];
        if (c < H + KV) rotate(seg, cos + r * D, sin + r * D, D);
        if (c >= H + KV) memcpy(vl + (c - H - KV) * hstride + (prefix + r) * D, seg, D * sizeof(float));
        else if (c >= H) memcpy(kl + (c - H) * hstride + (prefix + r) * D, seg, D * sizeof(float));
      }
#pragma omp for schedule(dynamic, 1)
      for (long j = 0; j < KV; ++j)
        attend_one<D>(qkv.data(), ldq, kl + j * hstride, vl + j * hstride, att.data(), H * D, 0, M, prefix + M, vis, j,
                      g, scale, sc);
      linear_rows(M, att.data(), H * D, wo, tmp.data(), ldh, h, H * D);
#pragma omp single
      {
        for (long r = 0; r < M; ++r) {
          float* xr = x.data() + r * h;
          const float* t = tmp.data() + r * ldh;
          for (long i = 0; i < h; ++i) xr[i] += t[i];
          rms_norm(xr, ln2, hn.data() + r * h, h, eps);
        }
      }
      linear_rows(M, hn.data(), h, w13, gu.data(), ld13, 2 * I, h);
#pragma omp for schedule(static)
      for (long u = 0; u < M * I; ++u) {
        long r = u / I, i = u % I;
        float a = gu[r * ld13 + i], b = gu[r * ld13 + I + i];
        act[u] = a / (1.f + expf(-a)) * b;
      }
      linear_rows(M, act.data(), I, w2, tmp.data(), ldh, h, I);
#pragma omp for schedule(static)
      for (long u = 0; u < M * h; ++u) x[u] += tmp[(u / h) * ldh + u % h];
    }
#pragma omp single
    for (long r = 0; r < M; ++r) rms_norm(x.data() + r * h, norm, hidden + r * h, h, eps);
    linear_rows(lm_rows, hidden + (M - lm_rows) * h, h, lm, logits, ldl, V, h);
  }
}

extern "C" int decode_step(const float* emb, long M, const float* const* w, long L, long h, long H, long KV, long D,
                           long I, float* ck, float* cv, long lstride, long hstride, long prefix, const float* cos,
                           const float* sin, const unsigned char* vis, float eps, const float* norm, const float* lm,
                           long V, long lm_rows, float* hidden, float* logits, long ldl, float* aux, int threads) {
  if (M < 1 || M > 8 || lm_rows < 1 || lm_rows > M) return 2;
  switch (D) {
#define HEAD(DD) case DD: step<DD>(emb, M, w, L, h, H, KV, I, ck, cv, lstride, hstride, prefix, cos, sin, vis, eps, \
                                   norm, lm, V, lm_rows, hidden, logits, ldl, aux, threads); return 0;
    HEAD(16) HEAD(32) HEAD(64) HEAD(128)
  }
  return 1;
}
"""


def _bind(lib: ctypes.CDLL) -> None:
    p, n = ctypes.c_void_p, ctypes.c_long
    lib.decode_step.argtypes = [p, n, p, n, n, n, n, n, n, p, p, n, n, n, p, p, p, ctypes.c_float, p, p, n, n, p, p,
                                n, p, ctypes.c_int]
    lib.decode_step.restype = ctypes.c_int


_NATIVE = native.Native("decode_step", _SOURCE, [f"-DVW={smallm.VW}", f"-DNB={smallm.NB}"], _bind)
TAG = _NATIVE.tag


def library() -> ctypes.CDLL | None:
    """The built step, or None when this machine cannot build it (`error()` says why)."""
    return _NATIVE.library()


def error() -> str | None:
    """Why the step could not be built (None when it was, or was not tried yet)."""
    return _NATIVE.error


class NativeStep:
    """The native step over one LeanLlama's packed weights (see the module doc). Build it with `of`."""

    def __init__(self, model) -> None:
        self.model = model
        ptrs = []
        for b in model.blocks:
            ptrs += [b.ln1, b.wqkv._smallm_packed, b.bqkv, b.wo._smallm_packed, b.ln2, b.w13._smallm_packed,
                     b.w2._smallm_packed]
        self._keep = [t for t in ptrs if t is not None]  # the tensors the pointers point into
        self._ptrs = (ctypes.c_void_p * len(ptrs))(*[None if t is None else t.data_ptr() for t in ptrs])
        self.lm = model.lm_head._smallm_packed
        self.vocab = model.lm_head.shape[0]
        self.intermediate = model.blocks[0].w2.shape[1]

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

    def __call__(self, cache, ids: torch.Tensor, pos: torch.Tensor, ancestors: torch.Tensor | None,
                 last_only: bool, aux_layers: tuple[int, ...] | None
                 ) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
        """Run tokens `ids` [n] (n <= MAX_ROWS) at rotary positions `pos` [n] after the cache's committed
        prefix, attention causal or along `ancestors` [n, n] bool. Writes their keys and values at
        positions prefix..prefix+n-1 (the caller sets the cache's length). Returns the final normed
        hidden [n, h], logits [n or 1, V] and each of `aux_layers`' input [n, h]."""
        m = self.model
        n, p = ids.shape[0], cache.length
        k, v = cache.k, cache.v
        if k.stride(3) != 1 or k.stride(2) != m.head_dim or k.stride() != v.stride():
            raise ValueError("native decode step: the cache needs [layers, kv heads, capacity, d] with d contiguous")
        cos_t, sin_t = m.rope(int(pos.max()) + 1)
        cos, sin = cos_t[pos].contiguous(), sin_t[pos].contiguous()
        emb = m.embed[ids].contiguous()
        vis = None if ancestors is None else ancestors.to(dtype=torch.uint8).contiguous()
        h = emb.shape[1]
        lm_rows = 1 if last_only else n
        hidden = emb.new_empty(n, h)
        width = self.lm.shape[0] * smallm.BW
        logits = emb.new_empty(lm_rows, width)
        aux = emb.new_empty(len(m.blocks), n, h) if aux_layers else None
        rc = library().decode_step(
            emb.data_ptr(), n, self._ptrs, len(m.blocks), h, m.n_heads, m.n_kv, m.head_dim, self.intermediate,
            k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1), p, cos.data_ptr(), sin.data_ptr(),
            None if vis is None else vis.data_ptr(), m.eps, m.norm.data_ptr(), self.lm.data_ptr(), self.vocab,
            lm_rows, hidden.data_ptr(), logits.data_ptr(), width, None if aux is None else aux.data_ptr(),
            torch.get_num_threads())
        if rc:
            raise ValueError(f"native decode step: {n} rows or head size {m.head_dim} not supported (code {rc})")
        if width != self.vocab:
            logits = logits[:, :self.vocab]
        return hidden, logits, {i: aux[i] for i in (aux_layers or ())}
