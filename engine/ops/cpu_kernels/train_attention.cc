// Causal grouped-query attention for training on XLA:CPU, forward and backward, one pass per
// (row, kv head): the function of engine/ops/attention_blocked.py without its float32
// score-sized tensors in memory.
//
// XLA compiles the blocked attention into dozens of operations per layer that write and read
// float32 score blocks (scores, masks, exponentials, probabilities and their gradients, each
// converted to and from bfloat16). Here a (row, kv head) pair's queries, keys and values are
// unpacked once into float32 scratch that stays in the CPU's caches, and every product, the
// mask and the softmax of a block of 32 query positions run back to back on it.
//
// Layouts: q (b, t, n, h) with n = kv * g (query head kk * g + i belongs to kv head kk);
// k, v (b, t, kv, h); segment ids (b, t), int32, 0 = padding; the output (b, t, n, h) and
// the row log-sum-exp lse (b, kv, t, g), float32. Query i sees key j iff j <= i, both carry
// the same non-zero segment id and, with a window w > 0, i - j < w. A query that sees no key
// gets output 0 and lse +inf (so its probabilities are 0 in the backward pass).
//
// Each block's softmax sees all of its keys at once (no online rescaling). Probabilities are
// rounded to the inputs' dtype before the value product, and the denominator sums the
// rounded values, as the blocked implementation does; all sums are float32.

#include "common.h"

namespace ffi = xla::ffi;

namespace {

using namespace trainflow;

constexpr int64_t kBlock = 32;  // query positions per block; keys are processed in tiles of 32

// out[u][j0 + c] = sum_d a[u][d] * bt[d][j0 + c] for u < R rows (a: rows of lda), 32 columns
// from j0 (bt: H rows of ldb, float32), into out (rows of ldo).
template <int R>
inline void nt_tile(const float* a, int64_t lda, const float* bt, int64_t ldb, int64_t H, int64_t j0, float* out,
                    int64_t ldo) {
  f32x16 acc[R][2] = {};
  for (int64_t d = 0; d < H; ++d) {
    const f32x16 b0 = load16(bt + d * ldb + j0), b1 = load16(bt + d * ldb + j0 + 16);
    for (int u = 0; u < R; ++u) {
      const float x = a[u * lda + d];
      acc[u][0] += x * b0;
      acc[u][1] += x * b1;
    }
  }
  for (int u = 0; u < R; ++u) {
    store16(out + u * ldo + j0, acc[u][0]);
    store16(out + u * ldo + j0 + 16, acc[u][1]);
  }
}

// out (rows x n32, n32 % 32 == 0) = a (rows x H) . bt (H x n32).
inline void nt(const float* a, int64_t lda, int64_t rows, const float* bt, int64_t ldb, int64_t H, int64_t n32,
               float* out, int64_t ldo) {
  for (int64_t j0 = 0; j0 < n32; j0 += 32) {
    int64_t r = 0;
    for (; r + 6 <= rows; r += 6) nt_tile<6>(a + r * lda, lda, bt, ldb, H, j0, out + r * ldo, ldo);
    switch (rows - r) {
      case 5: nt_tile<5>(a + r * lda, lda, bt, ldb, H, j0, out + r * ldo, ldo); break;
      case 4: nt_tile<4>(a + r * lda, lda, bt, ldb, H, j0, out + r * ldo, ldo); break;
      case 3: nt_tile<3>(a + r * lda, lda, bt, ldb, H, j0, out + r * ldo, ldo); break;
      case 2: nt_tile<2>(a + r * lda, lda, bt, ldb, H, j0, out + r * ldo, ldo); break;
      case 1: nt_tile<1>(a + r * lda, lda, bt, ldb, H, j0, out + r * ldo, ldo); break;
      default: break;
    }
  }
}

// c[u][d0 + 16 * i] += sum_x a(u, x) * b[x][d0 + 16 * i] for u < R, i < DB, x < n, where
// a(u, x) = a[u * su + x * sx]: the plain product (su = row stride, sx = 1) or, with the
// strides swapped, the product with a's transpose.
template <int R, int DB>
inline void acc_tile(const float* a, int64_t su, int64_t sx, int64_t n, const float* b, int64_t ldb, int64_t d0,
                     float* c, int64_t ldc) {
  f32x16 acc[R][DB] = {};
  for (int64_t x = 0; x < n; ++x) {
    f32x16 bv[DB];
    for (int i = 0; i < DB; ++i) bv[i] = load16(b + x * ldb + d0 + 16 * i);
    for (int u = 0; u < R; ++u) {
      const float s = a[u * su + x * sx];
      for (int i = 0; i < DB; ++i) acc[u][i] += s * bv[i];
    }
  }
  for (int u = 0; u < R; ++u)
    for (int i = 0; i < DB; ++i) {
      float* p = c + u * ldc + d0 + 16 * i;
      store16(p, load16(p) + acc[u][i]);
    }
}

template <int R>
inline void acc_rows(const float* a, int64_t su, int64_t sx, int64_t n, const float* b, int64_t ldb, int64_t H,
                     float* c, int64_t ldc) {
  int64_t d0 = 0;
  for (; d0 + 64 <= H; d0 += 64) acc_tile<R, 4>(a, su, sx, n, b, ldb, d0, c, ldc);
  switch ((H - d0) / 16) {
    case 3: acc_tile<R, 3>(a, su, sx, n, b, ldb, d0, c, ldc); break;
    case 2: acc_tile<R, 2>(a, su, sx, n, b, ldb, d0, c, ldc); break;
    case 1: acc_tile<R, 1>(a, su, sx, n, b, ldb, d0, c, ldc); break;
    default: break;
  }
}

// c (m x H) += A . b, A (m x n) given as a(u, x) = a[u * su + x * sx]; b (n x H), H % 16 == 0.
inline void acc(const float* a, int64_t su, int64_t sx, int64_t m, int64_t n, const float* b, int64_t ldb, int64_t H,
                float* c, int64_t ldc) {
  int64_t u = 0;
  for (; u + 6 <= m; u += 6) acc_rows<6>(a + u * su, su, sx, n, b, ldb, H, c + u * ldc, ldc);
  switch (m - u) {
    case 5: acc_rows<5>(a + u * su, su, sx, n, b, ldb, H, c + u * ldc, ldc); break;
    case 4: acc_rows<4>(a + u * su, su, sx, n, b, ldb, H, c + u * ldc, ldc); break;
    case 3: acc_rows<3>(a + u * su, su, sx, n, b, ldb, H, c + u * ldc, ldc); break;
    case 2: acc_rows<2>(a + u * su, su, sx, n, b, ldb, H, c + u * ldc, ldc); break;
    case 1: acc_rows<1>(a + u * su, su, sx, n, b, ldb, H, c + u * ldc, ldc); break;
    default: break;
  }
}

struct Problem {
  int64_t b, t, n, kv, g, h, window;
  float scale;
  const void *q, *k, *v, *out, *dout;
  const int32_t* seg;
  const float* lse_in;
  void *o, *dq, *dk, *dv;
  float* lse;
};

// The pair's scratch: rows r = i * g + gi (position-major), keys padded to tp (a multiple of 32).
struct Scratch {
  float *q, *kt, *k, *vt, *v, *s, *p2, *o, *do_, *dq, *dk, *dv, *delta;
};

template <typename T>
void unpack_rows(const T* x, int64_t t, int64_t stride, int64_t width, float* out) {  // (t, width) rows of `stride`
  for (int64_t i = 0; i < t; ++i)
    for (int64_t d = 0; d < width; ++d) out[i * width + d] = to_f32(x[i * stride + d]);
}

template <typename T>
void unpack_transposed(const T* x, int64_t t, int64_t tp, int64_t stride, int64_t H, float* out) {  // (H, tp)
  for (int64_t d = 0; d < H; ++d) {
    for (int64_t j = 0; j < t; ++j) out[d * tp + j] = to_f32(x[j * stride + d]);
    for (int64_t j = t; j < tp; ++j) out[d * tp + j] = 0.0f;
  }
}

// The keys block [i0, i1) of queries may see: [k0, k1), k0 a multiple of 32, k1 - k0 too.
inline void key_range(const Problem& pr, int64_t i0, int64_t i1, int64_t* k0, int64_t* k1) {
  const int64_t first = pr.window > 0 ? std::max<int64_t>(0, i0 - pr.window + 1) : 0;
  *k0 = first / 32 * 32;
  *k1 = (i1 + 31) / 32 * 32;
}

// The keys query i may see. With segments in contiguous runs (packing: each id in one run,
// `runs` true) they are the interval [lo, i]; otherwise each key's id is checked.
struct Visibility {
  const int32_t* seg;
  const int32_t* run_start;  // run_start[i]: the first position of i's run of equal ids
  bool runs;
  int64_t window;

  bool sees(int64_t i, int64_t j) const {
    return j <= i && seg[i] != 0 && seg[j] == seg[i] && (window <= 0 || i - j < window);
  }
  int64_t first(int64_t i) const {  // the interval's start (runs only)
    return window > 0 ? std::max<int64_t>(run_start[i], i - window + 1) : run_start[i];
  }
};

// run_start for seg[0, t) into `start`; whether every id != 0 occupies one run.
inline bool segment_runs(const int32_t* seg, int64_t t, int32_t* start) {
  bool runs = true;
  for (int64_t i = 0; i < t; ++i) start[i] = i > 0 && seg[i] == seg[i - 1] ? start[i - 1] : int32_t(i);
  for (int64_t i = 1; i < t && runs; ++i)
    if (seg[i] != seg[i - 1] && seg[i] != 0)
      for (int64_t j = 0; j < i; ++j)
        if (seg[j] == seg[i]) {
          runs = false;
          break;
        }
  return runs;
}

// Row i's scores s[0, kn) for keys from k0 -> exp(scale * s - shift) for visible keys, else 0
// (rounded to T), where shift is the row's maximum (forward: returns the log-sum-exp, +inf
// when nothing is visible) or the given lse (backward: returns it).
template <typename T>
float probabilities(const Problem& pr, const Visibility& vis, int64_t i, int64_t k0, int64_t kn, float* s,
                    bool forward, float lse, float* total_out) {
  if (vis.seg[i] == 0) {
    std::fill(s, s + kn, 0.0f);
    *total_out = 0.0f;
    return INFINITY;
  }
  if (vis.runs) {
    const int64_t lo = std::max<int64_t>(vis.first(i) - k0, 0), hi = std::min<int64_t>(i - k0 + 1, kn);
    for (int64_t x = 0; x < lo; ++x) s[x] = -INFINITY;
    for (int64_t x = lo; x < hi; ++x) s[x] *= pr.scale;
    for (int64_t x = hi; x < kn; ++x) s[x] = -INFINITY;
  } else {
    for (int64_t x = 0; x < kn; ++x) s[x] = vis.sees(i, k0 + x) ? s[x] * pr.scale : -INFINITY;
  }
  float shift = lse;
  if (forward) {
    f32x16 top = f32x16{} - INFINITY;
    for (int64_t x = 0; x < kn; x += 16) {
      const f32x16 y = load16(s + x);
      top = y > top ? y : top;
    }
    shift = -INFINITY;
    for (int u = 0; u < 16; ++u) shift = std::max(shift, top[u]);
    if (shift == -INFINITY) {
      std::fill(s, s + kn, 0.0f);
      *total_out = 0.0f;
      return INFINITY;
    }
  }
  f32x16 total = {};
  for (int64_t x = 0; x < kn; x += 16) {
    const f32x16 e = round16<T>(exp16(load16(s + x) - shift));
    store16(s + x, e);
    total += e;
  }
  float sum = 0.0f;
  for (int u = 0; u < 16; ++u) sum += total[u];
  *total_out = sum;
  return forward ? shift + std::log(sum) : lse;
}

template <typename T>
void forward(const Problem& pr, int64_t pair, std::vector<float>& buf) {
  const int64_t bi = pair / pr.kv, kk = pair % pr.kv, t = pr.t, g = pr.g, H = pr.h, rows = t * g;
  const int64_t tp = (t + 31) / 32 * 32, bq = kBlock * g;
  buf.resize(size_t(rows * H + H * tp + tp * H + bq * tp + bq * H + t));
  float *q = buf.data(), *kt = q + rows * H, *v = kt + H * tp, *s = v + tp * H, *o = s + bq * tp;
  int32_t* run_start = reinterpret_cast<int32_t*>(o + bq * H);
  const T* qb = static_cast<const T*>(pr.q) + (bi * t * pr.n + kk * g) * H;
  const T* kb = static_cast<const T*>(pr.k) + (bi * t * pr.kv + kk) * H;
  const T* vb = static_cast<const T*>(pr.v) + (bi * t * pr.kv + kk) * H;
  for (int64_t i = 0; i < t; ++i)
    for (int64_t x = 0; x < g * H; ++x) q[i * g * H + x] = to_f32(qb[i * pr.n * H + x]);
  unpack_transposed(kb, t, tp, pr.kv * H, H, kt);
  unpack_rows(vb, t, pr.kv * H, H, v);
  std::fill(v + t * H, v + tp * H, 0.0f);
  const int32_t* seg = pr.seg + bi * t;
  const Visibility vis{seg, run_start, segment_runs(seg, t, run_start), pr.window};
  float* lse = pr.lse + pair * rows;
  T* out = static_cast<T*>(pr.o) + (bi * t * pr.n + kk * g) * H;

  for (int64_t i0 = 0; i0 < t; i0 += kBlock) {
    const int64_t i1 = std::min(t, i0 + kBlock), m = (i1 - i0) * g;
    int64_t k0, k1;
    key_range(pr, i0, i1, &k0, &k1);
    const int64_t kn = k1 - k0;
    nt(q + i0 * g * H, H, m, kt + k0, tp, H, kn, s, tp);
    float denominator[kBlock * 8];  // m <= kBlock * g, g <= 8 (checked by the handler)
    for (int64_t r = 0; r < m; ++r) {
      float* row = s + r * tp;
      lse[i0 * g + r] = probabilities<T>(pr, vis, i0 + r / g, k0, kn, row, true, 0.0f, &denominator[r]);
    }
    std::fill(o, o + m * H, 0.0f);
    acc(s, tp, 1, m, kn, v + k0 * H, H, H, o, H);
    for (int64_t r = 0; r < m; ++r) {
      const float sum = denominator[r];
      const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
      T* dst = out + ((i0 + r / g) * pr.n + r % g) * H;
      for (int64_t d = 0; d < H; ++d) dst[d] = from_f32<T>(o[r * H + d] * inv);
    }
  }
}

template <typename T>
void backward(const Problem& pr, int64_t pair, std::vector<float>& buf) {
  const int64_t bi = pair / pr.kv, kk = pair % pr.kv, t = pr.t, g = pr.g, H = pr.h, rows = t * g;
  const int64_t tp = (t + 31) / 32 * 32, bq = kBlock * g;
  buf.resize(size_t(3 * rows * H + 2 * H * tp + 4 * tp * H + 2 * bq * tp + rows + t));
  float *q = buf.data(), *dout = q + rows * H, *dq = dout + rows * H, *kt = dq + rows * H, *vt = kt + H * tp;
  float *k = vt + H * tp, *v = k + tp * H, *dk = v + tp * H, *dv = dk + tp * H, *p = dv + tp * H;
  float *ds = p + bq * tp, *delta = ds + bq * tp;
  int32_t* run_start = reinterpret_cast<int32_t*>(delta + rows);
  const int64_t qoff = (bi * t * pr.n + kk * g) * H, koff = (bi * t * pr.kv + kk) * H;
  const T *qb = static_cast<const T*>(pr.q) + qoff, *ob = static_cast<const T*>(pr.out) + qoff;
  const T* dob = static_cast<const T*>(pr.dout) + qoff;
  const T *kb = static_cast<const T*>(pr.k) + koff, *vb = static_cast<const T*>(pr.v) + koff;
  for (int64_t i = 0; i < t; ++i)
    for (int64_t x = 0; x < g * H; ++x) {
      q[i * g * H + x] = to_f32(qb[i * pr.n * H + x]);
      dout[i * g * H + x] = to_f32(dob[i * pr.n * H + x]);
    }
  for (int64_t r = 0; r < rows; ++r) {  // delta = rowsum(dO * O)
    const int64_t i = r / g, gi = r % g;
    float sum = 0.0f;
    for (int64_t d = 0; d < H; ++d) sum += dout[r * H + d] * to_f32(ob[(i * pr.n + gi) * H + d]);
    delta[r] = sum;
  }
  unpack_transposed(kb, t, tp, pr.kv * H, H, kt);
  unpack_transposed(vb, t, tp, pr.kv * H, H, vt);
  unpack_rows(kb, t, pr.kv * H, H, k);
  std::fill(k + t * H, k + tp * H, 0.0f);
  std::fill(dq, dq + rows * H, 0.0f);
  std::fill(dk, dk + tp * H, 0.0f);
  std::fill(dv, dv + tp * H, 0.0f);
  const int32_t* seg = pr.seg + bi * t;
  const Visibility vis{seg, run_start, segment_runs(seg, t, run_start), pr.window};
  const float* lse = pr.lse_in + pair * rows;

  for (int64_t i0 = 0; i0 < t; i0 += kBlock) {
    const int64_t i1 = std::min(t, i0 + kBlock), m = (i1 - i0) * g, r0 = i0 * g;
    int64_t k0, k1;
    key_range(pr, i0, i1, &k0, &k1);
    const int64_t kn = k1 - k0;
    nt(q + r0 * H, H, m, kt + k0, tp, H, kn, p, tp);              // scores
    nt(dout + r0 * H, H, m, vt + k0, tp, H, kn, ds, tp);          // dP = dO . V^T
    for (int64_t r = 0; r < m; ++r) {
      float* pr_row = p + r * tp;
      float* ds_row = ds + r * tp;
      float unused;
      probabilities<T>(pr, vis, i0 + r / g, k0, kn, pr_row, false, lse[r0 + r], &unused);
      const f32x16 dl = f32x16{} + delta[r0 + r];
      for (int64_t x = 0; x < kn; x += 16)  // dS = P * (dP - delta) * scale, P as rounded for dV
        store16(ds_row + x, load16(pr_row + x) * (load16(ds_row + x) - dl) * pr.scale);
    }
    acc(p, 1, tp, kn, m, dout + r0 * H, H, H, dv + k0 * H, H);    // dV += P^T . dO
    acc(ds, 1, tp, kn, m, q + r0 * H, H, H, dk + k0 * H, H);      // dK += dS^T . Q
    acc(ds, tp, 1, m, kn, k + k0 * H, H, H, dq + r0 * H, H);      // dQ += dS . K
  }
  T* dqb = static_cast<T*>(pr.dq) + qoff;
  T *dkb = static_cast<T*>(pr.dk) + koff, *dvb = static_cast<T*>(pr.dv) + koff;
  for (int64_t i = 0; i < t; ++i) {
    for (int64_t x = 0; x < g * H; ++x) dqb[i * pr.n * H + x] = from_f32<T>(dq[i * g * H + x]);
    for (int64_t d = 0; d < H; ++d) {
      dkb[i * pr.kv * H + d] = from_f32<T>(dk[i * H + d]);
      dvb[i * pr.kv * H + d] = from_f32<T>(dv[i * H + d]);
    }
  }
}

ffi::Error check(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                 const ffi::Buffer<ffi::S32>& seg, Problem* pr) {
  const auto type = q.element_type();
  if (type != ffi::DataType::F32 && type != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument("train attention takes float32 or bfloat16");
  if (k.element_type() != type || v.element_type() != type)
    return ffi::Error::InvalidArgument("train attention: q, k and v differ in dtype");
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), sd = seg.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4 || sd.size() != 2)
    return ffi::Error::InvalidArgument("train attention: operands of the wrong rank");
  pr->b = qd[0], pr->t = qd[1], pr->n = qd[2], pr->h = qd[3], pr->kv = kd[2];
  const bool ok = pr->kv > 0 && pr->n % pr->kv == 0 && kd[0] == pr->b && kd[1] == pr->t && kd[3] == pr->h &&
                  vd[0] == pr->b && vd[1] == pr->t && vd[2] == pr->kv && vd[3] == pr->h && sd[0] == pr->b &&
                  sd[1] == pr->t && pr->h % 16 == 0 && pr->n / pr->kv <= 8;
  if (!ok) return ffi::Error::InvalidArgument("train attention: operand shapes do not agree or are not supported");
  pr->g = pr->n / pr->kv;
  return ffi::Error::Success();
}

ffi::Error Forward(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                   ffi::Buffer<ffi::S32> seg, ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::F32>> lse,
                   float scale, int64_t window) {
  Problem pr{};
  if (auto e = check(q, k, v, seg, &pr); e.failure()) return e;
  if (out->element_type() != q.element_type() || int64_t(lse->element_count()) != pr.b * pr.t * pr.n)
    return ffi::Error::InvalidArgument("train attention: results of the wrong type or size");
  pr.scale = scale, pr.window = window;
  pr.q = q.untyped_data(), pr.k = k.untyped_data(), pr.v = v.untyped_data(), pr.seg = seg.typed_data();
  pr.o = out->untyped_data(), pr.lse = lse->typed_data();
  const int64_t work = pr.b * pr.n * pr.t * pr.t * pr.h;
  if (q.element_type() == ffi::DataType::F32)
    parallel_for(pool, pr.b * pr.kv, work, 4, [pr](int64_t i, std::vector<float>& s) { forward<float>(pr, i, s); });
  else
    parallel_for(pool, pr.b * pr.kv, work, 4, [pr](int64_t i, std::vector<float>& s) { forward<bf16>(pr, i, s); });
  return ffi::Error::Success();
}

ffi::Error Backward(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                    ffi::Buffer<ffi::S32> seg, ffi::AnyBuffer out, ffi::Buffer<ffi::F32> lse, ffi::AnyBuffer dout,
                    ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                    float scale, int64_t window) {
  Problem pr{};
  if (auto e = check(q, k, v, seg, &pr); e.failure()) return e;
  const auto type = q.element_type();
  if (out.element_type() != type || dout.element_type() != type || dq->element_type() != type ||
      dk->element_type() != type || dv->element_type() != type || int64_t(lse.element_count()) != pr.b * pr.t * pr.n ||
      out.element_count() != q.element_count() || dout.element_count() != q.element_count())
    return ffi::Error::InvalidArgument("train attention backward: operands of the wrong type or size");
  pr.scale = scale, pr.window = window;
  pr.q = q.untyped_data(), pr.k = k.untyped_data(), pr.v = v.untyped_data(), pr.seg = seg.typed_data();
  pr.out = out.untyped_data(), pr.lse_in = lse.typed_data(), pr.dout = dout.untyped_data();
  pr.dq = dq->untyped_data(), pr.dk = dk->untyped_data(), pr.dv = dv->untyped_data();
  const int64_t work = pr.b * pr.n * pr.t * pr.t * pr.h;
  if (type == ffi::DataType::F32)
    parallel_for(pool, pr.b * pr.kv, work, 4, [pr](int64_t i, std::vector<float>& s) { backward<float>(pr, i, s); });
  else
    parallel_for(pool, pr.b * pr.kv, work, 4, [pr](int64_t i, std::vector<float>& s) { backward<bf16>(pr, i, s); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TrainflowTrainAttentionForward, Forward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("window"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(TrainflowTrainAttentionBackward, Backward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("window"));
