// AVX2 helpers shared by cpu_ops.cpp and recall_scan.cpp (the two sources of torch.ops.aotx_cpu).
#pragma once

#include <immintrin.h>

// the sum of a vector's eight floats
static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
