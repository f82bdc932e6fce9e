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
into accumulators held in registers, and y [M, BW] is stored once: no horizontal sums. (An fp8
block widened a k-row at once, on AVX-512 with VBMI, holds its columns interleaved: `e4m3_order`.) Blocks are
split over the OpenMP threads of torch's own libgomp (the .so links the runtime the process has
already loaded, so torch's thread count is the kernel's).
"""

from __future__ import annotations

import ctypes
import mmap

import torch

from engine.models import native

MAX_ROWS = 8  # rows per pass; more rows run in passes of 8 (the plan measures whether that pays)

# One block of BW output columns for M rows: y[m, :BW] = x[m] . wb, wb one packed block [K, BW]. Shared
# with the native decode step (engine.models.decode_step), which runs it inside its own parallel region.
BLOCK_SOURCE = r"""
#include <immintrin.h>
#include <omp.h>
#include <type_traits>
#include <vector>
#define BW (VW * NB)

/* Weight element types: fp32; bf16 (the top half of an fp32: widened by a shift); e4m3 (vLLM's fp8:
   at 8 lanes its bits moved into an fp32's (E4M3_BITS below), at 16 into fp16 bits the CPU widens, or
   through a byte permute; each exact, subnormals included, the exponent bias between the formats and
   the tensor's scale applied to y once). */
typedef unsigned short bf16_t;
typedef unsigned char e4m3_t;

/* The widenings need AVX2 at 8 lanes, AVX-512F at 16. A CPU without them still builds the fp32
   kernel; weight_formats() says which formats were built. */
#if VW == 16 || defined(__AVX2__)
#define HAS_BF16_W 1
#define HAS_E4M3_W 1
#endif
/* 8 lanes: an e4m3 byte's sign, exponent and mantissa moved into an fp32's sign, low exponent bits and
   top mantissa bits by integer operations (E4M3_BITS): the fp32 is the e4m3 value times 2^-120, an fp32
   subnormal where the e4m3 is one, so the activations are scaled by 2^E4M3_X first (exact: a power of
   two) and each product x w is the fp16 route's; y is scaled back once (wscale). */
#if VW == 8 && defined(HAS_E4M3_W)
#define E4M3_BITS 1
#define E4M3_X 96
#endif

/* bit f set: format f (0 fp32, 1 bf16, 2 e4m3) was built for this CPU */
extern "C" int weight_formats() {
  int f = 1;
#ifdef HAS_BF16_W
  f |= 2;
#endif
#ifdef HAS_E4M3_W
  f |= 4;
#endif
  return f;
}

/* Activations of a bf16 or e4m3 linear are rounded to bf16 (to nearest even, as torch's .bfloat16()),
   as in the served bf16 model; the torch forward rounds the same way (engine.models.kernels.linear).
   Where the CPU has bf16 dot products (AVX-512 BF16, blocks of 4 vectors) such a linear multiplies
   bf16 pairs with `vdpbf16ps`: its packed block holds k-pairs (BF16_DOT below); elsewhere the rounded
   activations meet weights widened to fp32 by FMAs (the products are exact either way). */
#if VW == 16 && NB == 4 && defined(__AVX512BF16__)
#define BF16_DOT 1
#endif
/* AVX-512 with VBMI, blocks of 4 vectors: e4m3 is widened by two byte permutes (vpermi2b: the 128
   magnitudes -> the low and the high byte of their bf16 bits), the sign ORed into the high byte and
   two byte unpacks into bf16 words: about half the integer operations per weight of the fp16 route
   below, which bound one core's decode at fp8 (docs/results.md). With bf16 dot products the words
   feed them as they are (E4M3_DOT: a block's k-pair interleaved in the order e4m3_pairs_order()
   states); without, a shift or a mask per vector makes fp32 lanes (E4M3_LUT: a k-row's columns
   interleaved as e4m3_interleaved() states; the values are the fp16 route's, 2^-8 times the e4m3
   value, exact, and the FMAs the same, so the results are bit-identical). */
#if VW == 16 && NB == 4 && defined(__AVX512VBMI__)
#ifdef BF16_DOT
#define E4M3_DOT 1
#else
#define E4M3_LUT 1
#endif
#endif

/* whether a linear of weight type W multiplies bf16 pairs (its block packed as k-pairs) */
template <typename W> struct Dot : std::false_type {};
#ifdef BF16_DOT
template <> struct Dot<bf16_t> : std::true_type {};
#endif
#ifdef E4M3_DOT
template <> struct Dot<e4m3_t> : std::true_type {};
#endif

/* 8 lanes: a bf16 block is packed in k-pairs too (layout 2: column c of k-rows 2p, 2p + 1 in one 32-bit
   lane, k-row 2p in the low half), though the products stay fp32 FMAs: one 32-byte load holds two k-rows
   of the block, and a shift (k-row 2p) and a mask (2p + 1) make their fp32 vectors. Widening a k-row
   alone took a zero-extension and a shift, each two operations at 256 bits where a vector is split in
   two halves (Zen 1, docs/results.md); now one shift and one AND per two k-rows. Each column still sums
   k in order, one FMA at a time: the results are the k-row kernel's, bit for bit (BF16_KROWS builds that
   kernel, for the test that checks it). */
#if VW == 8 && defined(HAS_BF16_W) && !defined(BF16_KROWS)
#define BF16_PAIRS 1
#endif

/* whether a block of W is packed in k-pairs (K padded to even with zeros) */
template <typename W> struct Paired : Dot<W> {};
#ifdef BF16_PAIRS
template <> struct Paired<bf16_t> : std::true_type {};
#endif

/* 8 lanes: an e4m3 block is packed in k-quads (layout 4: column c of k-rows 4q .. 4q + 3 in one 32-bit
   lane, k-row 4q + i in byte i). One 32-byte load holds four k-rows, and 16-bit shifts place two bytes of
   every lane at once (wquad8): 9 integer operations per 32 weights, where the k-row
   kernel took a sign extension, a shift and an AND per 8 (12): on Zen 1 the widening bounds an fp8 step
   (docs/results.md). The fp32 bits are E4M3_BITS's and each column still sums k in order, one FMA at a
   time: the results are the k-row kernel's, bit for bit (E4M3_KROWS builds that kernel, for the test). */
#if defined(E4M3_BITS) && !defined(E4M3_KROWS)
#define E4M3_QUADS 1
#endif

/* whether a block of W is packed in k-quads (K padded to a multiple of 4 with zeros) */
template <typename W> struct Quads : std::false_type {};
#ifdef E4M3_QUADS
template <> struct Quads<e4m3_t> : std::true_type {};
#endif

/* The k-layout of a packed block of format fmt (0 fp32, 1 bf16, 2 e4m3): 0 k-rows of the columns in
   order; 1 k-rows of an e4m3 block with column 16 j + d at byte 16 (d / 4) + 8 (j / 2) + 2 (d % 4) + j % 2
   (E4M3_LUT); 2 k-pairs (K padded to even): bf16 column c of k-rows 2p, 2p + 1 at words 2 c, 2 c + 1;
   3 k-pairs of e4m3: column 16 j + i of k-row 2p + e at byte 64 (j / 2) + 16 ((2i + e) / 8) + 8 (j % 2)
   + (2i + e) % 8 (E4M3_DOT); 4 k-quads of e4m3 (K padded to a multiple of 4): column c of k-rows 4q + i
   at byte 4 c + i (E4M3_QUADS). engine.models.smallm.pack lays blocks out so. */
extern "C" int weight_layout(int fmt) {
#ifdef E4M3_QUADS
  if (fmt == 2) return 4;
#endif
#if defined(BF16_DOT) || defined(BF16_PAIRS)
  if (fmt == 1) return 2;
#endif
#ifdef E4M3_DOT
  if (fmt == 2) return 3;
#endif
#ifdef E4M3_LUT
  if (fmt == 2) return 1;
#endif
  return 0;
}

/* the lanes of a vector and the vectors of a block this library was built for */
extern "C" int block_shape() { return VW * 100 + NB; }

/* elements between a packed block and the next, of K k-rows */
template <typename W>
static inline long block_elems(long K) {
  return (Quads<W>::value ? (K + 3) / 4 * 4 : Paired<W>::value ? (K + 1) / 2 * 2 : K) * BW;
}

/* fp32 -> bf16 bits, to nearest even (NaN: 0x7FC0), as torch; branch-free so the loops vectorise */
static inline bf16_t to_bf16(float f) {
  unsigned u = __builtin_bit_cast(unsigned, f);
  unsigned r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return (bf16_t)((u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : r);
}

/* The activations a linear of W weights reads, R rows of K at stride ldx: x itself for fp32 weights;
   else rounded to bf16, as pairs (k even in the low half; K odd: a zero pads) where the linear
   multiplies pairs, as fp32 values elsewhere, into buf (this thread's: no barrier). Its stride out. */
template <typename W>
static inline const void* activations(long R, const float* x, long ldx, long K, std::vector<float>& buf, long& ld) {
  if constexpr (std::is_same_v<W, float>) {
    ld = ldx;
    return x;
  } else if constexpr (Dot<W>::value) {
    ld = (K + 1) / 2;
    buf.resize(R * ld);
    bf16_t* p = (bf16_t*)buf.data();  /* little-endian: the pair's k even is its low half */
    for (long r = 0; r < R; ++r) {
      bf16_t* pr = p + r * 2 * ld;
      const float* xr = x + r * ldx;
      for (long k = 0; k < K; ++k) pr[k] = to_bf16(xr[k]);
      if (K % 2) pr[K] = 0;
    }
    return p;
  } else {
    ld = K;
    buf.resize(R * K);
#ifdef E4M3_BITS
    const float up = std::is_same_v<W, e4m3_t> ? __builtin_ldexpf(1.f, E4M3_X) : 1.f;
#else
    const float up = 1.f;
#endif
    for (long r = 0; r < R; ++r)
      for (long k = 0; k < K; ++k)
        buf[r * K + k] = __builtin_bit_cast(float, (unsigned)to_bf16(x[r * ldx + k]) << 16) * up;
    return buf.data();
  }
}

static inline vf wload(const float* p) { return *(const vfu*)p; }

#ifdef HAS_BF16_W
static inline vf wload(const bf16_t* p) {
#if VW == 16
  return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16);
#else
  return (vf)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16);
#endif
}
#endif

/* 1: a packed e4m3 block's k-row holds column 16 j + d at byte 16 (d / 4) + 8 (j / 2) + 2 (d % 4) + j % 2 */
extern "C" int e4m3_interleaved() {
#ifdef E4M3_LUT
  return 1;
#else
  return 0;
#endif
}

#ifdef E4M3_BITS
/* e4m3 byte b -> fp32 bits: sign-extended to 32 bits (fused with the load) and shifted left by 20, b's
   exponent and mantissa land in bits 26..20 and its sign in bit 31; the AND clears the sign's copies
   in bits 30..27: the fp16 route's integer work without its conversion (docs/results.md). The NaN
   bytes 0x7F / 0xFF (never written by the quantizer) read as +-480, as on the fp16 route. */
static inline vf wload(const e4m3_t* p) {
  __m256i s = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p));
  return (vf)_mm256_and_si256(_mm256_slli_epi32(s, 20), _mm256_set1_epi32((int)0x87F00000));
}
#elif defined(HAS_E4M3_W)
/* e4m3 byte b -> fp16 bits: sign-extended to 16 bits and shifted left by 7, b's exponent and mantissa
   land in fp16's bits 13..7 and its sign in bit 15; the AND clears the sign's copy in bit 14. Three
   integer operations per vector (measured faster than masking and shifting sign and magnitude apart,
   and than an AVX-512 VBMI byte permute). */
static inline vf wload(const e4m3_t* p) {
  __m256i h = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)p));
  return (vf)_mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(h, 7), _mm256_set1_epi16((short)0xBFFF)));
}
#endif

/* The vectors of a block a pass covers, by H: 0 all NB, 1 the first half, 2 the second (a linear whose
   blocks do not split evenly over the threads gives one thread's last block's halves to two threads:
   each column sums in the same order either way) */
template <int H> struct Part {
  static constexpr int J0 = H == 2 ? NB / 2 : 0, NJ = H == 0 ? NB : NB / 2;
};

/* vectors J0..J0+NJ of one k-row of a block, widened to fp32 */
template <int H, typename W>
static inline void wrow(const W* p, vf* w) {
  _Pragma("GCC unroll 4")
  for (int j = Part<H>::J0; j < Part<H>::J0 + Part<H>::NJ; ++j) w[j] = wload(p + j * VW);
}

#ifdef BF16_PAIRS
/* the two k-rows of a k-pair of a one-vector bf16 block (BF16_PAIRS) as fp32: w0 k-row 2p (the lanes'
   low halves moved up), w1 k-row 2p + 1 (the high halves, the low cleared) */
static inline void wpair8(const bf16_t* p, vf& w0, vf& w1) {
  const __m256i v = _mm256_loadu_si256((const __m256i*)p);
  w0 = (vf)_mm256_slli_epi32(v, 16);
  w1 = (vf)_mm256_and_si256(v, _mm256_set1_epi32((int)0xFFFF0000));
}
#endif

#ifdef E4M3_QUADS
/* the four k-rows of a k-quad of a one-vector e4m3 block (E4M3_QUADS) as E4M3_BITS's fp32 bits (the sign
   in bit 31, exponent and mantissa in 26..20): an arithmetic 16-bit shift by 4 moves bytes 3 and 1 of
   each lane there within their 16-bit halves (the sign's copies above, cleared by the AND), bytes 2 and
   0 after a 16-bit shift up by a byte; the low halves move up by a 32-bit shift. Zen 1 runs vector
   shifts on one of its four pipes, shuffles on two, integer multiplies on another, and a lone row (LONE), which
   widens the most per FMA, spreads its widening over them: bytes 2 and 0 by one vpmaddubsw (each 16-bit
   half: byte 0 as a signed byte times 16, byte 1 times 0, the same bits as the two shifts) and one of
   its two low halves up by a byte shuffle. A lone row measured faster so, two rows slower with the
   multiply or with both low halves shuffled (docs/results.md). */
template <bool LONE = false>
static inline void wquad8(const e4m3_t* p, vf* w) {
  const __m256i v = _mm256_loadu_si256((const __m256i*)p), bits = _mm256_set1_epi32((int)0x87F00000);
  const char z = (char)0x80;  /* a zero byte */
  const __m256i up = _mm256_setr_epi8(z, z, 0, 1, z, z, 4, 5, z, z, 8, 9, z, z, 12, 13,
                                      z, z, 0, 1, z, z, 4, 5, z, z, 8, 9, z, z, 12, 13);
  const __m256i odd = _mm256_srai_epi16(v, 4);
  const __m256i even = LONE ? _mm256_maddubs_epi16(_mm256_set1_epi16(16), v)
                            : _mm256_srai_epi16(_mm256_slli_epi16(v, 8), 4);
  w[0] = (vf)_mm256_and_si256(LONE ? _mm256_shuffle_epi8(even, up) : _mm256_slli_epi32(even, 16), bits);
  w[1] = (vf)_mm256_and_si256(_mm256_slli_epi32(odd, 16), bits);
  w[2] = (vf)_mm256_and_si256(even, bits);
  w[3] = (vf)_mm256_and_si256(odd, bits);
}
#endif

#if defined(E4M3_LUT) || defined(E4M3_DOT)
/* 2^-8 times the value of each e4m3 magnitude 0..127 (as the fp16 route), its bf16 bits' low and high bytes */
struct E4m3Lut {
  alignas(64) unsigned char lo[128], hi[128];
  E4m3Lut() {
    for (int c = 0; c < 128; ++c) {
      int e = c >> 3, m = c & 7;
      /* normal: (8 + m) 2^(e - 10); subnormal (e = 0): m 2^-9; then 2^-8 */
      float v = e ? __builtin_ldexpf((float)(8 + m), e - 18) : __builtin_ldexpf((float)m, -17);
      unsigned u = __builtin_bit_cast(unsigned, v) >> 16;
      lo[c] = (unsigned char)u;
      hi[c] = (unsigned char)(u >> 8);
    }
  }
};
static const E4m3Lut E4M3_TABLE;

/* the 64 e4m3 bytes at p as bf16 words: w0 from the low 8 bytes of each 128-bit lane, w1 the high */
static inline void e4m3_words(const e4m3_t* p, __m512i& w0, __m512i& w1) {
  const __m512i b = _mm512_loadu_si512(p);
  const __m512i lo = _mm512_permutex2var_epi8(_mm512_load_si512(E4M3_TABLE.lo), b, _mm512_load_si512(E4M3_TABLE.lo + 64));
  __m512i hi = _mm512_permutex2var_epi8(_mm512_load_si512(E4M3_TABLE.hi), b, _mm512_load_si512(E4M3_TABLE.hi + 64));
  hi = _mm512_ternarylogic_epi32(hi, b, _mm512_set1_epi8((char)0x80), 0xF8);  /* hi | (b & 0x80): the sign */
  w0 = _mm512_unpacklo_epi8(lo, hi);
  w1 = _mm512_unpackhi_epi8(lo, hi);
}
#endif

#ifdef E4M3_LUT
/* (a half reads the whole 64-byte k-row: its columns are interleaved over all of it) */
template <int H>
static inline void wrow(const e4m3_t* p, vf* w) {
  __m512i w0, w1;
  e4m3_words(p, w0, w1);
  const __m512i top = _mm512_set1_epi32((int)0xFFFF0000);
  if (H != 2) {
    w[0] = (vf)_mm512_slli_epi32(w0, 16);
    w[1] = (vf)_mm512_and_si512(w0, top);
  }
  if (H != 1) {
    w[2] = (vf)_mm512_slli_epi32(w1, 16);
    w[3] = (vf)_mm512_and_si512(w1, top);
  }
}
#endif

#ifdef BF16_DOT
/* vectors J0..J0+NJ of one k-pair of a block (layouts 2 and 3 of weight_layout) as bf16 pairs */
template <int H>
static inline void wpair(const bf16_t* p, __m512i* w) {
  _Pragma("GCC unroll 4")
  for (int j = Part<H>::J0; j < Part<H>::J0 + Part<H>::NJ; ++j) w[j] = _mm512_loadu_si512(p + j * 32);
}
#ifdef E4M3_DOT
template <int H>
static inline void wpair(const e4m3_t* p, __m512i* w) {
  if (H != 2) e4m3_words(p, w[0], w[1]);
  if (H != 1) e4m3_words(p + 64, w[2], w[3]);
}
#endif
#endif

/* what y is multiplied by for a tensor of per-tensor scale s */
static inline float wscale(const float*, float) { return 1.f; }
static inline float wscale(const bf16_t*, float) { return 1.f; }
#ifdef E4M3_BITS
static inline float wscale(const e4m3_t*, float s) { return s * __builtin_ldexpf(1.f, 120 - E4M3_X); }
#else
static inline float wscale(const e4m3_t*, float s) { return s * 256.f; }
#endif

/* bytes the prefetch runs ahead of the loads: 32 fp32 k-rows of a block */
#ifndef AHEAD
#define AHEAD (32 * BW * 4)
#endif

/* the 64-byte lines of a k-row (or k-pair) of `row` bytes that vectors J0..J0+NJ of H read, as
   offsets: [first, end) stepping 64 */
template <int H, int ROW>
struct Lines {
  static constexpr int first = Part<H>::J0 * ROW / NB / 64 * 64, end = (Part<H>::J0 + Part<H>::NJ) * ROW / NB;
};

/* c + a b rounded once (a fused multiply-add where the CPU has one), written out rather than left to
   the compiler's contraction: every row count's loop below then rounds each product-sum the same way */
static inline vf fmadd(vf a, vf b, vf c) {
#if VW == 16
  return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
  return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;  /* no FMA: never contracted, the same two roundings everywhere */
#endif
}

/* x in every lane */
static inline vf bcast(float x) {
#if VW == 16
  return (vf)_mm512_set1_ps(x);
#else
  return (vf)_mm256_set1_ps(x);
#endif
}

/* prefetch the k-row at p (of ROW bytes, vectors J0..J0+NJ of H) AHEAD bytes ahead: every 64-byte line
   of a k-row (a row of 64 floats is 4 lines; prefetching only 2 of them cost a third of the speed,
   docs/design.md), or the line a short k-row starts */
template <int H, int ROW>
static inline void ahead_row(const char* p, long k) {
  if (ROW >= 64) {
    _Pragma("GCC unroll 4")
    for (int off = Lines<H, ROW>::first; off < Lines<H, ROW>::end; off += 64) __builtin_prefetch(p + AHEAD + off);
  } else if ((k * ROW) % 64 == 0) {
    __builtin_prefetch(p + AHEAD);
  }
}

/* One block of BW output columns for M rows: y[m, :BW] = x[m] . wb (* the weight's scale), wb one
   packed block [K, BW] of weights of type W, x fp32 (rounded to bf16 for bf16 and e4m3 weights);
   of its vectors only those of H (Part). Each column of each row is one chain of fused multiply-adds
   over k in order, scaled at the end: the same operations at every row count and in block_one, so a
   row's result does not depend on the rows beside it (batch invariance; a verified chain's rows are
   its decode rows bit for bit). */
template <int M, int H, typename W>
static inline void block(const float* x, long ldx, const W* wb, float* y, long ldy, long K, float scale) {
  constexpr int ROW = BW * sizeof(W);  /* bytes of one k-row of the block */
  constexpr int J0 = Part<H>::J0, J1 = J0 + Part<H>::NJ;
  vf acc[NB][M];
  for (int j = J0; j < J1; ++j)
    for (int m = 0; m < M; ++m) acc[j][m] = (vf){};
  const char* wc = (const char*)wb;
#ifdef BF16_PAIRS
  if constexpr (Paired<W>::value) {  /* one-vector blocks in k-pairs: each column k after k as below */
    static_assert(NB == 1, "BF16_PAIRS packs one-vector blocks");
    for (long k = 0; k < K; k += 2) {
      ahead_row<H, ROW>(wc + k * ROW, k);
      vf w0, w1;
      wpair8(wb + k * BW, w0, w1);
      _Pragma("GCC unroll 8")
      for (int m = 0; m < M; ++m) {
        acc[0][m] = fmadd(bcast(x[m * ldx + k]), w0, acc[0][m]);
        if (k + 1 < K) acc[0][m] = fmadd(bcast(x[m * ldx + k + 1]), w1, acc[0][m]);  /* K odd: the pad is left out */
      }
    }
  } else
#endif
#ifdef E4M3_QUADS
  if constexpr (Quads<W>::value) {  /* one-vector blocks in k-quads: each column k after k, the pad left out */
    static_assert(NB == 1, "E4M3_QUADS packs one-vector blocks");
    for (long k = 0; k < K; k += 4) {
      ahead_row<H, ROW>(wc + k * ROW, k);
      vf w[4];
      wquad8(wb + k * BW, w);
      for (int e = 0; e < 4 && k + e < K; ++e)
        _Pragma("GCC unroll 8")
        for (int m = 0; m < M; ++m) acc[0][m] = fmadd(bcast(x[m * ldx + k + e]), w[e], acc[0][m]);
    }
  } else
#endif
  for (long k = 0; k < K; ++k) {
    ahead_row<H, ROW>(wc + k * ROW, k);
    vf w[NB];
    wrow<H>(wb + k * BW, w);
    _Pragma("GCC unroll 8")
    for (int m = 0; m < M; ++m) {
      const vf xs = bcast(x[m * ldx + k]);
      _Pragma("GCC unroll 4")
      for (int j = J0; j < J1; ++j) acc[j][m] = fmadd(xs, w[j], acc[j][m]);
    }
  }
  float f = wscale(wb, scale);
  for (int j = J0; j < J1; ++j)
    for (int m = 0; m < M; ++m) *(vfu*)(y + m * ldy + j * VW) = acc[j][m] * f;  /* exact where f is 1 */
}

/* whole blocks a lone row runs side by side in block_g (AVX2: 4 one-vector blocks, as fast as 8 in
   cache and faster streamed, docs/results.md; AVX-512: 2 four-vector blocks, the 8 chains a lone row
   kept before) */
#ifndef ONE_ROW_BLOCKS
#define ONE_ROW_BLOCKS (NB == 1 ? 4 : 2)
#endif

/* whole blocks M rows run side by side in block_g: enough chains (M G NB) to hide the FMA latency
   behind two FMAs a cycle, their accumulators and the G blocks' weights in the 16 (AVX2) or 32
   (AVX-512) vector registers. On AVX2 M rows of one one-vector block kept only M chains: 2-5 rows a
   step waited on the latency (docs/results.md). */
template <int M, typename W = float>
struct Group {
  static constexpr int G = M == 1 ? ONE_ROW_BLOCKS : NB > 1 ? 1 : M <= 2 ? 4 : M == 3 ? 3 : M <= 6 ? 2 : 1;
};
/* k-quads widen four vectors a block at once, so as many blocks side by side as above spill registers:
   at 2-6 rows these smaller counts measured faster (docs/results.md). QUAD_G(M) overrides them for a
   measurement. */
#ifdef E4M3_QUADS
#ifndef QUAD_G
#define QUAD_G(M) (M == 1 ? ONE_ROW_BLOCKS : M == 2 ? 2 : 1)
#endif
template <int M>
struct Group<M, e4m3_t> {
  static constexpr int G = QUAD_G(M);
};
#endif

/* M rows over G whole blocks side by side (wb, wb + stride, ...; y, y + BW, ...), each column of each
   row summed exactly as block<M, 0> sums it: the blocks' chains are independent columns (a row split
   into chains of alternate k-rows would sum in another order than the rows of a chain). */
template <int M, int G, typename W>
static inline void block_g(const float* x, long ldx, const W* wb, long stride, float* y, long ldy, long K,
                           float scale) {
  constexpr int ROW = BW * sizeof(W);
  vf acc[G][NB][M];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < NB; ++j)
      for (int m = 0; m < M; ++m) acc[g][j][m] = (vf){};
  auto step = [&](long k) __attribute__((always_inline)) {
    vf w[G][NB];
    _Pragma("GCC unroll 8")
    for (int g = 0; g < G; ++g) wrow<0>(wb + g * stride + k * BW, w[g]);
    _Pragma("GCC unroll 8")
    for (int m = 0; m < M; ++m) {
      const vf xs = bcast(x[m * ldx + k]);
      _Pragma("GCC unroll 8")
      for (int g = 0; g < G; ++g)
        _Pragma("GCC unroll 4")
        for (int j = 0; j < NB; ++j) acc[g][j][m] = fmadd(xs, w[g][j], acc[g][j][m]);
    }
  };
#ifdef BF16_PAIRS
  /* a k-pair of one-vector blocks (BF16_PAIRS): both k-rows' weights of the G blocks, then k-row 2p's
     products, then 2p + 1's (`two` false: K odd, only 2p, the pad left out) */
  auto pair = [&](long k, bool two) __attribute__((always_inline)) {
    vf w[G][2];
    _Pragma("GCC unroll 8")
    for (int g = 0; g < G; ++g) wpair8((const bf16_t*)(wb + g * stride + k * BW), w[g][0], w[g][1]);
    _Pragma("GCC unroll 2")
    for (int e = 0; e < 1 + two; ++e)
      _Pragma("GCC unroll 8")
      for (int m = 0; m < M; ++m) {
        const vf xs = bcast(x[m * ldx + k + e]);
        _Pragma("GCC unroll 8")
        for (int g = 0; g < G; ++g) acc[g][0][m] = fmadd(xs, w[g][e], acc[g][0][m]);
      }
  };
#endif
#ifdef E4M3_QUADS
  /* a k-quad of one-vector blocks (E4M3_QUADS), block by block: its four k-rows' products in order
     (`n` < 4: K's last k-rows, the pad left out) */
  auto quad = [&](long k, int n) __attribute__((always_inline)) {
    _Pragma("GCC unroll 8")
    for (int g = 0; g < G; ++g) {
      vf w[4];
      wquad8<M == 1>((const e4m3_t*)(wb + g * stride + k * BW), w);
      _Pragma("GCC unroll 4")
      for (int e = 0; e < n; ++e)
        _Pragma("GCC unroll 8")
        for (int m = 0; m < M; ++m) acc[g][0][m] = fmadd(bcast(x[m * ldx + k + e]), w[e], acc[g][0][m]);
    }
  };
#endif
  /* k-rows shorter than a line in runs of one line's worth, unrolled: the prefetches (one a line, as
     ahead_row) and the loop's own work once a line, not at every k-row */
  constexpr int U = ROW >= 64 ? 1 : 64 / ROW;
  long k = 0;
  for (; k + U <= K; k += U) {
    /* near the end of its block a block's prefetch moves on to the block read G blocks later (the next
       group's, where the thread has one), not to the next block here, which another chain is reading:
       each group then starts with its blocks' first lines on the way, not only its first block's (at
       fp8 the streamed read per core was well below the in-cache rate without it, docs/results.md) */
    const long jump = k * ROW + AHEAD >= stride * (long)sizeof(W) ? (G - 1) * stride : 0;
    _Pragma("GCC unroll 8")
    for (int g = 0; g < G; ++g) ahead_row<0, ROW>((const char*)(wb + g * stride + jump + k * BW), 0);
#ifdef BF16_PAIRS
    if constexpr (Paired<W>::value) {
      static_assert(U % 2 == 0, "a line holds whole k-pairs");
      _Pragma("GCC unroll 8")
      for (int u = 0; u < U; u += 2) pair(k + u, true);
      continue;
    }
#endif
#ifdef E4M3_QUADS
    if constexpr (Quads<W>::value) {
      static_assert(U % 4 == 0, "a line holds whole k-quads");
      _Pragma("GCC unroll 8")
      for (int u = 0; u < U; u += 4) quad(k + u, 4);
      continue;
    }
#endif
    _Pragma("GCC unroll 8")
    for (int u = 0; u < U; ++u) step(k + u);
  }
#ifdef BF16_PAIRS
  if constexpr (Paired<W>::value) {
    for (; k < K; k += 2) pair(k, k + 1 < K);
  } else
#endif
#ifdef E4M3_QUADS
  if constexpr (Quads<W>::value) {
    for (; k < K; k += 4) quad(k, K - k < 4 ? (int)(K - k) : 4);
  } else
#endif
  for (; k < K; ++k) step(k);
  float f = wscale(wb, scale);
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < NB; ++j)
      for (int m = 0; m < M; ++m) *(vfu*)(y + m * ldy + g * BW + j * VW) = acc[g][j][m] * f;
}

/* block_g over n consecutive whole blocks: G at a time, then the rest side by side */
template <int M, int G, typename W>
static inline void blocks_g(long n, const float* x, long ldx, const W* wb, long stride, float* y, long ldy, long K,
                            float scale) {
  if constexpr (G > 0) {
    for (; n >= G; n -= G, wb += G * stride, y += G * BW) block_g<M, G>(x, ldx, wb, stride, y, ldy, K, scale);
    if (n) blocks_g<M, G - 1>(n, x, ldx, wb, stride, y, ldy, K, scale);
  }
}

/* blocks_g for a row count m known at run time (1-8) */
template <typename W>
static inline void blocks_m(long m, long n, const float* x, long ldx, const W* wb, long stride, float* y, long ldy,
                            long K, float scale) {
  switch (m) {
    case 1: blocks_g<1, Group<1, W>::G>(n, x, ldx, wb, stride, y, ldy, K, scale); break;
    case 2: blocks_g<2, Group<2, W>::G>(n, x, ldx, wb, stride, y, ldy, K, scale); break;
    case 3: blocks_g<3, Group<3, W>::G>(n, x, ldx, wb, stride, y, ldy, K, scale); break;
    case 4: blocks_g<4, Group<4, W>::G>(n, x, ldx, wb, stride, y, ldy, K, scale); break;
    case 5: blocks_g<5, Group<5, W>::G>(n, x, ldx, wb, stride, y, ldy, K, scale); break;
    case 6: blocks_g<6, Group<6, W>::G>(n, x, ldx, wb, stride, y, ldy, K, scale); break;
    case 7: blocks_g<7, Group<7, W>::G>(n, x, ldx, wb, stride, y, ldy, K, scale); break;
    default: blocks_g<8, Group<8, W>::G>(n, x, ldx, wb, stride, y, ldy, K, scale); break;
  }
}

/* A whole packed block of W (any layout but the dot products') widened into fp32 k-rows [K, BW] at out:
   the values block() and block_g() multiply, so an fp32 pass over out sums exactly as a pass over the
   packed block does (the weight's scale is still to apply: wscale). */
template <typename W>
static inline void widen_block(const W* wb, float* out, long K) {
#ifdef BF16_PAIRS
  if constexpr (Paired<W>::value) {
    for (long k = 0; k < K; k += 2) {
      vf w0, w1;
      wpair8((const bf16_t*)(wb + k * BW), w0, w1);
      *(vfu*)(out + k * BW) = w0;
      if (k + 1 < K) *(vfu*)(out + (k + 1) * BW) = w1;
    }
    return;
  }
#endif
#ifdef E4M3_QUADS
  if constexpr (Quads<W>::value) {
    for (long k = 0; k < K; k += 4) {
      vf w[4];
      wquad8((const e4m3_t*)(wb + k * BW), w);
      for (int e = 0; e < 4 && k + e < K; ++e) *(vfu*)(out + (k + e) * BW) = w[e];
    }
    return;
  }
#endif
  if constexpr (!Paired<W>::value && !Quads<W>::value)
    for (long k = 0; k < K; ++k) {
      vf w[NB];
      wrow<0>(wb + k * BW, w);
      for (int j = 0; j < NB; ++j) *(vfu*)(out + k * BW + j * VW) = w[j];
    }
}

#ifdef BF16_DOT
/* block() for a linear that multiplies bf16 pairs: xp [M, ldp] the activations' pairs, wb the block's
   (K + 1) / 2 k-pairs. One vdpbf16ps per 32 products (two k-rows of 16 columns). Every row count sums
   in the same order (one chain per vector, k-pairs in order; 4 chains keep one row's step near the
   read bandwidth): a row's result does not depend on the rows beside it (batch invariance, which
   block() gives past one row only). */
template <int M, int H, typename W>
static inline void block_dot(const unsigned* xp, long ldp, const W* wb, float* y, long ldy, long K, float scale) {
  constexpr int PAIR = 2 * BW * sizeof(W);  /* bytes of one k-pair of the block */
  constexpr int J0 = Part<H>::J0, J1 = J0 + Part<H>::NJ;
  const long P = (K + 1) / 2;
  __m512 acc[NB][M];
  for (int j = J0; j < J1; ++j)
    for (int m = 0; m < M; ++m) acc[j][m] = _mm512_setzero_ps();
  const char* wc = (const char*)wb;
  for (long p = 0; p < P; ++p) {
    const char* ahead = wc + p * PAIR + AHEAD;
    _Pragma("GCC unroll 4")
    for (int off = Lines<H, PAIR>::first; off < Lines<H, PAIR>::end; off += 64) __builtin_prefetch(ahead + off);
    __m512i w[NB];
    wpair<H>(wb + p * 2 * BW, w);
    _Pragma("GCC unroll 8")
    for (int m = 0; m < M; ++m) {
      const __m512bh xs = (__m512bh)_mm512_set1_epi32((int)xp[m * ldp + p]);
      _Pragma("GCC unroll 4")
      for (int j = J0; j < J1; ++j) acc[j][m] = _mm512_dpbf16_ps(acc[j][m], (__m512bh)w[j], xs);
    }
  }
  const __m512 f = _mm512_set1_ps(wscale(wb, scale));
  for (int j = J0; j < J1; ++j)
    for (int m = 0; m < M; ++m) _mm512_storeu_ps(y + m * ldy + j * VW, _mm512_mul_ps(acc[j][m], f));
}
#endif

template <int M, int H, typename W>
static inline void block_any(const void* x, long ldx, const W* wb, float* y, long ldy, long K, float scale) {
#ifdef BF16_DOT
  if constexpr (Dot<W>::value) {
    block_dot<M, H>((const unsigned*)x, ldx, wb, y, ldy, K, scale);
    return;
  }
#endif
  if constexpr (!Dot<W>::value) block<M, H>((const float*)x, ldx, wb, y, ldy, K, scale);
}

/* block<M, H> for a row count m known at run time (1-8), x as `activations` gave it (row r at x + r * ldx
   of its element type) */
template <int H, typename W>
static inline void block_mh(long m, const void* x, long ldx, const W* wb, float* y, long ldy, long K, float scale) {
  switch (m) {
    case 1: block_any<1, H>(x, ldx, wb, y, ldy, K, scale); break;
    case 2: block_any<2, H>(x, ldx, wb, y, ldy, K, scale); break;
    case 3: block_any<3, H>(x, ldx, wb, y, ldy, K, scale); break;
    case 4: block_any<4, H>(x, ldx, wb, y, ldy, K, scale); break;
    case 5: block_any<5, H>(x, ldx, wb, y, ldy, K, scale); break;
    case 6: block_any<6, H>(x, ldx, wb, y, ldy, K, scale); break;
    case 7: block_any<7, H>(x, ldx, wb, y, ldy, K, scale); break;
    default: block_any<8, H>(x, ldx, wb, y, ldy, K, scale); break;
  }
}

/* a whole block (every vector) for m rows */
template <typename W>
static inline void block_m(long m, const void* x, long ldx, const W* wb, float* y, long ldy, long K, float scale) {
  block_mh<0>(m, x, ldx, wb, y, ldy, K, scale);
}

/* x's row r, x as `activations` gave it for W */
template <typename W>
static inline const void* act_row(const void* x, long ld, long r) {
  return (const char*)x + r * ld * (Dot<W>::value ? sizeof(unsigned) : sizeof(float));
}

#ifdef E4M3_BITS
/* Denormals read as themselves on this thread while it lives (MXCSR's DAZ bit cleared, then restored):
   E4M3_BITS's weights of e4m3 subnormals are fp32 subnormals, which DAZ (torch.set_flush_denormal) would
   read as zero. FTZ is left alone: the products and sums stay normal. */
struct Denormals {
  unsigned csr;
  explicit Denormals(bool on) : csr(on ? _mm_getcsr() : 0) {
    if (csr & 0x40) _mm_setcsr(csr & ~0x40u);
  }
  ~Denormals() {
    if (csr & 0x40) _mm_setcsr(csr);
  }
};
#endif

/* y[r, b BW ..] = x[r] . block b for blocks run0 .. run0 + run - 1 (whole ones), R rows in passes of `per`. */
template <typename W>
static inline void whole_blocks(long R, long per, const void* xa, long ld, const W* wp, float* y, long ldy, long run0,
                                long run, long K, float scale) {
  /* the gathered blocks CHUNK at a time, every pass of rows over a chunk before the next: a pass after
     the first reads the chunk from the core's cache, not from memory (12: whole groups of 4, 3 and 2).
     bf16 and e4m3 chunks that more than one pass reads are widened into fp32 once (this thread's
     buffer), and every pass multiplies the fp32 values, as fp32 weights do: widening each weight once a
     pass made a prompt's forward measurably slower (docs/results.md). Each column sums as over the
     packed chunk, and y gets the weight's scale once as before: the same results. */
  constexpr long CHUNK = 12;
  const long elems = block_elems<W>(K);
  if constexpr (Dot<W>::value) {
    for (long b = run0; b < run0 + run; ++b)
      for (long r0 = 0; r0 < R; r0 += per)
        block_m(R - r0 < per ? R - r0 : per, act_row<W>(xa, ld, r0), ld, wp + b * block_elems<W>(K),
                y + r0 * ldy + b * BW, ldy, K, scale);
  } else {
    for (long c = 0; c < run; c += CHUNK) {
#ifndef WIDEN_PER_PASS
      if constexpr (!std::is_same_v<W, float>) {
        if (R > per) {
          const long n = run - c < CHUNK ? run - c : CHUNK;
          static thread_local std::vector<float> wide;
          wide.resize(n * K * BW);
          for (long b = 0; b < n; ++b) widen_block(wp + (run0 + c + b) * elems, wide.data() + b * K * BW, K);
          for (long r0 = 0; r0 < R; r0 += per)
            blocks_m(R - r0 < per ? R - r0 : per, n, (const float*)act_row<W>(xa, ld, r0), ld, wide.data(), K * BW,
                     y + r0 * ldy + (run0 + c) * BW, ldy, K, 1.f);
          const float f = wscale(wp, scale);
          if (f != 1.f)
            for (long r = 0; r < R; ++r)
              for (float *yr = y + r * ldy + (run0 + c) * BW, *end = yr + n * BW; yr < end; yr += VW)
                *(vfu*)yr = *(const vfu*)yr * f;
          continue;
        }
      }
#endif
      for (long r0 = 0; r0 < R; r0 += per) {
        long m = R - r0 < per ? R - r0 : per, n = run - c < CHUNK ? run - c : CHUNK;
        blocks_m(m, n, (const float*)act_row<W>(xa, ld, r0), ld, wp + (run0 + c) * elems, elems,
                 y + r0 * ldy + (run0 + c) * BW, ldy, K, scale);
      }
    }
  }
}

/* This thread's share of y[r, b BW ..] = x[r] . block b for R rows (in passes of `per` rows, at most 8)
   over the `blocks` packed blocks of wp, x as `activations` gave it. The team splits the first blocks
   by bytes, and where they do not divide evenly the block at a boundary between two threads goes half
   to each (Part; 9 blocks of 64 columns over 2 threads were 5 and 4, one thread idle for a ninth of
   the read). The last blocks / TAIL_SHARE go a piece at a time to whichever thread asks first,
   from the team's counter `next` (zero before the call, one counter per call): a thread whose core
   streams slower (one shared with other work) then leaves the faster ones less to wait for at the
   barrier. Every column sums in the same order whoever computes it. No barrier. */
#ifndef TAIL_SHARE
#define TAIL_SHARE 8  /* the tail is blocks / TAIL_SHARE; 0: no tail */
#endif
template <typename W>
static inline void blocks_share(long R, long per, const void* xa, long ld, const W* wp, float* y, long ldy, long blocks,
                                long K, float scale, long* next) {
#ifdef E4M3_BITS
  Denormals keep(std::is_same_v<W, e4m3_t>);
#endif
  constexpr long HALVES = NB % 2 == 0 ? 2 : 1;  /* the units a block splits into */
  long T = omp_get_num_threads(), t = omp_get_thread_num();
#if TAIL_SHARE
  const long tail = T > 1 ? blocks / TAIL_SHARE : 0;
#else
  const long tail = 0;
#endif
  const long units = (blocks - tail) * HALVES;
  long run0 = 0, run = 0;  /* whole blocks not yet computed: run0 .. run0 + run - 1 */
  for (long u = units * t / T, end = units * (t + 1) / T; u < end;) {
    long b = u / HALVES;
    int h = HALVES == 1 || (u % 2 == 0 && u + 1 < end) ? 0 : 1 + (int)(u % 2);  /* whole, first or second half */
    u += h ? 1 : HALVES;
    if constexpr (!Dot<W>::value) {
      if (h == 0) {  /* gathered (consecutive: a thread's whole blocks are), then side by side */
        if (run == 0) run0 = b;
        ++run;
        continue;
      }
    }
    const W* wb = wp + b * block_elems<W>(K);
    for (long r0 = 0; r0 < R; r0 += per) {
      long m = R - r0 < per ? R - r0 : per;
      const void* xr = act_row<W>(xa, ld, r0);
      float* yr = y + r0 * ldy + b * BW;
      if constexpr (HALVES == 2) {
        if (h == 1) { block_mh<1>(m, xr, ld, wb, yr, ldy, K, scale); continue; }
        if (h == 2) { block_mh<2>(m, xr, ld, wb, yr, ldy, K, scale); continue; }
      }
      block_m(m, xr, ld, wb, yr, ldy, K, scale);
    }
  }
  whole_blocks(R, per, xa, ld, wp, y, ldy, run0, run, K, scale);
  /* the tail, a piece at a time (a few pieces a thread: each is one atomic add on a line the team shares) */
  const long piece = tail / (4 * T) > 1 ? tail / (4 * T) : 1;
  for (long b; tail && (b = blocks - tail + __atomic_fetch_add(next, piece, __ATOMIC_RELAXED)) < blocks;)
    whole_blocks(R, per, xa, ld, wp, y, ldy, b, blocks - b < piece ? blocks - b : piece, K, scale);
}
"""

_SOURCE = native.VECTORS + BLOCK_SOURCE + r"""
template <typename W>
static void run(const float* x, const W* wp, float* y, long M, long N, long K, float scale, int threads) {
  long next = 0;  /* blocks_share's tail counter */
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> buf;
    long ld;
    const void* xa = activations<W>(M, x, K, K, buf, ld);
    blocks_share(M, M, xa, ld, wp, y, N, N / BW, K, scale, &next);
  }
}

/* fmt: 0 fp32, 1 bf16, 2 e4m3 with per-tensor scale */
extern "C" int smallm_linear(const float* x, const void* wp, float* y, long M, long N, long K, int fmt, float scale,
                             int threads) {
  if (M < 1 || M > 8) return 1;
  switch (fmt) {
    case 0: run(x, (const float*)wp, y, M, N, K, scale, threads); return 0;
#ifdef HAS_BF16_W
    case 1: run(x, (const bf16_t*)wp, y, M, N, K, scale, threads); return 0;
#endif
#ifdef HAS_E4M3_W
    case 2: run(x, (const e4m3_t*)wp, y, M, N, K, scale, threads); return 0;
#endif
  }
  return 2;
}
"""


# AVX-512: 16 lanes, 4 vectors of columns per block (32 accumulators at 8 rows fill the 32 registers);
# AVX2: 8 lanes, one vector (its 16 registers hold 8 accumulators, the weights and a broadcast)
VW, NB = (16, 4) if native.avx512() else (8, 1)
BW = VW * NB


def _bind(lib: ctypes.CDLL) -> None:
    lib.smallm_linear.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3 + [ctypes.c_int, ctypes.c_float,
                                                                               ctypes.c_int]
    lib.smallm_linear.restype = ctypes.c_int
    lib.weight_formats.restype = ctypes.c_int
    lib.e4m3_interleaved.restype = ctypes.c_int
    lib.weight_layout.argtypes = [ctypes.c_int]
    lib.weight_layout.restype = ctypes.c_int
    lib.block_shape.restype = ctypes.c_int


_NATIVE = native.Native("smallm", _SOURCE, [f"-DVW={VW}", f"-DNB={NB}"], _bind)
TAG = _NATIVE.tag


def library() -> ctypes.CDLL | None:
    """The built kernel, or None when this machine cannot build it (no g++, a failed compile: `error()` says why)."""
    return _NATIVE.library()


def _built() -> ctypes.CDLL:
    lib = _NATIVE.library()
    if lib is None:
        raise RuntimeError(f"smallm kernel unavailable: {_NATIVE.error}")
    return lib


def error() -> str | None:
    """Why the kernel could not be built (None when it was, or was not tried yet)."""
    return _NATIVE.error


def built_formats(lib: ctypes.CDLL) -> set[str]:
    """The weight formats (engine.builtin.weights) a library built from BLOCK_SOURCE reads on this CPU."""
    bits = lib.weight_formats()
    return {name for i, name in enumerate(("fp32", "bf16", "fp8")) if bits >> i & 1}


# packed weight dtype -> the kernel's `fmt`
FORMATS = {torch.float32: 0, torch.bfloat16: 1, torch.float8_e4m3fn: 2}
# engine.builtin.weights -> the packed weight dtype
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


def e4m3_order(lib: ctypes.CDLL) -> torch.Tensor | None:
    """Which of a block's columns each byte of a packed e4m3 k-row holds where `lib` (built from
    BLOCK_SOURCE) widens a whole k-row at once into fp32 (AVX-512 VBMI without bf16 dot products:
    E4M3_LUT), else None. Column 16 j + d of the block sits at byte 16 (d // 4) + 8 (j // 2) + 2 (d % 4)
    + j % 2: the order in which the byte unpacks and the shift / mask into fp32 lanes hand them to
    vector j."""
    if not lib.e4m3_interleaved():
        return None
    order = torch.empty(64, dtype=torch.long)
    for j in range(4):
        for d in range(16):
            order[16 * (d // 4) + 8 * (j // 2) + 2 * (d % 4) + j % 2] = 16 * j + d
    return order


def pair_order(fmt: str, vw: int = 16, nb: int = 4) -> torch.Tensor:
    """Where a block packed in k-pairs (a kernel with bf16 dot products: `layout` 2 and 3) keeps each
    value of a pair of k-rows: position q of the pair's 2 BW values holds value e BW + c of the two
    rows [2, BW] (row e, column c). bf16: c's two values side by side (words 2c, 2c + 1), one 32-bit
    lane of a `vdpbf16ps` operand. fp8: column 16 j + i of row e at byte 64 (j // 2) + 16 ((2i + e) // 8)
    + 8 (j % 2) + (2i + e) % 8, the order in which the table lookups' byte unpacks hand vector j its
    bf16 pairs. (Built where the vectors have 16 lanes, 4 a block: `vw`, `nb`.)"""
    bw = vw * nb
    order = torch.empty(2 * bw, dtype=torch.long)
    for j in range(nb):
        for i in range(vw):
            for e in range(2):
                w = 2 * i + e
                q = w + 2 * vw * j if fmt == "bf16" else 64 * (j // 2) + 16 * (w // 8) + 8 * (j % 2) + w % 8
                order[q] = e * bw + vw * j + i
    return order


def quad_order(bw: int) -> torch.Tensor:
    """Where a block packed in k-quads (layout 4: fp8 at 8 lanes) keeps each value of four k-rows: position
    q = 4 c + i of the quad's 4 BW bytes holds value i BW + c of the four rows [4, BW] (row i, column c):
    column c's four k-rows in one 32-bit lane, k-row i in its byte i."""
    return torch.arange(4 * bw).view(4, bw).t().reshape(-1)


def layout(lib: ctypes.CDLL, weights: str) -> int:
    """How `lib` reads a packed block of `weights` (BLOCK_SOURCE's weight_layout): 0 k-rows of the columns
    in order, 1 k-rows in `e4m3_order`, 2 and 3 k-pairs in `pair_order` (bf16, fp8), 4 k-quads in
    `quad_order` (fp8)."""
    return lib.weight_layout(FORMATS[DTYPES[weights]])


def k_group(how: int) -> int:
    """The k-rows a block of `layout` `how` interleaves (K is padded to a multiple of it)."""
    return 4 if how == 4 else 2 if how >= 2 else 1


HUGE_PAGE = 2 << 20


def on_huge_pages(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors' values, in order, in one buffer the kernel is asked to back with 2 MB pages
    (transparent huge pages, madvise), each at a 4 KB boundary, where together they span at least one
    such page and the platform offers it; else the tensors. A decode step streams every packed weight
    once: on 4 KB pages that is a TLB miss every 4 KB of the read, on 2 MB pages one every 2 MB. One
    buffer for all of a model's weights, not one each: a weight under 2 MB (most decoder weights of a
    small model at bf16 or fp8) has no whole page of its own, so it stayed on 4 KB pages. Where the
    kernel keeps THP off the advice is ignored and the pages stay 4 KB (the values are the same)."""
    sizes = [t.numel() * t.element_size() for t in ts]
    starts = [sum(-(-n // 4096) * 4096 for n in sizes[:i]) for i in range(len(sizes))]
    total = starts[-1] + sizes[-1] if ts else 0
    if total < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return ts
    # private anonymous memory (Python's default for -1 is shared, shmem, which THP's madvise mode leaves
    # on 4 KB pages), aligned to 2 MB; kept alive by the views below
    buf = mmap.mmap(-1, total + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    off = -ctypes.addressof(ctypes.c_char.from_buffer(buf)) % HUGE_PAGE
    buf.madvise(mmap.MADV_HUGEPAGE, off, total - total % mmap.PAGESIZE)
    whole = torch.frombuffer(buf, dtype=torch.uint8, count=total, offset=off)
    out = []
    for t, at, n in zip(ts, starts, sizes):
        part = whole[at:at + n]
        part.copy_(t.reshape(-1).view(torch.uint8))
        out.append(part.view(t.dtype).view(t.shape))
    return out


def pack(w: torch.Tensor, weights: str = "fp32", lib: ctypes.CDLL | None = None,
         huge: bool = True) -> tuple[torch.Tensor, float]:
    """w [N, K] fp32 as [ceil(N / BW), K, BW] in the `weights` format (fp32 | bf16 | fp8): each block
    of BW output columns contiguous, k-major; and the scale the kernel multiplies y by (fp8: vLLM's
    per-tensor scale, engine.models.fp8; else 1). w must hold values of that format already (the
    engine rounds its weights once when it loads them), so the copy is exact. The block's layout is
    the one `lib`, the kernel that reads it (default: this process's), states (`layout`): in k-pairs
    (K padded to even with zeros) where it multiplies bf16 pairs or widens two bf16 k-rows from one load,
    in k-quads (K padded to a multiple of 4) where it widens four e4m3 k-rows from one load. `huge`: the
    copy on 2 MB pages of its own (`on_huge_pages`; False where the caller places several together)."""
    lib = lib or _built()
    vw, nb = divmod(lib.block_shape(), 100)
    bw = vw * nb
    n, k = w.shape
    scale = 1.0
    if weights == "fp8":
        from engine.models.fp8 import quantize_e4m3

        w8, s = quantize_e4m3(w)
        stored, scale = w8.view(torch.uint8), float(s)  # copies of float8 tensors go through their bytes
    else:
        stored = w.detach().to(DTYPES[weights])
    how = layout(lib, weights)
    kp = k + -k % k_group(how)
    stored = torch.nn.functional.pad(stored.view(torch.int16) if weights == "bf16" else stored,
                                     (0, kp - k, 0, -n % bw))
    packed = stored.reshape(-1, bw, kp).transpose(1, 2)  # [blocks, K, BW]
    if how == 1:
        packed = packed[:, :, e4m3_order(lib)]
    elif how == 4:
        packed = packed.reshape(-1, kp // 4, 4 * bw)[:, :, quad_order(bw)].reshape(-1, kp, bw)
    elif how >= 2:
        packed = packed.reshape(-1, kp // 2, 2 * bw)[:, :, pair_order(weights, vw, nb)].reshape(-1, kp, bw)
    packed = packed.contiguous()
    if huge:
        packed = on_huge_pages([packed])[0]
    return packed.view(DTYPES[weights]), scale


def unpack(packed: torch.Tensor, scale: float, n: int, k: int | None = None,
           lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """The fp32 weight [n, k] (k: default the packed K, padding included) a `pack`ed copy for `lib`
    (default: this process's kernel) holds: what the kernel multiplies with."""
    lib = lib or _built()
    vw, nb = divmod(lib.block_shape(), 100)
    weights = {v: name for name, v in DTYPES.items()}[packed.dtype]
    how = layout(lib, weights)
    blocks, kp, bw = packed.shape
    raw = packed.view(torch.uint8) if weights == "fp8" else packed.view(torch.int16) if weights == "bf16" else packed
    if how == 1:
        raw = raw[:, :, torch.argsort(e4m3_order(lib))]
    elif how == 4:
        raw = raw.reshape(blocks, kp // 4, 4 * bw)[:, :, torch.argsort(quad_order(bw))].reshape(blocks, kp, bw)
    elif how >= 2:
        raw = raw.reshape(blocks, kp // 2, 2 * bw)[:, :, torch.argsort(pair_order(weights, vw, nb))].reshape(blocks, kp, bw)
    w = raw.contiguous().view(packed.dtype).float().transpose(1, 2).reshape(-1, kp)[:n, :k]
    return w * scale if weights == "fp8" else w


def linear(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None,
           scale: float = 1.0) -> torch.Tensor:
    """x [M, K] @ w.T (+ bias) for the weight `pack`ed into `packed` (n its output width, scale its
    `pack` scale), in passes of at most MAX_ROWS rows; at bf16 and fp8 x is rounded to bf16 first (in the
    kernel). Needs `library()`."""
    lib = _built()
    x = x.contiguous()
    rows, k = x.shape
    width = packed.shape[0] * BW
    y = x.new_empty(rows, width)
    threads = torch.get_num_threads()
    fmt = FORMATS[packed.dtype]
    for r in range(0, rows, MAX_ROWS):
        m = min(MAX_ROWS, rows - r)
        lib.smallm_linear(x[r:r + m].data_ptr(), packed.data_ptr(), y[r:r + m].data_ptr(), m, width, k, fmt, scale,
                          threads)
    if width != n:  # the padding columns of the last block
        y = y[:, :n].contiguous()
    return y if bias is None else y + bias
