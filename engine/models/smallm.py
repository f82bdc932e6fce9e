"""A CPU fp32 linear for a few rows (1-8) that reads each weight once: the "smallm" form of the
linear plan (engine.models.kernels), built from C++ at first use with the system compiler (the one
inductor needs anyway) for this CPU (-march=native), and measured against oneDNN and MKL before
the plan uses it.

Why: on the 2-core Xeon of docs/results.md, oneDNN's small-M GEMM over SmolLM2's decoder weights
took far longer for 4 and 8 rows than one row takes to stream them, and this kernel less
(docs/results.md, "Figures behind the code"). Verification steps (a chain of 5 rows) and batched steps of a few requests are
exactly these shapes.

Layout: the weight w [N, K] is packed as [N / BW, K, BW] (BW output columns side by side, zero rows
padding N up to a multiple of BW), so one block streams contiguously; for each k, one vector load
of the block's columns and one broadcast of x[m, k] per row feed M * BW/VW fused multiply-adds
into accumulators held in registers, and y [M, BW] is stored once: no horizontal sums. Blocks are
split over the OpenMP threads of torch's own libgomp (the .so links the runtime the process has
already loaded, so torch's thread count is the kernel's).
"""

from __future__ import annotations

import ctypes

import torch

from engine.models import native

MAX_ROWS = 8  # rows per pass; more rows run in passes of 8 (the plan measures whether that pays)

# One block of BW output columns for M rows: y[m, :BW] = x[m] . wb, wb one packed block [K, BW]. Shared
# with the native decode step (engine.models.decode_step), which runs it inside its own parallel region.
BLOCK_SOURCE = r"""
#define BW (VW * NB)

template <int M>
static inline void block(const float* x, long ldx, const float* wb, float* y, long ldy, long K) {
  /* one row has a single accumulator chain per vector: two k-rows in flight hide the FMA latency */
  constexpr int KU = M == 1 ? 2 : 1;
  vf acc[KU][NB][M];
  for (int u = 0; u < KU; ++u)
    for (int j = 0; j < NB; ++j)
      for (int m = 0; m < M; ++m) acc[u][j][m] = (vf){};
  long k = 0;
  for (; k + KU <= K; k += KU) {
    _Pragma("GCC unroll 2")
    for (int u = 0; u < KU; ++u) {
      /* the stream 32 k-rows ahead of the loads: every 64-byte line of a row (a row of 64 floats is
         4 lines; prefetching only 2 of them cost a third of the speed, docs/design.md) */
#if BW >= 16
      _Pragma("GCC unroll 4")
      for (int off = 0; off < BW; off += 16) __builtin_prefetch(wb + (k + u + 32) * BW + off);
#else
      __builtin_prefetch(wb + (k + u + 32) * BW);
      __builtin_prefetch(wb + (k + u + 32) * BW + 32);
#endif
      vf w[NB];
      _Pragma("GCC unroll 4")
      for (int j = 0; j < NB; ++j) w[j] = *(const vfu*)(wb + (k + u) * BW + j * VW);
      _Pragma("GCC unroll 8")
      for (int m = 0; m < M; ++m) {
        float xs = x[m * ldx + k + u];
        _Pragma("GCC unroll 4")
        for (int j = 0; j < NB; ++j) acc[u][j][m] += xs * w[j];
      }
    }
  }
  for (; k < K; ++k)
    for (int j = 0; j < NB; ++j) {
      vf w = *(const vfu*)(wb + k * BW + j * VW);
      for (int m = 0; m < M; ++m) acc[0][j][m] += x[m * ldx + k] * w;
    }
  for (int j = 0; j < NB; ++j)
    for (int m = 0; m < M; ++m) {
      vf a = acc[0][j][m];
      for (int u = 1; u < KU; ++u) a += acc[u][j][m];
      *(vfu*)(y + m * ldy + j * VW) = a;
    }
}

/* block<M> for a row count m known at run time (1-8) */
static inline void block_m(long m, const float* x, long ldx, const float* wb, float* y, long ldy, long K) {
  switch (m) {
    case 1: block<1>(x, ldx, wb, y, ldy, K); break;
    case 2: block<2>(x, ldx, wb, y, ldy, K); break;
    case 3: block<3>(x, ldx, wb, y, ldy, K); break;
    case 4: block<4>(x, ldx, wb, y, ldy, K); break;
    case 5: block<5>(x, ldx, wb, y, ldy, K); break;
    case 6: block<6>(x, ldx, wb, y, ldy, K); break;
    case 7: block<7>(x, ldx, wb, y, ldy, K); break;
    default: block<8>(x, ldx, wb, y, ldy, K); break;
  }
}
"""

_SOURCE = native.VECTORS + BLOCK_SOURCE + r"""
extern "C" int smallm_linear(const float* x, const float* wp, float* y, long M, long N, long K, int threads) {
  if (M < 1 || M > 8) return 1;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (long b = 0; b < N / BW; ++b) block_m(M, x, K, wp + b * K * BW, y + b * BW, N, K);
  return 0;
}
"""


# AVX-512: 16 lanes, 4 vectors of columns per block (32 accumulators at 8 rows fill the 32 registers);
# AVX2: 8 lanes, one vector (its 16 registers hold 8 accumulators, the weights and a broadcast)
VW, NB = (16, 4) if native.avx512() else (8, 1)
BW = VW * NB


def _bind(lib: ctypes.CDLL) -> None:
    lib.smallm_linear.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3 + [ctypes.c_int]
    lib.smallm_linear.restype = ctypes.c_int


_NATIVE = native.Native("smallm", _SOURCE, [f"-DVW={VW}", f"-DNB={NB}"], _bind)
TAG = _NATIVE.tag


def library() -> ctypes.CDLL | None:
    """The built kernel, or None when this machine cannot build it (no g++, a failed compile: `error()` says why)."""
    return _NATIVE.library()


def error() -> str | None:
    """Why the kernel could not be built (None when it was, or was not tried yet)."""
    return _NATIVE.error


def pack(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] fp32 as [ceil(N / BW), K, BW]: each block of BW output columns contiguous, k-major."""
    n, k = w.shape
    pad = -n % BW
    if pad:
        w = torch.cat([w, w.new_zeros(pad, k)])
    return w.detach().reshape(-1, BW, k).transpose(1, 2).contiguous()


def linear(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ w.T (+ bias) for the weight `pack`ed into `packed` (n its output width), in passes
    of at most MAX_ROWS rows. Needs `library()`."""
    lib = _NATIVE.library()
    if lib is None:
        raise RuntimeError(f"smallm kernel unavailable: {_NATIVE.error}")
    x = x.contiguous()
    rows, k = x.shape
    width = packed.shape[0] * BW
    y = x.new_empty(rows, width)
    threads = torch.get_num_threads()
    for r in range(0, rows, MAX_ROWS):
        m = min(MAX_ROWS, rows - r)
        lib.smallm_linear(x[r:r + m].data_ptr(), packed.data_ptr(), y[r:r + m].data_ptr(), m, width, k, threads)
    if width != n:  # the padding columns of the last block
        y = y[:, :n].contiguous()
    return y if bias is None else y + bias
