// Memory recall's scan (torch.ops.aotx_cpu.masked_top_k), built into the same library as the engine's
// CPU operators (cpu_ops.py builds cpu_ops.cpp and this file together); gpu_worker/memory/recall.py
// calls it, docs/memory.md ("Recall") says what it answers.
//
//   masked_top_k(embeddings, owners, visibility, query, k)
//                            the k best inner products with one query over the rows whose owner the
//                            visibility table admits, best first, padded with -inf and -1
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

#include "simd.h"

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
// second thread's wake-up (docs/performance.md, "Memory: recall and embeddings").
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

TORCH_LIBRARY_FRAGMENT(aotx_cpu, m) {
  m.def("masked_top_k(Tensor embeddings, Tensor owners, Tensor visibility, Tensor query, int k) -> (Tensor, Tensor)",
        &masked_top_k);
}
