// Helpers shared by the CPU kernels: bfloat16 <-> float32, 16-lane float32 vectors, a
// vectorised exp, and running a kernel's independent pieces on XLA's intra-op thread pool.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace trainflow {

namespace ffi = xla::ffi;

using bf16 = uint16_t;

inline float to_f32(float x) { return x; }
inline float to_f32(bf16 x) {
  const uint32_t bits = uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

template <typename T> inline T from_f32(float x);
template <> inline float from_f32<float>(float x) { return x; }
template <> inline bf16 from_f32<bf16>(float x) {  // round to nearest even, as XLA's convert
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return bf16((bits >> 16) | 0x40u);  // NaN stays a (quiet) NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return bf16(bits >> 16);
}

// 16 float32 lanes in GCC/Clang vector extensions: the compiler lowers them to the CPU's
// widest vectors (one AVX-512 register, two AVX2 ones, ...).
typedef float f32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));

inline f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline f32x16 load16(const bf16* p) {
  u16x16 h;
  std::memcpy(&h, p, sizeof h);
  const u32x16 bits = __builtin_convertvector(h, u32x16) << 16;
  f32x16 v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}
inline void store16(float* p, f32x16 v) { std::memcpy(p, &v, sizeof v); }

// 16 lanes as T would hold them (bfloat16: rounded to nearest even; the inputs are finite).
template <typename T> inline f32x16 round16(f32x16 x);
template <> inline f32x16 round16<float>(f32x16 x) { return x; }
template <> inline f32x16 round16<bf16>(f32x16 x) {
  u32x16 bits;
  std::memcpy(&bits, &x, sizeof bits);
  bits = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

// e^x for x <= 0 on 16 lanes: Cephes expf's range reduction (n rounded to nearest by the
// 1.5 * 2^23 trick) and polynomial, ~1 ulp; 0 below -87 (e^-87 is near float32's smallest
// normal), so -inf -> 0.
inline f32x16 exp16(f32x16 x) {
  const f32x16 xc = x < -87.0f ? f32x16{} - 87.0f : x;
  const f32x16 n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const f32x16 r = xc - n * 0.693359375f + n * 2.12194440e-4f;
  f32x16 p = f32x16{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const f32x16 y = p * r * r + r + 1.0f;
  const i32x16 exponent = (__builtin_convertvector(n, i32x16) + 127) << 23;
  f32x16 scale;
  std::memcpy(&scale, &exponent, sizeof scale);
  return x < -87.0f ? f32x16{} : y * scale;
}

// body(i, scratch) for i in [0, n), claimed in chunks by this thread and by helpers scheduled
// on XLA's intra-op pool; a helper that starts after every chunk is claimed returns at once.
// Runs on this thread alone when the pool has one thread or `work` (a size estimate) is small.
template <typename Body>
void parallel_for(ffi::ThreadPool& pool, int64_t n, int64_t work, int64_t chunks_per_thread, Body body) {
  const int64_t threads = std::min<int64_t>(pool.num_threads(), n);
  if (threads <= 1 || work < (int64_t(1) << 19)) {
    std::vector<float> scratch;
    for (int64_t i = 0; i < n; ++i) body(i, scratch);
    return;
  }
  struct Shared {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto shared = std::make_shared<Shared>();
  const int64_t chunk = std::max<int64_t>(1, n / (threads * chunks_per_thread));
  const int64_t chunks = (n + chunk - 1) / chunk;
  auto worker = [shared, body, chunk, chunks, n]() {
    std::vector<float> scratch;
    for (int64_t c; (c = shared->next.fetch_add(1)) < chunks;) {
      for (int64_t i = c * chunk; i < std::min(n, (c + 1) * chunk); ++i) body(i, scratch);
      shared->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t t = 1; t < threads; ++t) pool.Schedule(decltype(worker)(worker));
  worker();
  while (shared->done.load(std::memory_order_acquire) < chunks) std::this_thread::yield();
}

}  // namespace trainflow
