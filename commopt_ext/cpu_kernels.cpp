// Native CPU kernels for commopt (C ABI, loaded through ctypes by commopt/kernels.py).
//
// Every function here must write the same bits as the plain-torch specification in
// commopt/_reference_kernels.py; tests/unit/test_kernels_native.py checks that with
// hypothesis. That rules out anything that changes floating-point results: no fast-math,
// no contraction of a*b+c into FMA (pragma below, so -march=native builds stay identical),
// and the same order of operations as the reference.
//
// Hot loops are written so the compiler auto-vectorises them (no intrinsics) and are
// compiled for several ISAs with target_clones; the loader picks one at run time, so the
// library runs on any x86-64. Work is split over OpenMP threads by groups of whole buckets
// whose codes start on a byte boundary, so threads never share an output byte, and the
// counter-based random numbers make the result independent of the split.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(COMMOPT_NO_CLONES)
#define COMMOPT_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define COMMOPT_CLONES
#endif

namespace {

constexpr int64_t kBlock = 1024;          // codes staged per block (fits L1 with its input)
constexpr int64_t kGroupTarget = 4096;    // elements per unit of thread work
constexpr int64_t kParallelMin = 1 << 15; // below this many elements one thread is faster

inline uint32_t f2u(float f) { return __builtin_bit_cast(uint32_t, f); }
inline float u2f(uint32_t u) { return __builtin_bit_cast(float, u); }

// ---------------------------------------------------------------- random numbers
// 32-bit finaliser ("lowbias32" constants); two rounds keyed by (k0, k1) per element index.
inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}
inline uint32_t rand_word(uint32_t index, uint32_t k0, uint32_t k1) {
  return mix32(mix32(index + k0) ^ k1);
}

// ---------------------------------------------------------------- half precision
// float -> IEEE half, round to nearest even; NaN -> quiet NaN 0x7E00 with the sign kept.
// Every case is computed and one selected, so loops over it vectorise.
inline uint16_t f32_to_f16(float f) {
  const uint32_t w = f2u(f);
  const uint32_t sign = (w >> 16) & 0x8000u;
  const uint32_t a = w & 0x7FFFFFFFu;
  // normal half: rebias the exponent (127 -> 15) and round 13 mantissa bits away
  const uint32_t m = a - 0x38000000u;
  const uint32_t normal = (m + 0x0FFFu + ((m >> 13) & 1u)) >> 13;
  // subnormal half (or zero): the value times 2^24, rounded to an integer
  int32_t shift = 126 - static_cast<int32_t>(a >> 23);
  shift = shift < 1 ? 1 : (shift > 31 ? 31 : shift);
  const uint32_t mant = (a & 0x7FFFFFu) | 0x800000u;
  const uint32_t sub = (mant + (1u << (shift - 1)) - 1u + ((mant >> shift) & 1u)) >> shift;
  uint32_t h = a >= 0x38800000u ? normal : sub;
  h = a >= 0x477FF000u ? 0x7C00u : h;  // >= 65520 rounds to infinity
  h = a > 0x7F800000u ? 0x7E00u : h;
  return static_cast<uint16_t>(sign | h);
}

inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1Fu;
  const uint32_t m = h & 0x3FFu;
  const uint32_t normal = ((e + 112u) << 23) | (m << 13);
  const uint32_t special = 0x7F800000u | (m << 13);
  const uint32_t sub = f2u(static_cast<float>(static_cast<int32_t>(m)) * 0x1p-24f);  // exact
  // masks instead of branches so the compiler vectorises loops over this
  const uint32_t is_special = 0u - static_cast<uint32_t>(e == 0x1Fu);
  const uint32_t is_sub = 0u - static_cast<uint32_t>(e == 0u);
  const uint32_t bits = (special & is_special) | (sub & is_sub) | (normal & ~(is_special | is_sub));
  return u2f(sign | bits);
}

// float -> bfloat16, round to nearest even; NaN -> 0x7FC0 with the sign kept.
inline uint16_t f32_to_bf16(float f) {
  const uint32_t w = f2u(f);
  const uint32_t rounded = (w + 0x7FFFu + ((w >> 16) & 1u)) >> 16;
  const uint32_t nan = ((w >> 16) & 0x8000u) | 0x7FC0u;
  return static_cast<uint16_t>((w & 0x7FFFFFFFu) > 0x7F800000u ? nan : rounded);
}

// ---------------------------------------------------------------- QSGD
struct QsgdArgs {
  int64_t n;
  int bits, levels, bucket, norm_l2, stochastic, scale_bytes;
  uint32_t k0, k1;
  float scale;  // encode: input multiplier; decode: alpha
  int accumulate;
};

int64_t gcd64(int64_t a, int64_t b) {
  while (b) {
    int64_t t = a % b;
    a = b;
    b = t;
  }
  return a;
}

// Elements per unit of work: whole buckets, codes starting on a byte boundary.
int64_t group_size(int64_t bucket, int bits) {
  int64_t per_byte = 8 / bits;
  int64_t base = bucket / gcd64(bucket, per_byte) * per_byte;
  int64_t reps = kGroupTarget / base;
  return base * (reps > 1 ? reps : 1);
}

int64_t pow2_at_least(int64_t v) {
  int64_t w = 1;
  while (w < v) w *= 2;
  return w;
}

// Max of |x * scale| via the bit patterns: exact, and NaN (sorting above Inf) propagates.
COMMOPT_CLONES
float norm_max(const float* x, int64_t len, float scale) {
  uint32_t m = 0;
  for (int64_t i = 0; i < len; ++i) {
    uint32_t b = f2u(x[i] * scale) & 0x7FFFFFFFu;
    m = b > m ? b : m;
  }
  return u2f(m);
}

// l2 norm: exact float64 squares, summed by a pairwise tree over a power-of-two width.
COMMOPT_CLONES
float norm_l2(const float* x, int64_t len, float scale, double* buf, int64_t width) {
  for (int64_t i = 0; i < len; ++i) {
    double y = static_cast<double>(x[i] * scale);
    buf[i] = y * y;
  }
  for (int64_t i = len; i < width; ++i) buf[i] = 0.0;
  for (int64_t h = width / 2; h >= 1; h /= 2)
    for (int64_t j = 0; j < h; ++j) buf[j] += buf[j + h];
  return static_cast<float>(std::sqrt(buf[0]));
}

// Level spacing: norm / levels rounded up (levels * step >= norm), optionally to a half.
float bucket_step(float m, int levels, int scale_bytes, uint16_t* half) {
  float step = m / static_cast<float>(levels);
  if (static_cast<double>(step) * levels < static_cast<double>(m)) step = u2f(f2u(step) + 1u);
  if (scale_bytes == 2) {
    uint16_t h = f32_to_f16(step);
    if (f16_to_f32(h) < step) h = static_cast<uint16_t>(h + 1);
    *half = h;
    step = f16_to_f32(h);
  }
  return step;
}

COMMOPT_CLONES
void quantize(const float* x, int32_t* codes, int64_t len, float scale, float step,
              uint32_t index, uint32_t k0, uint32_t k1, int32_t levels, int sign_shift,
              int stochastic) {
  if (!(step > 0.0f && step < INFINITY)) {  // zero, NaN or Inf scale: codes 0
    for (int64_t i = 0; i < len; ++i) codes[i] = 0;
    return;
  }
  if (stochastic) {
    for (int64_t i = 0; i < len; ++i) {
      float y = x[i] * scale;
      float t = std::fabs(y) / step;
      int32_t low = static_cast<int32_t>(t);
      float frac = t - static_cast<float>(low);
      uint32_t u = rand_word(index + static_cast<uint32_t>(i), k0, k1);
      float r = static_cast<float>(static_cast<int32_t>(u >> 8)) * 0x1p-24f;
      int32_t q = low + (r < frac ? 1 : 0);
      q = q < levels ? q : levels;
      int32_t neg = (y < 0.0f) & (q > 0);
      codes[i] = q | (neg << sign_shift);
    }
  } else {
    for (int64_t i = 0; i < len; ++i) {
      float y = x[i] * scale;
      float t = std::fabs(y) / step;
      int32_t low = static_cast<int32_t>(t);
      float frac = t - static_cast<float>(low);
      int32_t q = low + (frac >= 0.5f ? 1 : 0);
      q = q < levels ? q : levels;
      int32_t neg = (y < 0.0f) & (q > 0);
      codes[i] = q | (neg << sign_shift);
    }
  }
}

// Pack `count` codes (count a multiple of 8/bits, zero-padded by the caller) little-endian.
COMMOPT_CLONES
void pack(const int32_t* c, uint8_t* out, int64_t count, int bits) {
  if (bits == 8) {
    for (int64_t j = 0; j < count; ++j) out[j] = static_cast<uint8_t>(c[j]);
  } else if (bits == 4) {
    for (int64_t j = 0; j < count / 2; ++j)
      out[j] = static_cast<uint8_t>(c[2 * j] | (c[2 * j + 1] << 4));
  } else {
    for (int64_t j = 0; j < count / 4; ++j)
      out[j] = static_cast<uint8_t>(c[4 * j] | (c[4 * j + 1] << 2) | (c[4 * j + 2] << 4) |
                                    (c[4 * j + 3] << 6));
  }
}

COMMOPT_CLONES
void unpack(const uint8_t* in, int32_t* c, int64_t count, int bits) {
  if (bits == 8) {
    for (int64_t j = 0; j < count; ++j) c[j] = in[j];
  } else if (bits == 4) {
    for (int64_t j = 0; j < count / 2; ++j) {
      c[2 * j] = in[j] & 15;
      c[2 * j + 1] = in[j] >> 4;
    }
  } else {
    for (int64_t j = 0; j < count / 4; ++j) {
      c[4 * j] = in[j] & 3;
      c[4 * j + 1] = (in[j] >> 2) & 3;
      c[4 * j + 2] = (in[j] >> 4) & 3;
      c[4 * j + 3] = in[j] >> 6;
    }
  }
}

COMMOPT_CLONES
void dequantize(const int32_t* c, float* out, int64_t len, float step, int sign_shift,
                float alpha, int accumulate) {
  const int32_t qmask = (1 << sign_shift) - 1;
  if (alpha == 1.0f) {
    if (accumulate) {
      for (int64_t i = 0; i < len; ++i) {
        float v = static_cast<float>(c[i] & qmask) * step;
        out[i] = out[i] + ((c[i] >> sign_shift) ? -v : v);
      }
    } else {
      for (int64_t i = 0; i < len; ++i) {
        float v = static_cast<float>(c[i] & qmask) * step;
        out[i] = (c[i] >> sign_shift) ? -v : v;
      }
    }
  } else {
    for (int64_t i = 0; i < len; ++i) {
      float v = static_cast<float>(c[i] & qmask) * step;
      v = ((c[i] >> sign_shift) ? -v : v) * alpha;
      out[i] = accumulate ? out[i] + v : v;
    }
  }
}

float load_scale(const uint8_t* scales, int64_t b, int scale_bytes) {
  if (scale_bytes == 4) {
    float s;
    std::memcpy(&s, scales + 4 * b, 4);
    return s;
  }
  uint16_t h;
  std::memcpy(&h, scales + 2 * b, 2);
  return f16_to_f32(h);
}

struct Scratch {
  std::vector<int32_t> codes = std::vector<int32_t>(kBlock);
  std::vector<float> steps;
  std::vector<double> l2;
};

// Encode elements [g0, g1): whole buckets, g0 on a byte boundary of the codes.
void encode_group(const float* x, uint8_t* scales, uint8_t* payload, int64_t g0, int64_t g1,
                  const QsgdArgs& a, Scratch& s) {
  const int64_t B = a.bucket;
  const int64_t b0 = g0 / B, b1 = (g1 + B - 1) / B;
  s.steps.resize(static_cast<size_t>(b1 - b0));
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t lo = b * B, len = (b + 1) * B < a.n ? B : a.n - lo;
    float m = a.norm_l2 ? norm_l2(x + lo, len, a.scale, s.l2.data(), static_cast<int64_t>(s.l2.size()))
                        : norm_max(x + lo, len, a.scale);
    uint16_t half = 0;
    float step = bucket_step(m, a.levels, a.scale_bytes, &half);
    s.steps[b - b0] = step;
    if (a.scale_bytes == 4) std::memcpy(scales + 4 * b, &step, 4);
    else std::memcpy(scales + 2 * b, &half, 2);
  }
  const int sign_shift = a.bits - 1;
  const int64_t per_byte = 8 / a.bits;
  for (int64_t s0 = g0; s0 < g1; s0 += kBlock) {
    const int64_t s1 = s0 + kBlock < g1 ? s0 + kBlock : g1;
    for (int64_t pos = s0; pos < s1;) {
      const int64_t b = pos / B;
      const int64_t end = (b + 1) * B < s1 ? (b + 1) * B : s1;
      quantize(x + pos, s.codes.data() + (pos - s0), end - pos, a.scale, s.steps[b - b0],
               static_cast<uint32_t>(pos), a.k0, a.k1, a.levels, sign_shift, a.stochastic);
      pos = end;
    }
    int64_t count = s1 - s0;
    const int64_t padded = (count + per_byte - 1) / per_byte * per_byte;  // tensor end only
    for (int64_t i = count; i < padded; ++i) s.codes[i] = 0;
    pack(s.codes.data(), payload + s0 / per_byte, padded, a.bits);
  }
}

void decode_group(const uint8_t* scales, const uint8_t* payload, float* out, int64_t g0,
                  int64_t g1, const QsgdArgs& a, Scratch& s) {
  const int64_t B = a.bucket;
  const int sign_shift = a.bits - 1;
  const int64_t per_byte = 8 / a.bits;
  for (int64_t s0 = g0; s0 < g1; s0 += kBlock) {
    const int64_t s1 = s0 + kBlock < g1 ? s0 + kBlock : g1;
    const int64_t padded = (s1 - s0 + per_byte - 1) / per_byte * per_byte;
    unpack(payload + s0 / per_byte, s.codes.data(), padded, a.bits);
    for (int64_t pos = s0; pos < s1;) {
      const int64_t b = pos / B;
      const int64_t end = (b + 1) * B < s1 ? (b + 1) * B : s1;
      dequantize(s.codes.data() + (pos - s0), out + pos, end - pos,
                 load_scale(scales, b, a.scale_bytes), sign_shift, a.scale, a.accumulate);
      pos = end;
    }
  }
}

template <typename GroupFn>
void for_groups(int64_t n, int64_t group, int threads, bool l2, int64_t l2_width, GroupFn fn) {
  const int64_t ngroups = (n + group - 1) / group;
  if (threads > ngroups) threads = static_cast<int>(ngroups);
  if (n < kParallelMin || threads <= 1) {
    Scratch s;
    if (l2) s.l2.resize(static_cast<size_t>(l2_width));
    for (int64_t g = 0; g < ngroups; ++g) fn(g * group, (g + 1) * group < n ? (g + 1) * group : n, s);
    return;
  }
#pragma omp parallel num_threads(threads)
  {
    Scratch s;
    if (l2) s.l2.resize(static_cast<size_t>(l2_width));
#pragma omp for schedule(static)
    for (int64_t g = 0; g < ngroups; ++g) fn(g * group, (g + 1) * group < n ? (g + 1) * group : n, s);
  }
}

int64_t qsgd_nbytes(int64_t n, int bits, int64_t bucket, int scale_bytes) {
  const int64_t nb = (n + bucket - 1) / bucket;
  const int64_t raw = nb * scale_bytes + (n * bits + 7) / 8;
  return (raw + 3) / 4 * 4;
}

bool bad_qsgd(int64_t n, int bits, int levels, int64_t bucket, int scale_bytes) {
  return n < 0 || n > 0xFFFFFFFFll || (bits != 2 && bits != 4 && bits != 8) || levels < 1 ||
         levels > (1 << (bits - 1)) - 1 || bucket < 1 || (scale_bytes != 2 && scale_bytes != 4);
}

// ---------------------------------------------------------------- casts
COMMOPT_CLONES
void cast_encode_range(const float* x, void* out, int64_t lo, int64_t hi, int dtype, float scale) {
  if (dtype == 0) {
    float* o = static_cast<float*>(out);
    for (int64_t i = lo; i < hi; ++i) o[i] = x[i] * scale;
  } else if (dtype == 1) {
    uint16_t* o = static_cast<uint16_t*>(out);
    for (int64_t i = lo; i < hi; ++i) o[i] = f32_to_f16(x[i] * scale);
  } else {
    uint16_t* o = static_cast<uint16_t*>(out);
    for (int64_t i = lo; i < hi; ++i) o[i] = f32_to_bf16(x[i] * scale);
  }
}

template <typename Load>
inline void store_range(float* out, int64_t lo, int64_t hi, float alpha, int accumulate, Load load) {
  if (alpha == 1.0f) {
    if (accumulate) for (int64_t i = lo; i < hi; ++i) out[i] = out[i] + load(i);
    else for (int64_t i = lo; i < hi; ++i) out[i] = load(i);
  } else {
    if (accumulate) for (int64_t i = lo; i < hi; ++i) out[i] = out[i] + load(i) * alpha;
    else for (int64_t i = lo; i < hi; ++i) out[i] = load(i) * alpha;
  }
}

COMMOPT_CLONES
void cast_decode_range(const void* wire, float* out, int64_t lo, int64_t hi, int dtype,
                       float alpha, int accumulate) {
  if (dtype == 0) {
    const float* w = static_cast<const float*>(wire);
    store_range(out, lo, hi, alpha, accumulate, [w](int64_t i) { return w[i]; });
  } else if (dtype == 1) {
    const uint16_t* w = static_cast<const uint16_t*>(wire);
    store_range(out, lo, hi, alpha, accumulate, [w](int64_t i) { return f16_to_f32(w[i]); });
  } else {
    const uint16_t* w = static_cast<const uint16_t*>(wire);
    store_range(out, lo, hi, alpha, accumulate,
                [w](int64_t i) { return u2f(static_cast<uint32_t>(w[i]) << 16); });
  }
}

template <typename RangeFn>
void for_ranges(int64_t n, int threads, RangeFn fn) {
  constexpr int64_t kChunk = 1 << 16;
  const int64_t nchunks = (n + kChunk - 1) / kChunk;
  if (n < kParallelMin || threads <= 1) {
    fn(0, n);
    return;
  }
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t c = 0; c < nchunks; ++c) fn(c * kChunk, (c + 1) * kChunk < n ? (c + 1) * kChunk : n);
}

// ---------------------------------------------------------------- copy and NaN/Inf check
// A float is NaN or +-Inf iff its exponent bits are all ones: |bits| >= 0x7F800000. The max of
// |bits| over a range vectorises like norm_max; one compare at the end gives the flag.
COMMOPT_CLONES
uint32_t max_abs_bits(const float* x, int64_t lo, int64_t hi) {
  uint32_t m = 0;
  for (int64_t i = lo; i < hi; ++i) {
    uint32_t b = f2u(x[i]) & 0x7FFFFFFFu;
    m = b > m ? b : m;
  }
  return m;
}

// Copies x[lo, hi) to out[lo, hi) and returns the max |bits| of what it copied: one pass
// over the data instead of a copy followed by a check.
COMMOPT_CLONES
uint32_t copy_max_abs_bits(const float* x, float* out, int64_t lo, int64_t hi) {
  uint32_t m = 0;
  for (int64_t i = lo; i < hi; ++i) {
    const float v = x[i];
    out[i] = v;
    uint32_t b = f2u(v) & 0x7FFFFFFFu;
    m = b > m ? b : m;
  }
  return m;
}

// fn(lo, hi) -> uint32_t over [0, n) in chunks (threads when large); the max of the results.
template <typename RangeFn>
uint32_t max_over_ranges(int64_t n, int threads, RangeFn fn) {
  constexpr int64_t kChunk = 1 << 16;
  if (n < kParallelMin || threads <= 1) return n > 0 ? fn(0, n) : 0u;
  const int64_t nchunks = (n + kChunk - 1) / kChunk;
  uint32_t m = 0;
#pragma omp parallel for schedule(static) num_threads(threads) reduction(max : m)
  for (int64_t c = 0; c < nchunks; ++c) {
    uint32_t r = fn(c * kChunk, (c + 1) * kChunk < n ? (c + 1) * kChunk : n);
    m = r > m ? r : m;
  }
  return m;
}

}  // namespace

extern "C" {

int commopt_abi_version() { return 3; }

// x: n float32; out: qsgd_nbytes(n) bytes. norm_l2: 0 max-abs, 1 l2. Returns 0, or -1 on bad
// arguments. The random word of element i is rand_word(i, k0, k1).
int commopt_qsgd_encode(const float* x, uint8_t* out, int64_t n, int bits, int levels,
                        int64_t bucket, int norm_l2_flag, int stochastic, uint32_t k0, uint32_t k1,
                        float scale, int scale_bytes, int threads) {
  if (bad_qsgd(n, bits, levels, bucket, scale_bytes) || bucket > 0x7FFFFFFF) return -1;
  const int64_t nb = (n + bucket - 1) / bucket;
  const int64_t head = nb * scale_bytes, code_bytes = (n * bits + 7) / 8;
  const int64_t total = qsgd_nbytes(n, bits, bucket, scale_bytes);
  std::memset(out + head + code_bytes, 0, static_cast<size_t>(total - head - code_bytes));
  if (n == 0) return 0;
  QsgdArgs a{n, bits, levels, static_cast<int>(bucket), norm_l2_flag, stochastic, scale_bytes,
             k0, k1, scale, 0};
  uint8_t* payload = out + head;
  for_groups(n, group_size(bucket, bits), threads, norm_l2_flag != 0, pow2_at_least(bucket),
             [&](int64_t g0, int64_t g1, Scratch& s) { encode_group(x, out, payload, g0, g1, a, s); });
  return 0;
}

int commopt_qsgd_decode(const uint8_t* wire, float* out, int64_t n, int bits, int levels,
                        int64_t bucket, int scale_bytes, int accumulate, float alpha, int threads) {
  if (bad_qsgd(n, bits, levels, bucket, scale_bytes) || bucket > 0x7FFFFFFF) return -1;
  if (n == 0) return 0;
  const int64_t nb = (n + bucket - 1) / bucket;
  QsgdArgs a{n, bits, levels, static_cast<int>(bucket), 0, 0, scale_bytes, 0, 0, alpha, accumulate};
  const uint8_t* payload = wire + nb * scale_bytes;
  for_groups(n, group_size(bucket, bits), threads, false, 0,
             [&](int64_t g0, int64_t g1, Scratch& s) { decode_group(wire, payload, out, g0, g1, a, s); });
  return 0;
}

// dtype: 0 float32, 1 float16, 2 bfloat16 (round to nearest even).
int commopt_cast_encode(const float* x, void* out, int64_t n, int dtype, float scale, int threads) {
  if (n < 0 || dtype < 0 || dtype > 2) return -1;
  for_ranges(n, threads, [&](int64_t lo, int64_t hi) { cast_encode_range(x, out, lo, hi, dtype, scale); });
  return 0;
}

int commopt_cast_decode(const void* wire, float* out, int64_t n, int dtype, int accumulate,
                        float alpha, int threads) {
  if (n < 0 || dtype < 0 || dtype > 2) return -1;
  for_ranges(n, threads, [&](int64_t lo, int64_t hi) {
    cast_decode_range(wire, out, lo, hi, dtype, alpha, accumulate);
  });
  return 0;
}

// 1 if some x[i] is NaN or +-Inf, else 0 (-1 on bad arguments). Every element is read: the
// answer does not depend on the split over threads.
int commopt_nonfinite(const float* x, int64_t n, int threads) {
  if (n < 0) return -1;
  const uint32_t m = max_over_ranges(n, threads, [&](int64_t lo, int64_t hi) {
    return max_abs_bits(x, lo, hi);
  });
  return m >= 0x7F800000u ? 1 : 0;
}

// Packs pieces into one float32 buffer and checks them in the same pass: piece k copies
// numels[k] floats from srcs[k] to dst + offsets[k] (srcs[k] NULL: writes zeros). Returns 1 if
// some copied value is NaN or +-Inf, else 0; -1 on bad arguments. Pieces must not overlap.
int commopt_pack_nonfinite(const float* const* srcs, const int64_t* offsets, const int64_t* numels,
                           int64_t pieces, float* dst, int threads) {
  if (pieces < 0) return -1;
  for (int64_t k = 0; k < pieces; ++k)
    if (numels[k] < 0 || offsets[k] < 0) return -1;
  uint32_t m = 0;
  for (int64_t k = 0; k < pieces; ++k) {
    float* out = dst + offsets[k];
    const float* x = srcs[k];
    if (x == nullptr) {
      std::memset(out, 0, static_cast<size_t>(numels[k]) * sizeof(float));
      continue;
    }
    const uint32_t r = max_over_ranges(numels[k], threads, [&](int64_t lo, int64_t hi) {
      return copy_max_abs_bits(x, out, lo, hi);
    });
    m = r > m ? r : m;
  }
  return m >= 0x7F800000u ? 1 : 0;
}

}  // extern "C"
