// Decode attention for XLA:CPU: one query per row against its KV cache, and against a
// prefix of keys and values shared by a group of rows (GRPO's completions of one prompt).
//
// The same function as engine/ops/attention_reference.py's one-query path, in one pass per
// (row, kv head): scores in float32 from the cache's dtype, scaled, soft-capped, masked
// (-1e30), a softmax over prefix and own slots together (attention sinks in the
// denominator), probabilities rounded to the cache's dtype, the value sum accumulated in
// float32 and rounded once. XLA compiles the reference as two batched products per layer of
// (g x head_dim) . (head_dim x slots) matrices and the softmax around them; at decode sizes
// those products run far below the CPU's speed and read every slot of the cache, filled or
// not. Here slots past a row's last visible one are not read: their probability is exactly 0.
//
// Layouts (engine/models/kv_cache.py): q (b, k, g, h); keys (b, k, h, s), slot-minor;
// a bfloat16 cache may be stored as uint16 bits;
// values (b, k, s, h); mask (b, s). The shared prefix: keys (P, k, h, p), values (P, k, p, h),
// mask (P, p); row r reads prompt r / group. p = 0: no prefix. sinks (k, g), float32.

#include <string>

#include "common.h"

namespace ffi = xla::ffi;

namespace {

using namespace trainflow;
constexpr float kMasked = -1e30f;  // attention_reference.NEG_INF

// Scores of query heads [0, GB) of qf (rows of H) against slots [j, j + 16 * JB) of keys
// (H rows of `stride`), into out (rows of L). Each key vector is read once for all GB heads,
// and GB * JB independent sums keep the FMA units busy (one chain waits on its last FMA).
template <int GB, int JB, typename T>
inline void score_chunk(const float* qf, int64_t H, const T* keys, int64_t stride, int64_t j, float* out,
                        int64_t L) {
  f32x16 acc[GB][JB] = {};
  for (int64_t hh = 0; hh < H; ++hh) {
    const T* row = keys + hh * stride + j;
    f32x16 k[JB];
    for (int c = 0; c < JB; ++c) k[c] = load16(row + 16 * c);
    for (int u = 0; u < GB; ++u) {
      const float qv = qf[u * H + hh];
      for (int c = 0; c < JB; ++c) acc[u][c] += qv * k[c];
    }
  }
  for (int u = 0; u < GB; ++u)
    for (int c = 0; c < JB; ++c) store16(out + u * L + j + 16 * c, acc[u][c]);
}

// acc (GB rows of H) += p (GB rows of L, from `offset`) . values (n rows of H), over the
// head_dim lanes [d, d + 16 * DB).
template <int GB, int DB, typename T>
inline void value_chunk(const float* p, int64_t L, int64_t offset, const T* values, int64_t n, int64_t H,
                        int64_t d, float* acc) {
  f32x16 sum[GB][DB] = {};
  for (int64_t j = 0; j < n; ++j) {
    const T* row = values + j * H + d;
    f32x16 v[DB];
    for (int c = 0; c < DB; ++c) v[c] = load16(row + 16 * c);
    for (int u = 0; u < GB; ++u) {
      const float pj = p[u * L + offset + j];
      for (int c = 0; c < DB; ++c) sum[u][c] += pj * v[c];
    }
  }
  for (int u = 0; u < GB; ++u)
    for (int c = 0; c < DB; ++c) {
      float* a = acc + u * H + d + 16 * c;
      store16(a, load16(a) + sum[u][c]);
    }
}

template <int GB, typename T>
inline void score_heads(const float* q, int64_t H, const T* keys, int64_t stride, int64_t n16, float* o, int64_t L) {
  int64_t j = 0;
  for (; j + 64 <= n16; j += 64) score_chunk<GB, 4>(q, H, keys, stride, j, o, L);
  for (; j < n16; j += 16) score_chunk<GB, 1>(q, H, keys, stride, j, o, L);
}

template <typename T>
void scores_blocked(const float* qf, int64_t G, int64_t H, const T* keys, int64_t stride, int64_t n, float* out,
                    int64_t L) {
  const int64_t n16 = n - n % 16;
  for (int64_t g0 = 0; g0 < G; g0 += 3) {
    const float* q = qf + g0 * H;
    float* o = out + g0 * L;
    switch (std::min<int64_t>(3, G - g0)) {
      case 1: score_heads<1>(q, H, keys, stride, n16, o, L); break;
      case 2: score_heads<2>(q, H, keys, stride, n16, o, L); break;
      default: score_heads<3>(q, H, keys, stride, n16, o, L);
    }
  }
  for (int64_t gi = 0; gi < G; ++gi)  // the last n % 16 slots
    for (int64_t j = n16; j < n; ++j) {
      float s = 0.0f;
      for (int64_t hh = 0; hh < H; ++hh) s += qf[gi * H + hh] * to_f32(keys[hh * stride + j]);
      out[gi * L + j] = s;
    }
}

template <int GB, typename T>
inline void value_heads(const float* p, int64_t L, int64_t offset, const T* values, int64_t n, int64_t H, float* acc) {
  int64_t d = 0;
  for (; d + 64 <= H; d += 64) value_chunk<GB, 4>(p, L, offset, values, n, H, d, acc);
  for (; d < H; d += 16) value_chunk<GB, 1>(p, L, offset, values, n, H, d, acc);
}

template <typename T>
void values_blocked(const float* p, int64_t G, int64_t L, int64_t offset, const T* values, int64_t n, int64_t H,
                    float* acc) {
  if (H % 16) {
    for (int64_t j = 0; j < n; ++j)
      for (int64_t gi = 0; gi < G; ++gi)
        for (int64_t d = 0; d < H; ++d) acc[gi * H + d] += p[gi * L + offset + j] * to_f32(values[j * H + d]);
    return;
  }
  for (int64_t g0 = 0; g0 < G; g0 += 3) {
    switch (std::min<int64_t>(3, G - g0)) {
      case 1: value_heads<1>(p + g0 * L, L, offset, values, n, H, acc + g0 * H); break;
      case 2: value_heads<2>(p + g0 * L, L, offset, values, n, H, acc + g0 * H); break;
      default: value_heads<3>(p + g0 * L, L, offset, values, n, H, acc + g0 * H);
    }
  }
}

// r[0, n) (n % 16 == 0) <- softmax(r), with a sink logit in the denominator if `sinks`.
inline void softmax_row(float* r, int64_t n, bool sinks, float sink) {
  f32x16 top = f32x16{} - INFINITY;
  for (int64_t j = 0; j < n; j += 16) {
    const f32x16 x = load16(r + j);
    top = x > top ? x : top;
  }
  float m = sinks ? sink : -INFINITY;
  for (int u = 0; u < 16; ++u) m = std::max(m, top[u]);
  f32x16 total = {};
  for (int64_t j = 0; j < n; j += 16) {
    const f32x16 e = exp16(load16(r + j) - m);
    store16(r + j, e);
    total += e;
  }
  float sum = sinks ? exp16(f32x16{} + (sink - m))[0] : 0.0f;
  for (int u = 0; u < 16; ++u) sum += total[u];
  for (int64_t j = 0; j < n; j += 16) store16(r + j, load16(r + j) / sum);
}

struct Problem {
  int64_t rows, kv, g, h, s, p, group;
  float scale, softcap;
  bool sinks;
  const void *q, *k, *v, *kp, *vp;
  const bool *mask, *maskp;
  const float* sinks_kg;
  void* out;
};

// 1 + the last visible slot (0 if none).
inline int64_t visible_end(const bool* mask, int64_t n) {
  for (int64_t j = n; j > 0; --j)
    if (mask[j - 1]) return j;
  return 0;
}

template <typename T>
void attend(const Problem& pr, int64_t pair, std::vector<float>& scratch) {
  const int64_t b = pair / pr.kv, kk = pair % pr.kv, G = pr.g, H = pr.h, S = pr.s, P = pr.p;
  const int64_t prompt = P ? b / pr.group : 0;
  const bool* mask_own = pr.mask + b * S;
  const bool* mask_pre = P ? pr.maskp + prompt * P : nullptr;
  // Slots past the last visible one get probability exactly 0, unless nothing is visible
  // and there is no sink: then every slot gets the same weight (the reference's uniform row).
  int64_t n_pre = P ? visible_end(mask_pre, P) : 0, n_own = visible_end(mask_own, S);
  if (n_pre == 0 && n_own == 0 && !pr.sinks) n_pre = P, n_own = S;
  const int64_t L = n_pre + n_own, Lp = (L + 15) / 16 * 16;
  scratch.resize(size_t(G * H * 2 + G * std::max<int64_t>(Lp, 16)));
  float* qf = scratch.data();
  float* acc = qf + G * H;
  float* sc = acc + G * H;  // (G, Lp): prefix slots, then own slots, then padding

  const T* q = static_cast<const T*>(pr.q) + pair * G * H;
  for (int64_t i = 0; i < G * H; ++i) qf[i] = to_f32(q[i]);
  std::fill(acc, acc + G * H, 0.0f);

  const T* kp = static_cast<const T*>(pr.kp) + (prompt * pr.kv + kk) * H * P;
  const T* k = static_cast<const T*>(pr.k) + pair * H * S;
  if (n_pre) scores_blocked(qf, G, H, kp, P, n_pre, sc, Lp);
  if (n_own) scores_blocked(qf, G, H, k, S, n_own, sc + n_pre, Lp);

  for (int64_t gi = 0; gi < G; ++gi) {
    float* r = sc + gi * Lp;
    auto finish = [&](float* x, const bool* visible, int64_t n) {
      const uint8_t* seen = reinterpret_cast<const uint8_t*>(visible);
      for (int64_t j = 0; j < n; ++j) x[j] *= pr.scale;
      if (pr.softcap > 0.0f)
        for (int64_t j = 0; j < n; ++j) x[j] = pr.softcap * std::tanh(x[j] / pr.softcap);
      for (int64_t j = 0; j < n; ++j) x[j] = seen[j] ? x[j] : kMasked;
    };
    if (n_pre) finish(r, mask_pre, n_pre);
    if (n_own) finish(r + n_pre, mask_own, n_own);
    for (int64_t j = L; j < Lp; ++j) r[j] = -INFINITY;  // padding to whole vectors: probability 0
    softmax_row(r, Lp, pr.sinks, pr.sinks ? pr.sinks_kg[kk * G + gi] : 0.0f);
    for (int64_t j = 0; j < L; ++j) r[j] = to_f32(from_f32<T>(r[j]));  // rounded to v's dtype
  }

  if (n_pre) values_blocked(sc, G, Lp, 0, static_cast<const T*>(pr.vp) + (prompt * pr.kv + kk) * P * H, n_pre, H, acc);
  if (n_own) values_blocked(sc, G, Lp, n_pre, static_cast<const T*>(pr.v) + pair * S * H, n_own, H, acc);
  T* out = static_cast<T*>(pr.out) + pair * G * H;
  for (int64_t i = 0; i < G * H; ++i) out[i] = from_f32<T>(acc[i]);
}

template <typename T>
void run(const Problem& pr, ffi::ThreadPool& pool) {
  const int64_t work = pr.rows * pr.kv * (pr.s + pr.p) * pr.h * pr.g;
  parallel_for(pool, pr.rows * pr.kv, work, 8, [pr](int64_t i, std::vector<float>& scratch) { attend<T>(pr, i, scratch); });
}

ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                           ffi::Buffer<ffi::PRED> mask, ffi::AnyBuffer kp, ffi::AnyBuffer vp,
                           ffi::Buffer<ffi::PRED> maskp, ffi::Buffer<ffi::F32> sinks,
                           ffi::Result<ffi::AnyBuffer> out, float scale, float softcap, int64_t group,
                           int64_t has_sinks) {
  // A bfloat16 cache may come as its bits (uint16, engine/ops/attention.py: BF16_BITS).
  auto value_type = [](ffi::DataType t) { return t == ffi::DataType::U16 ? ffi::DataType::BF16 : t; };
  const auto type = q.element_type();
  if (type != ffi::DataType::F32 && type != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument("decode attention takes float32 or bfloat16");
  for (const ffi::AnyBuffer* x : {&k, &v, &kp, &vp})
    if (value_type(x->element_type()) != type)
      return ffi::Error::InvalidArgument("decode attention: q, keys and values differ in dtype");
  if (out->element_type() != type) return ffi::Error::InvalidArgument("decode attention: output of another dtype");
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), md = mask.dimensions();
  auto kpd = kp.dimensions(), vpd = vp.dimensions(), mpd = maskp.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4 || md.size() != 2 || kpd.size() != 4 ||
      vpd.size() != 4 || mpd.size() != 2)
    return ffi::Error::InvalidArgument("decode attention: operands of the wrong rank");
  Problem pr;
  pr.rows = qd[0], pr.kv = qd[1], pr.g = qd[2], pr.h = qd[3], pr.s = kd[3], pr.p = kpd[3];
  pr.group = group;
  const bool ok = kd[0] == pr.rows && kd[1] == pr.kv && kd[2] == pr.h && vd[0] == pr.rows && vd[1] == pr.kv &&
                  vd[2] == pr.s && vd[3] == pr.h && md[0] == pr.rows && md[1] == pr.s &&
                  (pr.p == 0 || (group > 0 && pr.rows % group == 0 && kpd[0] == pr.rows / group &&
                                 kpd[1] == pr.kv && kpd[2] == pr.h && vpd[0] == kpd[0] && vpd[1] == pr.kv &&
                                 vpd[2] == pr.p && vpd[3] == pr.h && mpd[0] == kpd[0] && mpd[1] == pr.p)) &&
                  (!has_sinks || sinks.element_count() == pr.kv * pr.g);
  if (!ok) return ffi::Error::InvalidArgument("decode attention: operand shapes do not agree");
  pr.scale = scale, pr.softcap = softcap, pr.sinks = has_sinks != 0;
  pr.q = q.untyped_data(), pr.k = k.untyped_data(), pr.v = v.untyped_data();
  pr.kp = kp.untyped_data(), pr.vp = vp.untyped_data();
  pr.mask = mask.typed_data(), pr.maskp = maskp.typed_data(), pr.sinks_kg = sinks.typed_data();
  pr.out = out->untyped_data();
  if (type == ffi::DataType::F32)
    run<float>(pr, pool);
  else
    run<bf16>(pr, pool);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TrainflowDecodeAttention, DecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap")
                                  .Attr<int64_t>("group")
                                  .Attr<int64_t>("has_sinks"));
