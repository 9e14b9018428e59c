// The engine's CPU operators (torch.ops.aotx_cpu), for x86-64 CPUs with AVX2 and FMA; cpu_ops.py builds
// and loads this file, docs/engine.md has the measurements.
//
//   linear_bf16(x, w)        y = x @ w.T, x float32 [M, K], w bfloat16 [N, K], summed in float32
//   rms_norm(x, w, eps)      x * rsqrt(mean(x^2) + eps) * w over the last dimension, float32
//   paged_decode_attention   one query per row attending over its keys in the paged KV pool
//   masked_top_k             memory recall: the k best inner products with one query over the rows a
//                            visibility table admits (gpu_worker/memory/recall.py)
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
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

namespace {

constexpr int64_t kRowsPerChunk = 32;  // weight rows reused across blocks of 8 activation rows
// Weights are read as one stream (rows are contiguous and taken in order); asking for the bytes 1 KiB
// ahead keeps more cache misses in flight than the hardware prefetcher alone: -25% time per decode
// step at 8 rows on the development machine.
constexpr int64_t kPrefetchAhead = 512;  // bfloat16 elements

inline __m256 widen8(const uint16_t* p) {
  __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// a . b in float32 (a float reduction the compiler must not reorder by itself, so vectorised here)
inline float dot(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float sum = hsum(acc);
  for (; i < n; i++) sum += a[i] * b[i];
  return sum;
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

void rows(const float* x, const uint16_t* w, float* y, int64_t mr, int64_t K, int64_t ldy) {
  switch (mr) {
    case 8: return row<8>(x, w, y, K, ldy);
    case 7: return row<7>(x, w, y, K, ldy);
    case 6: return row<6>(x, w, y, K, ldy);
    case 5: return row<5>(x, w, y, K, ldy);
    case 4: return row<4>(x, w, y, K, ldy);
    case 3: return row<3>(x, w, y, K, ldy);
    case 2: return row<2>(x, w, y, K, ldy);
    default: return row<1>(x, w, y, K, ldy);
  }
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

// rms_norm: a decode step normalises a few rows of 576 values 61 times; the composite PyTorch op costs
// ~60 us a call on the development machine (five dispatched kernels), this one a few.
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

// paged_decode_attention: q [B, heads, D]; k_pool and v_pool [slots, kv_heads, D] (a layer's pool,
// slot = page * page_size + offset); block_tables [B, pages]; lengths [B] (row b sees keys 0..lengths[b]-1,
// which its block table maps to slots). Query head i reads KV head i / (heads / kv_heads), as grouped-query
// attention does. Reads each row's keys and values where they lie in the pool: no gathered copy of every
// row's pages per layer, which with scaled_dot_product_attention cost more than the attention itself.
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                  const at::Tensor& block_tables, const at::Tensor& lengths, int64_t page_size,
                                  double scale) {
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 3 && v_pool.sizes() == k_pool.sizes() && q.size(2) == k_pool.size(2),
              "paged_decode_attention: q [B, heads, D], k_pool and v_pool [slots, kv_heads, D] expected");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_pool.scalar_type() == at::kFloat && v_pool.scalar_type() == at::kFloat,
              "paged_decode_attention: float32 q and pools expected");
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
  const float *qp = q.data_ptr<float>(), *kp = k_pool.data_ptr<float>(), *vp = v_pool.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, B * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t task = begin; task < end; task++) {
      const int64_t b = task / kv_heads, h = task % kv_heads, L = len[b];
      scores.assign(group * L, 0.f);
      for (int64_t j = 0; j < L; j++) {
        const int64_t slot = bt[b * pages + j / page_size] * page_size + j % page_size;
        const float* key = kp + (slot * kv_heads + h) * D;
        for (int64_t g = 0; g < group; g++) {
          scores[g * L + j] = dot(qp + (b * heads + h * group + g) * D, key, D) * fscale;
        }
      }
      for (int64_t g = 0; g < group; g++) {
        float* s = scores.data() + g * L;
        const float top = *std::max_element(s, s + L);
        float total = 0.f;
        for (int64_t j = 0; j < L; j++) total += (s[j] = std::exp(s[j] - top));
        const float inv = 1.f / total;
        float* o = op + (b * heads + h * group + g) * D;
        std::fill(o, o + D, 0.f);
        for (int64_t j = 0; j < L; j++) {
          const int64_t slot = bt[b * pages + j / page_size] * page_size + j % page_size;
          const float* value = vp + (slot * kv_heads + h) * D;
          const float weight = s[j] * inv;
          for (int64_t d = 0; d < D; d++) o[d] += weight * value[d];
        }
      }
    }
  });
  return out;
}

}  // namespace

namespace {

// a . b with four independent accumulators: a recall scan is one dot per row, and a single chain of
// fused multiply-adds would wait on its own latency instead of on memory.
inline float dot4(const float* a, const float* b, int64_t n) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(), acc2 = _mm256_setzero_ps(),
         acc3 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
    acc2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 16), _mm256_loadu_ps(b + i + 16), acc2);
    acc3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 24), _mm256_loadu_ps(b + i + 24), acc3);
  }
  for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  float sum = hsum(_mm256_add_ps(_mm256_add_ps(acc0, acc1), _mm256_add_ps(acc2, acc3)));
  for (; i < n; i++) sum += a[i] * b[i];
  return sum;
}

struct Hit {
  float score;
  int64_t row;
};

// a ranks before b: higher score, then the lower row (so equal scores come out in row order)
inline bool better(const Hit& a, const Hit& b) { return a.score > b.score || (a.score == b.score && a.row < b.row); }

// keeps the k best hits seen; with `better` as the heap order, front() is the worst of them
inline void offer(std::vector<Hit>& heap, int64_t k, Hit hit) {
  if (static_cast<int64_t>(heap.size()) < k) {
    heap.push_back(hit);
    std::push_heap(heap.begin(), heap.end(), better);
  } else if (better(hit, heap.front())) {
    std::pop_heap(heap.begin(), heap.end(), better);
    heap.back() = hit;
    std::push_heap(heap.begin(), heap.end(), better);
  }
}

}  // namespace

// Rows r with visibility[owners[r]] true (owner number 0, a free row, and numbers outside the table never)
// are scored by embeddings[r] . query; the k best come back best first, padded with -inf and -1.
// One thread, as FAISS scans for a single query: split across two busy cores the scan waited for the
// second thread's wake-up (7.8 ms against 0.7 ms serial for 100,000 rows; docs/performance.md).
std::tuple<at::Tensor, at::Tensor> masked_top_k(const at::Tensor& embeddings, const at::Tensor& owners,
                                                const at::Tensor& visibility, const at::Tensor& query, int64_t k) {
  TORCH_CHECK(embeddings.dim() == 2 && embeddings.scalar_type() == at::kFloat && embeddings.is_contiguous(),
              "embeddings: contiguous float32 [N, D]");
  TORCH_CHECK(owners.dim() == 1 && owners.scalar_type() == at::kLong && owners.is_contiguous() &&
                  owners.size(0) == embeddings.size(0), "owners: contiguous int64 [N]");
  TORCH_CHECK(visibility.dim() == 1 && visibility.scalar_type() == at::kBool && visibility.is_contiguous(),
              "visibility: contiguous bool [V]");
  TORCH_CHECK(query.dim() == 1 && query.scalar_type() == at::kFloat && query.is_contiguous() &&
                  query.size(0) == embeddings.size(1), "query: contiguous float32 [D]");
  TORCH_CHECK(k > 0, "k must be positive");
  const int64_t n = embeddings.size(0), d = embeddings.size(1), v = visibility.size(0);
  const float* e = embeddings.data_ptr<float>();
  const float* q = query.data_ptr<float>();
  const int64_t* own = owners.data_ptr<int64_t>();
  const bool* vis = visibility.data_ptr<bool>();
  std::vector<Hit> best;
  best.reserve(k);
  auto visible = [&](int64_t r) {
    const uint64_t o = static_cast<uint64_t>(own[r]);
    return o != 0 && o < static_cast<uint64_t>(v) && vis[o];  // 0: a free row
  };
  // the next visible row is found first and, when rows were skipped to reach it, its bytes are
  // requested while this one is scored: with rows skipped at random the hardware prefetcher alone
  // left the scan waiting on memory (a run of consecutive rows it follows by itself)
  int64_t r = 0;
  while (r < n && !visible(r)) r++;
  while (r < n) {
    int64_t next = r + 1;
    while (next < n && !visible(next)) next++;
    if (next < n && next > r + 1) {
      const char* p = reinterpret_cast<const char*>(e + next * d);
      for (int64_t b = 0; b < d * static_cast<int64_t>(sizeof(float)); b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
    }
    offer(best, k, Hit{dot4(e + r * d, q, d), r});
    r = next;
  }
  std::sort(best.begin(), best.end(), better);
  at::Tensor scores = at::empty({k}, query.options());
  at::Tensor rows = at::empty({k}, owners.options());
  float* s = scores.data_ptr<float>();
  int64_t* out = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < k; i++) {
    const bool have = i < static_cast<int64_t>(best.size());
    s[i] = have ? best[i].score : -std::numeric_limits<float>::infinity();
    out[i] = have ? best[i].row : -1;
  }
  return {scores, rows};
}

TORCH_LIBRARY(aotx_cpu, m) {
  m.def("linear_bf16(Tensor x, Tensor w) -> Tensor", &linear_bf16);
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor", &rms_norm);
  m.def("paged_decode_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_tables, Tensor lengths, "
        "int page_size, float scale) -> Tensor", &paged_decode_attention);
  m.def("masked_top_k(Tensor embeddings, Tensor owners, Tensor visibility, Tensor query, int k) -> (Tensor, Tensor)",
        &masked_top_k);
}
