// The engine's CPU operators (torch.ops.aotx_cpu), for x86-64 CPUs with AVX2 and FMA; cpu_ops.py builds
// and loads this file, docs/engine.md has the measurements.
//
//   linear_bf16(x, w)        y = x @ w.T, x float32 [M, K], w bfloat16 [N, K], summed in float32
//   linear_q4, linear_q8     y = x @ w.T for weights in GGUF's Q4_1 and Q8_0 blocks, in integer products
//   pack_q4, pack_q8         such blocks, from GGUF's row-major order, in the layout those products read
//   dequantize_q4, _q8       the float32 weight packed blocks hold
//   round_activations        the int16-per-block values those products round their activations to
//   rope_write_kv            rotate queries and keys, write keys and values into the paged pool
//   add_rms_norm, silu_mul   the residual sum with the next norm; silu(gate) * up
//   rms_norm(x, w, eps)      x * rsqrt(mean(x^2) + eps) * w over the last dimension, float32
//   paged_decode_attention   one query per row attending over its keys in the paged KV pool
//   decode_layers            every layer of a decode step in one call, with the operators above
//   (masked_top_k, memory recall's scan, is in recall_scan.cpp, built into the same library)
//
// linear_bf16. The runtime file stores the model's weights in bfloat16. Widening a bfloat16 to float32 is exact (a
// 16-bit shift), so computing with the stored bfloat16 weights and float32 activations gives the same
// products as a float32 copy of those weights would; only the order of the float32 sums differs. What
// changes is the memory traffic: a decode step is a few rows of activations against every weight of the
// model, so it is bound by how fast the weights stream from memory, and bfloat16 halves those bytes.
//
// Kernel: one weight row (8 bfloat16 at a time, widened in registers) against up to 8 activation rows,
// eight float32 accumulators, one horizontal sum per output. Rows of w are split across PyTorch's
// intra-op threads (at::parallel_for); for more than 8 activation rows, a chunk of weight rows is reused
// from cache for each block of 8.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <immintrin.h>
#include <torch/library.h>

#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kRowsPerChunk = 32;  // weight rows reused across blocks of 8 activation rows
constexpr int64_t kBlock = 32;  // weights per quantized block (linear_q4, linear_q8)
// Weights are read as one stream (rows are contiguous and taken in order); asking for the bytes 1 KiB
// ahead keeps more cache misses in flight than the hardware prefetcher alone (docs/performance.md,
// "Figures behind the code").
constexpr int64_t kPrefetchAhead = 512;  // bfloat16 elements

inline __m256 widen8(const uint16_t* p) {
  __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// the eight sums of eight vectors, in order: [sum(v[0]), ..., sum(v[7])]
inline __m256 hsum8(const __m256 v[8]) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// a . b in float32 (a float reduction the compiler must not reorder by itself, so vectorised here)
// Eight or one values of a KV pool, float32 or float16 (the CPU engine's pool for quantized weights),
// as float32, and back (to nearest, ties to even, as PyTorch converts)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline float load1(const float* p) { return *p; }
inline float load1(const at::Half* p) { return _cvtsh_ss(*reinterpret_cast<const uint16_t*>(p)); }
inline void store1(float* p, float v) { *p = v; }
inline void store1(at::Half* p, float v) { *reinterpret_cast<uint16_t*>(p) = _cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT); }

template <class T>
inline float dot(const float* a, const T* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8(b + i), acc);
  float sum = hsum(acc);
  for (; i < n; i++) sum += a[i] * load1(b + i);
  return sum;
}

// e^x for 8 floats (Cephes' expf: x = n ln 2 + r with |r| <= ln 2 / 2, a degree-5 polynomial for e^r,
// 2^n put into the exponent): within a few ulp of std::exp over [-87.3, 88.3], the input clamped to that
// range, and a few times faster than eight calls to it. Softmax and SiLU take one exponential per element.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), _mm256_set1_ps(-87.3365478515625f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500E-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507E-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073E-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894E-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459E-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201E-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// y[r * ldy] = dot(x[r * K : (r + 1) * K], w[0:K]) for r < MR; K is a multiple of 8
template <int MR>
inline void row(const float* x, const uint16_t* w, float* y, int64_t K, int64_t ldy) {
  __m256 acc[MR];
  for (int r = 0; r < MR; r++) acc[r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    _mm_prefetch(reinterpret_cast<const char*>(w + k + kPrefetchAhead), _MM_HINT_T0);
    __m256 v = widen8(w + k);
    for (int r = 0; r < MR; r++) acc[r] = _mm256_fmadd_ps(v, _mm256_loadu_ps(x + r * K + k), acc[r]);
  }
  for (int r = 0; r < MR; r++) y[r * ldy] = hsum(acc[r]);
}

// f(std::integral_constant<int, mr>{}) for mr in 1..8: the kernels are templates on their row count
template <class F>
inline void by_rows(int64_t mr, F&& f) {
  switch (mr) {
    case 8: return f(std::integral_constant<int, 8>{});
    case 7: return f(std::integral_constant<int, 7>{});
    case 6: return f(std::integral_constant<int, 6>{});
    case 5: return f(std::integral_constant<int, 5>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 2: return f(std::integral_constant<int, 2>{});
    default: return f(std::integral_constant<int, 1>{});
  }
}

void rows(const float* x, const uint16_t* w, float* y, int64_t mr, int64_t K, int64_t ldy) {
  by_rows(mr, [&](auto m) { row<decltype(m)::value>(x, w, y, K, ldy); });
}

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "linear_bf16: x [M, K] and w [N, K] expected");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kBFloat16,
              "linear_bf16: float32 x and bfloat16 w expected");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "linear_bf16: CPU tensors expected");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "linear_bf16: contiguous tensors expected");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(K % 8 == 0, "linear_bf16: K must be a multiple of 8");
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n0 = begin; n0 < end; n0 += kRowsPerChunk) {
      const int64_t n1 = std::min(end, n0 + kRowsPerChunk);
      for (int64_t m = 0; m < M; m += 8) {
        for (int64_t n = n0; n < n1; n++) rows(xp + m * K, wp + n * K, yp + m * N + n, std::min<int64_t>(8, M - m), K, N);
      }
    }
  });
  return y;
}

// rms_norm: a decode step normalises a few rows of 576 values 61 times; the composite PyTorch op
// dispatches five kernels a call, this one none (docs/performance.md, "Figures behind the code").
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && w.dim() == 1 &&
                  x.size(-1) == w.size(0) && x.is_contiguous() && w.is_contiguous() && x.device().is_cpu(),
              "rms_norm: contiguous float32 x [..., H] and w [H] on the CPU expected");
  const int64_t H = w.size(0), rows = H ? x.numel() / H : 0;
  at::Tensor y = at::empty_like(x);
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; r++) {
      const float* xr = xp + r * H;
      const float sum = dot(xr, xr, H);
      const float scale = 1.f / std::sqrt(sum / static_cast<float>(H) + static_cast<float>(eps));
      for (int64_t i = 0; i < H; i++) yp[r * H + i] = (xr[i] * scale) * wp[i];
    }
  });
  return y;
}

// o = norm * sum_j weight[j] * value_j for a head of 8 * N8 floats, the output row in registers; value j lies
// in v_pool where key j lies in k_pool
template <int N8, class T>
inline void weighted_sum(const float* weight, const T* const* keys, const T* k_pool, const T* v_pool,
                         int64_t L, float norm, float* o) {
  __m256 acc[N8];
  for (int i = 0; i < N8; i++) acc[i] = _mm256_setzero_ps();
  for (int64_t j = 0; j < L; j++) {
    const T* value = v_pool + (keys[j] - k_pool);
    if (j + 4 < L) {  // values four keys ahead, from memory
      const T* next = v_pool + (keys[j + 4] - k_pool);
      for (int i = 0; i < N8; i += 2) _mm_prefetch(reinterpret_cast<const char*>(next + 8 * i), _MM_HINT_T0);
    }
    const __m256 w = _mm256_set1_ps(weight[j]);
    for (int i = 0; i < N8; i++) acc[i] = _mm256_fmadd_ps(w, load8(value + 8 * i), acc[i]);
  }
  for (int i = 0; i < N8; i++) _mm256_storeu_ps(o + 8 * i, _mm256_mul_ps(acc[i], _mm256_set1_ps(norm)));
}

// paged_decode_attention: q [B, heads, D]; k_pool and v_pool [slots, kv_heads, D], float32 or float16 (a
// layer's pool, slot = page * page_size + offset); block_tables [B, pages]; lengths [B] (row b sees keys 0..lengths[b]-1,
// which its block table maps to slots). Query head i reads KV head i / (heads / kv_heads), as grouped-query
// attention does. Reads each row's keys and values where they lie in the pool: no gathered copy of every
// row's pages per layer, which with scaled_dot_product_attention cost more than the attention itself.
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                  const at::Tensor& block_tables, const at::Tensor& lengths, int64_t page_size,
                                  double scale) {
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 3 && v_pool.sizes() == k_pool.sizes() && q.size(2) == k_pool.size(2),
              "paged_decode_attention: q [B, heads, D], k_pool and v_pool [slots, kv_heads, D] expected");
  TORCH_CHECK(q.scalar_type() == at::kFloat && (k_pool.scalar_type() == at::kFloat || k_pool.scalar_type() == at::kHalf) &&
                  v_pool.scalar_type() == k_pool.scalar_type(),
              "paged_decode_attention: float32 q and float32 or float16 pools expected");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && lengths.scalar_type() == at::kLong && block_tables.dim() == 2 &&
                  block_tables.size(0) == q.size(0) && lengths.dim() == 1 && lengths.size(0) == q.size(0),
              "paged_decode_attention: int64 block_tables [B, pages] and lengths [B] expected");
  TORCH_CHECK(q.is_contiguous() && k_pool.is_contiguous() && v_pool.is_contiguous() && block_tables.is_contiguous() &&
                  lengths.is_contiguous(), "paged_decode_attention: contiguous tensors expected");
  const int64_t B = q.size(0), heads = q.size(1), D = q.size(2), kv_heads = k_pool.size(1), slots = k_pool.size(0);
  const int64_t pages = block_tables.size(1);
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "paged_decode_attention: heads must be a multiple of kv_heads");
  TORCH_CHECK(page_size > 0, "paged_decode_attention: page_size must be positive");
  const int64_t group = heads / kv_heads;
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* len = lengths.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; b++) {
    TORCH_CHECK(len[b] >= 1 && len[b] <= pages * page_size, "paged_decode_attention: row ", b, " length ", len[b],
                " outside its block table");
    for (int64_t p = 0; p < (len[b] + page_size - 1) / page_size; p++)
      TORCH_CHECK(bt[b * pages + p] >= 0 && (bt[b * pages + p] + 1) * page_size <= slots,
                  "paged_decode_attention: row ", b, " names a page outside the pool");
  }
  at::Tensor out = at::empty_like(q);
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  const auto attend = [&](const auto* kp, const auto* vp) {  // float32 or float16 pools
    using T = std::remove_const_t<std::remove_pointer_t<decltype(kp)>>;
    at::parallel_for(0, B * kv_heads, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores;
      std::vector<const T*> keys;
      for (int64_t task = begin; task < end; task++) {
        const int64_t b = task / kv_heads, h = task % kv_heads, L = len[b];
        scores.assign(group * L, 0.f);
        keys.resize(L);
        for (int64_t j0 = 0, p = 0; j0 < L; j0 += page_size, p++) {  // page by page: no division per key
          const T* first = kp + (bt[b * pages + p] * page_size * kv_heads + h) * D;
          for (int64_t j = j0; j < std::min(L, j0 + page_size); j++) keys[j] = first + (j - j0) * kv_heads * D;
        }
        const float* q0 = qp + (b * heads + h * group) * D;  // the group's queries, one after another
        int64_t j8 = 0;
        if (D % 8 == 0) {  // eight keys at a time: eight accumulators, one horizontal sum for all eight
          for (; j8 + 8 <= L; j8 += 8) {
            for (int64_t k = j8 + 8; k < std::min(L, j8 + 16); k++) {  // the next eight keys, from memory
              for (size_t line = 0; line < D * sizeof(T); line += 64)
                _mm_prefetch(reinterpret_cast<const char*>(keys[k]) + line, _MM_HINT_T0);
            }
            for (int64_t g = 0; g < group; g++) {
              __m256 acc[8];
              for (int k = 0; k < 8; k++) acc[k] = _mm256_setzero_ps();
              for (int64_t i = 0; i < D; i += 8) {
                const __m256 qv = _mm256_loadu_ps(q0 + g * D + i);
                for (int k = 0; k < 8; k++) acc[k] = _mm256_fmadd_ps(load8(keys[j8 + k] + i), qv, acc[k]);
              }
              _mm256_storeu_ps(scores.data() + g * L + j8, _mm256_mul_ps(hsum8(acc), _mm256_set1_ps(fscale)));
            }
          }
        }
        for (int64_t j = j8; j < L; j++) {
          for (int64_t g = 0; g < group; g++) scores[g * L + j] = dot(q0 + g * D, keys[j], D) * fscale;
        }
        for (int64_t g = 0; g < group; g++) {
          float* s = scores.data() + g * L;
          const float top = *std::max_element(s, s + L);
          __m256 sum = _mm256_setzero_ps();
          const __m256 shift = _mm256_set1_ps(top);
          int64_t j = 0;
          for (; j + 8 <= L; j += 8) {
            const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), shift));
            _mm256_storeu_ps(s + j, e);
            sum = _mm256_add_ps(sum, e);
          }
          float total = hsum(sum);
          for (; j < L; j++) total += (s[j] = std::exp(s[j] - top));
          const float inv = 1.f / total;
          float* o = op + (b * heads + h * group + g) * D;
          if (D == 64) {  // the common head sizes, with the output row in registers
            weighted_sum<8>(s, keys.data(), kp, vp, L, inv, o);
          } else if (D == 128) {
            weighted_sum<16>(s, keys.data(), kp, vp, L, inv, o);
          } else {
            std::fill(o, o + D, 0.f);
            for (int64_t j2 = 0; j2 < L; j2++) {
              const T* value = vp + (keys[j2] - kp);
              const float weight = s[j2] * inv;
              for (int64_t d = 0; d < D; d++) o[d] += weight * load1(value + d);
            }
          }
        }
      }
    });
  };
  if (k_pool.scalar_type() == at::kHalf) {
    attend(k_pool.data_ptr<at::Half>(), v_pool.data_ptr<at::Half>());
  } else {
    attend(k_pool.data_ptr<float>(), v_pool.data_ptr<float>());
  }
  return out;
}

// ---- linear_q4 and linear_q8: quantized weights times int16 activations -------------------------------
//
// A decode step streams every weight of the model once, so its time follows the bytes a weight takes.
// The runtime file holds the model as bfloat16 (2 bytes); a GGUF model was quantized before that, and its
// blocks of 32 weights can be taken back exactly (model.py: quantize_q4, quantize_q8, in GGUF's own
// row-major order), then packed for these kernels (pack_q4, pack_q8):
//   Q4 (GGUF's Q4_1)  value = scale * code + min, codes 0..15, 0.625 bytes a weight
//   Q8 (GGUF's Q8_0)  value = scale * code, codes -127..127, 1.125 bytes a weight
//
// Packed layout. The weight's rows are taken eight at a time (a group; rows past N are zero weights),
// and each group's blocks of 32 columns are interleaved so that one 16-byte load gives, widened to int16,
// the eight rows' codes for one pair of columns each: lanes 2i and 2i + 1 hold row i's codes for columns
// 2p and 2p + 1. Q4: a group's block is 128 bytes; byte 16p + 2i + t holds row i's code 2p + t in its
// low half and code 2p + 16 + t in its high half (the pairs p and p + 8). Q8: 256 bytes; byte
// 16p + 2i + t holds row i's code 2p + t. Scales: Q4 [groups, blocks, 16] float16 (the eight rows' scales,
// then their mins), Q8 [groups, blocks, 8] float32.
//
// The products are integer ones. Each row of x is rounded once per call, block by block, to int16 codes
// with a scale of the block's own (its largest magnitude / 32767: every value within half a step, 1/65534
// of that magnitude; round_activations returns those values). A pair of activation codes, broadcast,
// meets a vector of eight rows' code pairs in _mm256_madd_epi16: 16 products an instruction, summed exactly
// in int32, each lane a different weight row, so no horizontal sum is needed anywhere. Each block's
// integer dot products are scaled once:
//   y = sum_b scale_b * d_b * (codes_b . q_b) + min_b * d_b * sum(q_b)
// where d_b is the activations' block scale: the product of the rounded activations with the dequantized
// weights (model.Linear computes the same for prefill, where MKL's sgemm multiplies the rounded rows).
// A tile is two groups (16 weight rows) against up to four activation rows, so each broadcast serves two
// instructions and each widened weight vector four; its sums stay in registers. Against one weight row
// at a time with the activation rows' sums reduced horizontally (the layout before), the step's products
// took 0.6-0.75 times as long (docs/performance.md). For a block's largest values the rounding is 128
// times finer than bfloat16's (2^-9), the compute type on CUDA.

inline const uint16_t* half_bits(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::Half>()); }

// A packed weight: `codes` widens the eight rows' codes for the column pairs p and p + 8 of a block;
// `scales` and `mins` are the eight rows' block scales and mins (Q8: no mins); `widen` writes one row's
// 32 float32 values of a block (dequantize_*).
struct Q4Pack {
  static constexpr bool kMin = true;
  static constexpr int64_t kBytes = 128;  // a group's block
  const uint8_t* w;
  const uint16_t* sm;  // float16 bits
  int64_t groups, blocks;
  inline const uint8_t* at(int64_t g, int64_t b) const { return w + (g * blocks + b) * kBytes; }
  inline void codes(const uint8_t* block, int p, __m256i& lo, __m256i& hi) const {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 16 * p));
    const __m128i mask = _mm_set1_epi8(0x0F);
    lo = _mm256_cvtepu8_epi16(_mm_and_si128(packed, mask));
    hi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(packed, 4), mask));
  }
  inline __m256 scales(int64_t g, int64_t b) const {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sm + (g * blocks + b) * 16)));
  }
  inline __m256 mins(int64_t g, int64_t b) const {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sm + (g * blocks + b) * 16 + 8)));
  }
  inline void widen(int64_t n, int64_t b, float* out) const {
    const uint8_t* block = at(n / 8, b);
    const int64_t i = n % 8, slot = (n / 8 * blocks + b) * 16;
    const float s = _cvtsh_ss(sm[slot + i]), m = _cvtsh_ss(sm[slot + 8 + i]);
    for (int p = 0; p < 8; p++) {
      for (int t = 0; t < 2; t++) {
        const uint8_t byte = block[16 * p + 2 * i + t];
        out[2 * p + t] = std::fma(static_cast<float>(byte & 0x0F), s, m);
        out[2 * p + 16 + t] = std::fma(static_cast<float>(byte >> 4), s, m);
      }
    }
  }
};

struct Q8Pack {
  static constexpr bool kMin = false;
  static constexpr int64_t kBytes = 256;
  const int8_t* w;
  const float* s;
  int64_t groups, blocks;
  inline const int8_t* at(int64_t g, int64_t b) const { return w + (g * blocks + b) * kBytes; }
  inline void codes(const int8_t* block, int p, __m256i& lo, __m256i& hi) const {
    lo = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 16 * p)));
    hi = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 16 * (p + 8))));
  }
  inline __m256 scales(int64_t g, int64_t b) const { return _mm256_loadu_ps(s + (g * blocks + b) * 8); }
  inline __m256 mins(int64_t, int64_t) const { return _mm256_setzero_ps(); }
  inline void widen(int64_t n, int64_t b, float* out) const {
    const int8_t* block = at(n / 8, b);
    const int64_t i = n % 8;
    const float scale = s[(n / 8 * blocks + b) * 8 + i];
    for (int p = 0; p < 16; p++) {
      for (int t = 0; t < 2; t++) out[2 * p + t] = static_cast<float>(block[16 * p + 2 * i + t]) * scale;
    }
  }
};

// x [M, K] rounded for the integer products: q [M, K] int16; per row, each block's scale and the sum of
// its rounded values ([M, blocks]). The arrays live in buffers of the calling thread, reused from call
// to call: a decode step makes some 120 products, and tensors for each were a tenth of a one-request step.
struct Rows16 {
  const int16_t* q;
  const float *d, *sums;
  int64_t K, blocks;
};

Rows16 round_rows(const at::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1), blocks = K / kBlock;
  thread_local std::vector<int16_t> codes;
  thread_local std::vector<float> floats;
  codes.resize(M * K);
  floats.resize(2 * M * blocks);
  int16_t* q = codes.data();
  float *d = floats.data(), *sums = d + M * blocks;
  const float* xp = x.data_ptr<float>();
  const __m256 sign = _mm256_set1_ps(-0.f);
  at::parallel_for(0, M, 8, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; m++) {
      for (int64_t b = 0; b < blocks; b++) {
        const float* xb = xp + m * K + b * kBlock;
        __m256 v[4], top = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
          v[i] = _mm256_loadu_ps(xb + 8 * i);
          top = _mm256_max_ps(top, _mm256_andnot_ps(sign, v[i]));
        }
        __m128 t = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
        t = _mm_max_ps(t, _mm_movehl_ps(t, t));
        const float largest = _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
        const __m256 inv = _mm256_set1_ps(largest > 0.f ? 32767.f / largest : 0.f);
        __m256i c[4];
        for (int i = 0; i < 4; i++) c[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));  // to nearest, even
        int16_t* qb = q + m * K + b * kBlock;  // packs interleaves 128-bit lanes: permute puts them back
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb), _mm256_permute4x64_epi64(_mm256_packs_epi32(c[0], c[1]), 0xD8));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb + 16), _mm256_permute4x64_epi64(_mm256_packs_epi32(c[2], c[3]), 0xD8));
        // the codes' sum (exact in float32: at most 32 * 32767), for Q4_1's min term
        const __m256i codes_sum = _mm256_add_epi32(_mm256_add_epi32(c[0], c[1]), _mm256_add_epi32(c[2], c[3]));
        const float scale = largest / 32767.f;
        d[m * blocks + b] = scale;
        sums[m * blocks + b] = scale * hsum(_mm256_cvtepi32_ps(codes_sum));
      }
    }
  });
  return Rows16{q, d, sums, K, blocks};
}

// y[r * ldy + j] for r < R, j < 8 * NG = rows m0 + r of x . the NG groups' weight rows from group g
template <int NG, int R, class Pack>
inline void tile(const Pack& wp, int64_t g, const Rows16& x, int64_t m0, float* y, int64_t ldy) {
  __m256 acc[R][NG];
  for (int r = 0; r < R; r++) {
    for (int j = 0; j < NG; j++) acc[r][j] = _mm256_setzero_ps();
  }
  const int64_t stride = x.K / 2;  // int32 pairs of codes a row
  for (int64_t b = 0; b < wp.blocks; b++) {
    for (int j = 0; j < NG; j++) {  // the same block of the next tile's groups (the next run a thread takes)
      if (g + NG + j >= wp.groups) break;
      for (int64_t line = 0; line < Pack::kBytes; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(wp.at(g + NG + j, b)) + line, _MM_HINT_T0);
    }
    __m256i sums[R][NG];
    for (int r = 0; r < R; r++) {
      for (int j = 0; j < NG; j++) sums[r][j] = _mm256_setzero_si256();
    }
    const int32_t* pairs = reinterpret_cast<const int32_t*>(x.q + m0 * x.K + b * kBlock);
    for (int p = 0; p < 8; p++) {
      __m256i lo[NG], hi[NG];
      for (int j = 0; j < NG; j++) wp.codes(wp.at(g + j, b), p, lo[j], hi[j]);
      for (int r = 0; r < R; r++) {
        const __m256i a = _mm256_set1_epi32(pairs[r * stride + p]), c = _mm256_set1_epi32(pairs[r * stride + p + 8]);
        for (int j = 0; j < NG; j++)
          sums[r][j] = _mm256_add_epi32(sums[r][j], _mm256_add_epi32(_mm256_madd_epi16(lo[j], a), _mm256_madd_epi16(hi[j], c)));
      }
    }
    __m256 scale[NG], low[NG];
    for (int j = 0; j < NG; j++) {
      scale[j] = wp.scales(g + j, b);
      if constexpr (Pack::kMin) low[j] = wp.mins(g + j, b);
    }
    for (int r = 0; r < R; r++) {
      const __m256 d = _mm256_set1_ps(x.d[(m0 + r) * x.blocks + b]);
      for (int j = 0; j < NG; j++) {
        acc[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r][j]), _mm256_mul_ps(scale[j], d), acc[r][j]);
        if constexpr (Pack::kMin)
          acc[r][j] = _mm256_fmadd_ps(low[j], _mm256_set1_ps(x.sums[(m0 + r) * x.blocks + b]), acc[r][j]);
      }
    }
  }
  for (int r = 0; r < R; r++) {
    for (int j = 0; j < NG; j++) _mm256_storeu_ps(y + r * ldy + 8 * j, acc[r][j]);
  }
}

// Rows per tile: four measured best at four and eight rows (two tiles of four re-read the 16 weight rows
// from cache; one of eight spills its sums).
constexpr int64_t kTileRows = 4;

// y [M, 8 * groups] = x @ w.T over a packed weight: runs of groups split across the intra-op threads, each
// run's weight rows reused from cache for every tile of activation rows. Two groups a run from three rows
// on; one for one or two rows, where the product is bound by reading the weights and a run of several
// groups reads as several streams at once, which is slower (docs/performance.md, "Packed weight rows")
template <class Pack>
at::Tensor packed_linear(const at::Tensor& x, const Pack& wp) {
  const int64_t M = x.size(0), N = 8 * wp.groups;
  const Rows16 rows = round_rows(x);
  at::Tensor y = at::empty({M, N}, x.options());
  float* yp = y.data_ptr<float>();
  const auto tiles = [&](auto groups, int64_t g) {
    constexpr int NG = decltype(groups)::value;
    int64_t m = 0;
    for (; m + kTileRows <= M; m += kTileRows) tile<NG, kTileRows>(wp, g, rows, m, yp + m * N + 8 * g, N);
    switch (M - m) {
      case 3: return tile<NG, 3>(wp, g, rows, m, yp + m * N + 8 * g, N);
      case 2: return tile<NG, 2>(wp, g, rows, m, yp + m * N + 8 * g, N);
      case 1: return tile<NG, 1>(wp, g, rows, m, yp + m * N + 8 * g, N);
      default: return;
    }
  };
  const auto runs = [&](auto groups) {
    constexpr int NG = decltype(groups)::value;
    at::parallel_for(0, (wp.groups + NG - 1) / NG, 8 / NG, [&](int64_t begin, int64_t end) {
      for (int64_t run = begin; run < end; run++) {
        int64_t g = NG * run;
        if (g + NG <= wp.groups) {
          tiles(groups, g);
        } else {  // the last groups, one at a time
          for (; g < wp.groups; g++) tiles(std::integral_constant<int, 1>{}, g);
        }
      }
    });
  };
  if (M <= 2) runs(std::integral_constant<int, 1>{}); else runs(std::integral_constant<int, 2>{});
  return y;
}

// A packed weight, its shapes and types checked (`name`: the operator, for the message)
Q4Pack q4_pack(const at::Tensor& w, const at::Tensor& sm, const char* name) {
  TORCH_CHECK(w.dim() == 3 && w.size(2) == Q4Pack::kBytes && w.scalar_type() == at::kByte && w.device().is_cpu() &&
                  w.is_contiguous(), name, ": contiguous uint8 w [N / 8, K / 32, 128] (pack_q4) expected");
  TORCH_CHECK(sm.dim() == 3 && sm.size(0) == w.size(0) && sm.size(1) == w.size(1) && sm.size(2) == 16 &&
                  sm.scalar_type() == at::kHalf && sm.device().is_cpu() && sm.is_contiguous(),
              name, ": contiguous float16 scales and mins [N / 8, K / 32, 16] (pack_q4) expected");
  return Q4Pack{w.data_ptr<uint8_t>(), half_bits(sm), w.size(0), w.size(1)};
}

Q8Pack q8_pack(const at::Tensor& w, const at::Tensor& scales, const char* name) {
  TORCH_CHECK(w.dim() == 3 && w.size(2) == Q8Pack::kBytes && w.scalar_type() == at::kChar && w.device().is_cpu() &&
                  w.is_contiguous(), name, ": contiguous int8 w [N / 8, K / 32, 256] (pack_q8) expected");
  TORCH_CHECK(scales.dim() == 3 && scales.size(0) == w.size(0) && scales.size(1) == w.size(1) && scales.size(2) == 8 &&
                  scales.scalar_type() == at::kFloat && scales.device().is_cpu() && scales.is_contiguous(),
              name, ": contiguous float32 scales [N / 8, K / 32, 8] (pack_q8) expected");
  return Q8Pack{w.data_ptr<int8_t>(), scales.data_ptr<float>(), w.size(0), w.size(1)};
}

void check_blocks_input(const at::Tensor& x, int64_t K, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu() && x.is_contiguous(), name,
              ": contiguous float32 x [M, K] on the CPU expected");
  TORCH_CHECK(x.size(1) % kBlock == 0, name, ": K must be a multiple of 32");
  TORCH_CHECK(x.size(1) == K, name, ": x [M, K] and a weight of K columns expected");
}

at::Tensor linear_q4(const at::Tensor& x, const at::Tensor& w, const at::Tensor& sm) {
  const Q4Pack wp = q4_pack(w, sm, "linear_q4");
  check_blocks_input(x, wp.blocks * kBlock, "linear_q4");
  return packed_linear(x, wp);
}

at::Tensor linear_q8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales) {
  const Q8Pack wp = q8_pack(w, scales, "linear_q8");
  check_blocks_input(x, wp.blocks * kBlock, "linear_q8");
  return packed_linear(x, wp);
}

// pack_q4(w [N, K / 2] uint8, sm [N, 2, K / 32] float16), quantize_q4's row-major blocks (GGUF's order:
// byte j of a block holds code j low and code j + 16 high; each row's scales, then its mins) -> the
// packed layout above, N rounded up to a multiple of 8 with zero rows
std::tuple<at::Tensor, at::Tensor> pack_q4(const at::Tensor& w, const at::Tensor& sm) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.device().is_cpu() && w.is_contiguous() &&
                  (2 * w.size(1)) % kBlock == 0, "pack_q4: contiguous uint8 w [N, K / 2] expected");
  const int64_t N = w.size(0), blocks = 2 * w.size(1) / kBlock, groups = (N + 7) / 8;
  TORCH_CHECK(sm.dim() == 3 && sm.size(0) == N && sm.size(1) == 2 && sm.size(2) == blocks &&
                  sm.scalar_type() == at::kHalf && sm.device().is_cpu() && sm.is_contiguous(),
              "pack_q4: contiguous float16 scales and mins [N, 2, K / 32] expected");
  at::Tensor out = at::zeros({groups, blocks, Q4Pack::kBytes}, w.options());
  at::Tensor out_sm = at::zeros({groups, blocks, 16}, sm.options());
  const uint8_t* src = w.data_ptr<uint8_t>();
  const uint16_t* src_sm = half_bits(sm);
  uint8_t* dst = out.data_ptr<uint8_t>();
  uint16_t* dst_sm = reinterpret_cast<uint16_t*>(out_sm.data_ptr<at::Half>());
  for (int64_t n = 0; n < N; n++) {
    const int64_t g = n / 8, i = n % 8;
    for (int64_t b = 0; b < blocks; b++) {
      const uint8_t* block = src + n * (blocks * kBlock / 2) + b * (kBlock / 2);  // code j low, j + 16 high
      const auto code = [&](int64_t j) { return j < 16 ? block[j] & 0x0F : block[j - 16] >> 4; };
      uint8_t* packed = dst + (g * blocks + b) * Q4Pack::kBytes;
      for (int p = 0; p < 8; p++) {
        for (int t = 0; t < 2; t++) packed[16 * p + 2 * i + t] = static_cast<uint8_t>(code(2 * p + t) | (code(2 * p + 16 + t) << 4));
      }
      dst_sm[(g * blocks + b) * 16 + i] = src_sm[n * 2 * blocks + b];
      dst_sm[(g * blocks + b) * 16 + 8 + i] = src_sm[(n * 2 + 1) * blocks + b];
    }
  }
  return {out, out_sm};
}

// pack_q8(w [N, K] int8, scales [N, K / 32] float32), quantize_q8's blocks -> the packed layout above
std::tuple<at::Tensor, at::Tensor> pack_q8(const at::Tensor& w, const at::Tensor& scales) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar && w.device().is_cpu() && w.is_contiguous() &&
                  w.size(1) % kBlock == 0, "pack_q8: contiguous int8 w [N, K] with K a multiple of 32 expected");
  const int64_t N = w.size(0), K = w.size(1), blocks = K / kBlock, groups = (N + 7) / 8;
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == N && scales.size(1) == blocks &&
                  scales.scalar_type() == at::kFloat && scales.device().is_cpu() && scales.is_contiguous(),
              "pack_q8: contiguous float32 scales [N, K / 32] expected");
  at::Tensor out = at::zeros({groups, blocks, Q8Pack::kBytes}, w.options());
  at::Tensor out_scales = at::zeros({groups, blocks, 8}, scales.options());
  const int8_t* src = w.data_ptr<int8_t>();
  const float* src_scales = scales.data_ptr<float>();
  int8_t* dst = out.data_ptr<int8_t>();
  float* dst_scales = out_scales.data_ptr<float>();
  for (int64_t n = 0; n < N; n++) {
    const int64_t g = n / 8, i = n % 8;
    for (int64_t b = 0; b < blocks; b++) {
      int8_t* packed = dst + (g * blocks + b) * Q8Pack::kBytes;
      for (int p = 0; p < 16; p++) {
        for (int t = 0; t < 2; t++) packed[16 * p + 2 * i + t] = src[n * K + b * kBlock + 2 * p + t];
      }
      dst_scales[(g * blocks + b) * 8 + i] = src_scales[n * blocks + b];
    }
  }
  return {out, out_scales};
}

// round_activations(x): the float32 values x [M, K] is rounded to for linear_q4 and linear_q8
at::Tensor round_activations(const at::Tensor& x) {
  check_blocks_input(x, x.size(1), "round_activations");
  const Rows16 rows = round_rows(x);
  at::Tensor out = at::empty_like(x);
  float* op = out.data_ptr<float>();
  const int64_t M = x.size(0), K = x.size(1);
  at::parallel_for(0, M, 8, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; m++) {
      for (int64_t k = 0; k < K; k++) op[m * K + k] = static_cast<float>(rows.q[m * K + k]) * rows.d[m * rows.blocks + k / kBlock];
    }
  });
  return out;
}

// The float32 weight [8 * groups, K] a packed one holds: for products of many rows (prefill), which are
// bound by arithmetic, where MKL's cache-blocked sgemm on the widened weight beats dequantizing every
// block again for each tile of rows (docs/performance.md, "Figures behind the code").
template <class Pack>
at::Tensor packed_dequantize(const Pack& wp, const at::TensorOptions& options) {
  const int64_t N = 8 * wp.groups, K = wp.blocks * kBlock;
  at::Tensor out = at::empty({N, K}, options);
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; n++) {
      for (int64_t b = 0; b < wp.blocks; b++) wp.widen(n, b, op + n * K + b * kBlock);
    }
  });
  return out;
}

at::Tensor dequantize_q4(const at::Tensor& w, const at::Tensor& sm) {
  return packed_dequantize(q4_pack(w, sm, "dequantize_q4"), sm.options().dtype(at::kFloat));
}

at::Tensor dequantize_q8(const at::Tensor& w, const at::Tensor& scales) {
  return packed_dequantize(q8_pack(w, scales, "dequantize_q8"), scales.options());
}

// ---- the fused element-wise steps of a layer (triton_ops' CPU counterparts) ---------------------------
//
// Each replaces a handful of dispatched PyTorch operators (splits, a concatenation, a stack, an indexed
// copy): at one or a few rows a decode step is mostly dispatch, not arithmetic.

// qkv [T, (heads + 2 kv_heads) * D]; cos, sin [positions, D] (rotate_half layout); positions, slots [T];
// k_pool, v_pool [slots, kv_heads, D]. Writes rotated keys and the values at each token's slot; returns the
// rotated queries [T, heads, D].
at::Tensor rope_write_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                         const at::Tensor& positions, const at::Tensor& slots, const at::Tensor& k_pool, const at::Tensor& v_pool,
                         int64_t heads, int64_t kv_heads) {
  TORCH_CHECK(qkv.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  (k_pool.scalar_type() == at::kFloat || k_pool.scalar_type() == at::kHalf) &&
                  v_pool.scalar_type() == k_pool.scalar_type(),
              "rope_write_kv: float32 tensors and float32 or float16 pools expected");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slots.scalar_type() == at::kLong,
              "rope_write_kv: int64 positions and slots expected");
  TORCH_CHECK(qkv.is_contiguous() && cos.is_contiguous() && sin.is_contiguous() && positions.is_contiguous() &&
                  slots.is_contiguous() && k_pool.is_contiguous() && v_pool.is_contiguous(),
              "rope_write_kv: contiguous tensors expected");
  TORCH_CHECK(k_pool.dim() == 3 && v_pool.sizes() == k_pool.sizes() && k_pool.size(1) == kv_heads,
              "rope_write_kv: k_pool and v_pool [slots, kv_heads, D] expected");
  const int64_t D = k_pool.size(2), T = qkv.size(0), width = (heads + 2 * kv_heads) * D;
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == width && positions.numel() == T && slots.numel() == T &&
                  cos.dim() == 2 && cos.size(1) == D && sin.sizes() == cos.sizes() && D % 2 == 0,
              "rope_write_kv: qkv [T, (heads + 2 kv_heads) * D], cos and sin [positions, D] expected");
  const int64_t *pos = positions.data_ptr<int64_t>(), *slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; t++) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "rope_write_kv: position ", pos[t], " outside the tables");
    TORCH_CHECK(slot[t] >= 0 && slot[t] < k_pool.size(0), "rope_write_kv: slot ", slot[t], " outside the pool");
  }
  at::Tensor q = at::empty({T, heads, D}, qkv.options());
  const float *src = qkv.data_ptr<float>(), *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  float* qp = q.data_ptr<float>();
  const int64_t half = D / 2;
  const auto write = [&](auto* kp, auto* vp) {  // float32 or float16 pools
    at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; t++) {
        const float *c = cp + pos[t] * D, *s = sp + pos[t] * D, *row = src + t * width;
        auto rotate = [&](const float* in, auto* out) {
          for (int64_t i = 0; i < half; i++) {
            store1(out + i, in[i] * c[i] - in[i + half] * s[i]);
            store1(out + i + half, in[i + half] * c[i + half] + in[i] * s[i + half]);
          }
        };
        for (int64_t h = 0; h < heads; h++) rotate(row + h * D, qp + (t * heads + h) * D);
        for (int64_t h = 0; h < kv_heads; h++) {
          rotate(row + (heads + h) * D, kp + (slot[t] * kv_heads + h) * D);
          const float* value = row + (heads + kv_heads + h) * D;
          for (int64_t i = 0; i < D; i++) store1(vp + (slot[t] * kv_heads + h) * D + i, value[i]);
        }
      }
    });
  };
  if (k_pool.scalar_type() == at::kHalf) {
    write(k_pool.data_ptr<at::Half>(), v_pool.data_ptr<at::Half>());
  } else {
    write(k_pool.data_ptr<float>(), v_pool.data_ptr<float>());
  }
  return q;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& w,
                                                double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && delta.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat &&
                  x.sizes() == delta.sizes() && w.dim() == 1 && x.size(-1) == w.size(0) && x.is_contiguous() &&
                  delta.is_contiguous() && w.is_contiguous() && x.device().is_cpu(),
              "add_rms_norm: contiguous float32 x and delta [..., H] and w [H] on the CPU expected");
  const int64_t H = w.size(0), rows = H ? x.numel() / H : 0;
  at::Tensor sum = at::empty_like(x), y = at::empty_like(x);
  const float *xp = x.data_ptr<float>(), *dp = delta.data_ptr<float>(), *wp = w.data_ptr<float>();
  float *sp = sum.data_ptr<float>(), *yp = y.data_ptr<float>();
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; r++) {
      float* s = sp + r * H;
      for (int64_t i = 0; i < H; i++) s[i] = xp[r * H + i] + dp[r * H + i];
      const float scale = 1.f / std::sqrt(dot(s, s, H) / static_cast<float>(H) + static_cast<float>(eps));
      for (int64_t i = 0; i < H; i++) yp[r * H + i] = (s[i] * scale) * wp[i];
    }
  });
  return {sum, y};
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.scalar_type() == at::kFloat && gate_up.is_contiguous() && gate_up.size(-1) % 2 == 0,
              "silu_mul: contiguous float32 [..., 2 * width] expected");
  const int64_t width = gate_up.size(-1) / 2, rows = width ? gate_up.numel() / (2 * width) : 0;
  std::vector<int64_t> shape(gate_up.sizes().begin(), gate_up.sizes().end());
  shape.back() = width;
  at::Tensor out = at::empty(shape, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; r++) {
      const float *g = gp + r * 2 * width, *u = g + width;
      float* o = op + r * width;
      int64_t i = 0;
      for (; i + 8 <= width; i += 8) {
        const __m256 gate = _mm256_loadu_ps(g + i);
        const __m256 sig = _mm256_div_ps(gate, _mm256_add_ps(_mm256_set1_ps(1.f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), gate))));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(sig, _mm256_loadu_ps(u + i)));
      }
      for (; i < width; i++) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
    }
  });
  return out;
}

}  // namespace

// ---- decode_layers: a decode step's layers in one call ---------------------------------------------
//
// model.Llama's layer loop for one decode step (one query a row), with the operators above in the same
// order, so the result is the Python loop's to the bit, without the loop's interpreter and dispatch
// (some fifteen calls, views and shape checks a layer; docs/performance.md, "Figures behind the code").

// y = x @ w.T for a weight as model.Linear keeps it for these kernels: uint8 codes (Q4_1) with float16
// scales and mins, int8 codes (Q8_0) with float32 scales, or bfloat16 (scales unused)
at::Tensor linear_kept(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales) {
  switch (w.scalar_type()) {
    case at::kByte: return linear_q4(x, w, scales);
    case at::kChar: return linear_q8(x, w, scales);
    default: return linear_bf16(x, w);
  }
}

// x [B, H]: the residual stream after the embedding, h [B, H] its first layer's norm; per layer, four
// weights and their scales (qkv, o, gate_up, down), two norms (input, post-attention), its key and value
// pools [slots, kv_heads, D]; the rest as rope_write_kv and paged_decode_attention take them. Returns the
// residual stream after the last layer (its final norm and the output head stay with the caller).
at::Tensor decode_layers(const at::Tensor& x0, const at::Tensor& h0, at::TensorList weights, at::TensorList scales,
                         at::TensorList norms, at::TensorList k_pools, at::TensorList v_pools, const at::Tensor& cos,
                         const at::Tensor& sin, const at::Tensor& positions, const at::Tensor& slots,
                         const at::Tensor& block_tables, const at::Tensor& lengths, int64_t page_size, double scale,
                         int64_t heads, int64_t kv_heads, double eps) {
  const int64_t layers = static_cast<int64_t>(k_pools.size());
  TORCH_CHECK(layers > 0 && static_cast<int64_t>(weights.size()) == 4 * layers &&
                  static_cast<int64_t>(scales.size()) == 4 * layers && static_cast<int64_t>(norms.size()) == 2 * layers &&
                  static_cast<int64_t>(v_pools.size()) == layers,
              "decode_layers: four weights and scales, two norms and a key and a value pool a layer expected");
  TORCH_CHECK(x0.dim() == 2 && h0.sizes() == x0.sizes(), "decode_layers: x and h [B, H] expected");
  const int64_t B = x0.size(0);
  at::Tensor x = x0, h = h0, delta;
  for (int64_t i = 0; i < layers; i++) {
    const at::Tensor qkv = linear_kept(h, weights[4 * i], scales[4 * i]);
    const at::Tensor q = rope_write_kv(qkv, cos, sin, positions, slots, k_pools[i], v_pools[i], heads, kv_heads);
    const at::Tensor out = paged_decode_attention(q, k_pools[i], v_pools[i], block_tables, lengths, page_size, scale);
    delta = linear_kept(out.view({B, -1}), weights[4 * i + 1], scales[4 * i + 1]);
    std::tie(x, h) = add_rms_norm(x, delta, norms[2 * i + 1], eps);
    delta = linear_kept(silu_mul(linear_kept(h, weights[4 * i + 2], scales[4 * i + 2])), weights[4 * i + 3],
                        scales[4 * i + 3]);
    if (i + 1 < layers) std::tie(x, h) = add_rms_norm(x, delta, norms[2 * (i + 1)], eps);
  }
  return x.add(delta);
}

TORCH_LIBRARY(aotx_cpu, m) {
  m.def("linear_bf16(Tensor x, Tensor w) -> Tensor", &linear_bf16);
  m.def("linear_q8(Tensor x, Tensor w, Tensor scales) -> Tensor", &linear_q8);
  m.def("linear_q4(Tensor x, Tensor w, Tensor sm) -> Tensor", &linear_q4);
  m.def("pack_q4(Tensor w, Tensor sm) -> (Tensor, Tensor)", &pack_q4);
  m.def("pack_q8(Tensor w, Tensor scales) -> (Tensor, Tensor)", &pack_q8);
  m.def("dequantize_q4(Tensor w, Tensor sm) -> Tensor", &dequantize_q4);
  m.def("dequantize_q8(Tensor w, Tensor scales) -> Tensor", &dequantize_q8);
  m.def("round_activations(Tensor x) -> Tensor", &round_activations);
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor", &rms_norm);
  m.def("add_rms_norm(Tensor x, Tensor delta, Tensor w, float eps) -> (Tensor, Tensor)", &add_rms_norm);
  m.def("silu_mul(Tensor gate_up) -> Tensor", &silu_mul);
  m.def("rope_write_kv(Tensor qkv, Tensor cos, Tensor sin, Tensor positions, Tensor slots, Tensor(a!) k_pool, "
        "Tensor(b!) v_pool, int heads, int kv_heads) -> Tensor", &rope_write_kv);
  m.def("paged_decode_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_tables, Tensor lengths, "
        "int page_size, float scale) -> Tensor", &paged_decode_attention);
  m.def("decode_layers(Tensor x, Tensor h, Tensor[] weights, Tensor[] scales, Tensor[] norms, Tensor(a!)[] k_pools, "
        "Tensor(b!)[] v_pools, Tensor cos, Tensor sin, Tensor positions, Tensor slots, Tensor block_tables, "
        "Tensor lengths, int page_size, float scale, int heads, int kv_heads, float eps) -> Tensor", &decode_layers);
}
