// CUDA kernels of the commopt codecs, compiled at run time by commopt/_cuda_kernels.py
// (cupy.RawModule, NVRTC) and compile-checked without a GPU by tests/unit/test_cuda_sources.py.
//
// They must write the same bits as commopt/_reference_kernels.py (the spec), so every float
// operation is spelled with an explicitly rounded intrinsic (__fmul_rn, __fdiv_rn...): no
// FMA contraction and no approximate division, whatever the compiler flags. No headers, so
// NVRTC compiles this file on its own.

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef long long i64;

#define FULL_MASK 0xFFFFFFFFu

// ---------------------------------------------------------------- random numbers
__device__ __forceinline__ u32 mix32(u32 x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

__device__ __forceinline__ u32 rand_word(u32 index, u32 k0, u32 k1) {
  return mix32(mix32(index + k0) ^ k1);
}

// ---------------------------------------------------------------- half precision
// Same integer algorithm as cpu_kernels.cpp (round to nearest even, NaN -> 0x7E00).
__device__ __forceinline__ u16 f32_to_f16(float f) {
  const u32 w = __float_as_uint(f);
  const u32 sign = (w >> 16) & 0x8000u;
  const u32 a = w & 0x7FFFFFFFu;
  const u32 m = a - 0x38000000u;
  const u32 normal = (m + 0x0FFFu + ((m >> 13) & 1u)) >> 13;
  int shift = 126 - (int)(a >> 23);
  shift = shift < 1 ? 1 : (shift > 31 ? 31 : shift);
  const u32 mant = (a & 0x7FFFFFu) | 0x800000u;
  const u32 sub = (mant + (1u << (shift - 1)) - 1u + ((mant >> shift) & 1u)) >> shift;
  u32 h = a >= 0x38800000u ? normal : sub;
  h = a >= 0x477FF000u ? 0x7C00u : h;
  h = a > 0x7F800000u ? 0x7E00u : h;
  return (u16)(sign | h);
}

__device__ __forceinline__ float f16_to_f32(u16 h) {
  const u32 sign = (u32)(h & 0x8000u) << 16;
  const u32 e = (h >> 10) & 0x1Fu;
  const u32 m = h & 0x3FFu;
  u32 bits;
  if (e == 0x1Fu) bits = 0x7F800000u | (m << 13);
  else if (e == 0) bits = __float_as_uint(__fmul_rn(__int2float_rn((int)m), 5.9604644775390625e-08f));
  else bits = ((e + 112u) << 23) | (m << 13);
  return __uint_as_float(sign | bits);
}

__device__ __forceinline__ u16 f32_to_bf16(float f) {
  const u32 w = __float_as_uint(f);
  if ((w & 0x7FFFFFFFu) > 0x7F800000u) return (u16)(((w >> 16) & 0x8000u) | 0x7FC0u);
  return (u16)((w + 0x7FFFu + ((w >> 16) & 1u)) >> 16);
}

// ---------------------------------------------------------------- QSGD pieces
// Level spacing: norm / levels rounded up (levels * step >= norm), optionally to a half.
__device__ __forceinline__ float bucket_step(float m, int levels, int scale_bytes, u16* half) {
  float step = __fdiv_rn(m, __int2float_rn(levels));
  if (__dmul_rn((double)step, (double)levels) < (double)m) step = __uint_as_float(__float_as_uint(step) + 1u);
  *half = 0;
  if (scale_bytes == 2) {
    u16 h = f32_to_f16(step);
    if (f16_to_f32(h) < step) h = (u16)(h + 1);
    *half = h;
    step = f16_to_f32(h);
  }
  return step;
}

__device__ __forceinline__ void store_scale(u8* scales, i64 b, float step, u16 half, int scale_bytes) {
  if (scale_bytes == 4) {
    const u32 v = __float_as_uint(step);
    u8* p = scales + 4 * b;  // the wire may sit at any byte offset: store bytes
    p[0] = (u8)v; p[1] = (u8)(v >> 8); p[2] = (u8)(v >> 16); p[3] = (u8)(v >> 24);
  } else {
    u8* p = scales + 2 * b;
    p[0] = (u8)half; p[1] = (u8)(half >> 8);
  }
}

__device__ __forceinline__ float load_scale(const u8* scales, i64 b, int scale_bytes) {
  if (scale_bytes == 4) {
    const u8* p = scales + 4 * b;
    return __uint_as_float((u32)p[0] | ((u32)p[1] << 8) | ((u32)p[2] << 16) | ((u32)p[3] << 24));
  }
  const u8* p = scales + 2 * b;
  return f16_to_f32((u16)(p[0] | (p[1] << 8)));
}

// The sign+level code of y (already multiplied by the input scale).
__device__ __forceinline__ u32 quantize_one(float y, float step, u32 index, u32 k0, u32 k1,
                                            int levels, int sign_shift, int stochastic) {
  if (!(step > 0.0f && step < __int_as_float(0x7F800000))) return 0u;
  const float t = __fdiv_rn(fabsf(y), step);
  const int low = __float2int_rz(t);
  const float frac = __fsub_rn(t, __int2float_rn(low));
  int up;
  if (stochastic) {
    const float r = __fmul_rn(__int2float_rn((int)(rand_word(index, k0, k1) >> 8)), 5.9604644775390625e-08f);
    up = r < frac;
  } else {
    up = frac >= 0.5f;
  }
  int q = low + up;
  q = q < levels ? q : levels;
  const int neg = (y < 0.0f) && (q > 0);
  return (u32)(q | (neg << sign_shift));
}

// Bytes of codes: lanes holding consecutive elements (starting on a byte boundary) merge
// their codes with shuffles; the first lane of each byte stores it.
__device__ __forceinline__ void store_codes(u8* payload, i64 element, u32 code, int bits, int lane,
                                            int valid) {
  if (bits == 8) {
    if (valid) payload[element] = (u8)code;
  } else if (bits == 4) {
    const u32 next = __shfl_down_sync(FULL_MASK, code, 1);
    if (valid && (lane & 1) == 0) payload[element >> 1] = (u8)(code | (next << 4));
  } else {
    const u32 c1 = __shfl_down_sync(FULL_MASK, code, 1);
    const u32 c2 = __shfl_down_sync(FULL_MASK, code, 2);
    const u32 c3 = __shfl_down_sync(FULL_MASK, code, 3);
    if (valid && (lane & 3) == 0) payload[element >> 2] = (u8)(code | (c1 << 2) | (c2 << 4) | (c3 << 6));
  }
}

// ---------------------------------------------------------------- QSGD kernels
// Fast path: one warp per bucket, the bucket in registers (one read of x). Needs
// bucket <= 32 * K (qsgd_encode_warp4: 128, qsgd_encode_warp32: 1024) and bucket * bits a
// multiple of 8 (buckets start on bytes).
// l2_width: the power of two >= bucket over which the l2 tree sums (see the reference).
// K: elements per lane (bucket <= 32 K); small K keeps few registers, hence many warps.
template <int K>
__device__ __forceinline__ void encode_warp(const float* __restrict__ x, u8* __restrict__ out, i64 n,
                                            int bits, int levels, int bucket, int norm_l2,
                                            int l2_width, int stochastic, u32 k0, u32 k1,
                                            float scale, int scale_bytes) {
  const int lane = threadIdx.x & 31;
  const i64 nb = (n + bucket - 1) / bucket;
  const i64 warp = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const i64 nwarps = ((i64)gridDim.x * blockDim.x) >> 5;
  const int sign_shift = bits - 1;
  const int per_lane = (bucket + 31) >> 5;
  u8* payload = out + nb * scale_bytes;
  for (i64 b = warp; b < nb; b += nwarps) {
    const i64 base = b * bucket;
    const int len = (int)(n - base < bucket ? n - base : bucket);
    float y[K];
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int j = lane + 32 * k;
      y[k] = (k < per_lane && j < len) ? __fmul_rn(x[base + j], scale) : 0.0f;
    }
    float m;
    if (!norm_l2) {
      u32 bitmax = 0;  // max of |y| through the bit patterns: exact, NaN propagates
#pragma unroll
      for (int k = 0; k < K; ++k) bitmax = max(bitmax, __float_as_uint(y[k]) & 0x7FFFFFFFu);
#pragma unroll
      for (int off = 16; off >= 1; off >>= 1) bitmax = max(bitmax, __shfl_xor_sync(FULL_MASK, bitmax, off));
      m = __uint_as_float(bitmax);
    } else {
      // Pairwise tree over l2_width slots: element j pairs with j + h for h = width/2 ... 1.
      // Slot j = lane + 32 k, so halves >= 32 pair slots within a lane, smaller ones lanes.
      double s[K];
#pragma unroll
      for (int k = 0; k < K; ++k) s[k] = __dmul_rn((double)y[k], (double)y[k]);
      // hk runs over compile-time values (so s stays in registers), skipping those above
      // the width of this bucket.
#pragma unroll
      for (int hk = K / 2; hk >= 1; hk >>= 1) {
        if (hk <= (l2_width >> 6)) {
#pragma unroll
          for (int k = 0; k < hk; ++k) s[k] = __dadd_rn(s[k], s[k + hk]);
        }
      }
      double acc = s[0];
      for (int h = (l2_width < 32 ? l2_width : 32) >> 1; h >= 1; h >>= 1)
        acc = __dadd_rn(acc, __shfl_down_sync(FULL_MASK, acc, h));
      acc = __shfl_sync(FULL_MASK, acc, 0);
      m = __double2float_rn(__dsqrt_rn(acc));
    }
    u16 half;
    const float step = bucket_step(m, levels, scale_bytes, &half);
    if (lane == 0) store_scale(out, b, step, half, scale_bytes);
#pragma unroll
    for (int k = 0; k < K; ++k) {
      if (k < per_lane) {
        const int j = lane + 32 * k;
        const u32 code = j < len ? quantize_one(y[k], step, (u32)(base + j), k0, k1, levels,
                                                sign_shift, stochastic)
                                 : 0u;
        store_codes(payload, base + j, code, bits, lane, j < len);
      }
    }
  }
}

extern "C" __global__ void qsgd_encode_warp4(const float* __restrict__ x, u8* __restrict__ out, i64 n,
                                             int bits, int levels, int bucket, int norm_l2,
                                             int l2_width, int stochastic, u32 k0, u32 k1,
                                             float scale, int scale_bytes) {
  encode_warp<4>(x, out, n, bits, levels, bucket, norm_l2, l2_width, stochastic, k0, k1, scale, scale_bytes);
}

extern "C" __global__ void qsgd_encode_warp32(const float* __restrict__ x, u8* __restrict__ out, i64 n,
                                              int bits, int levels, int bucket, int norm_l2,
                                              int l2_width, int stochastic, u32 k0, u32 k1,
                                              float scale, int scale_bytes) {
  encode_warp<32>(x, out, n, bits, levels, bucket, norm_l2, l2_width, stochastic, k0, k1, scale, scale_bytes);
}

// General path, step 1 (max norm, any bucket size): one warp per bucket writes the scale
// and the float32 step to `steps`. (l2 norms of large buckets come from torch ops.)
extern "C" __global__ void qsgd_steps(const float* __restrict__ x, const float* __restrict__ norms,
                                      u8* __restrict__ out, float* __restrict__ steps, i64 n,
                                      int levels, int bucket, float scale, int scale_bytes) {
  const int lane = threadIdx.x & 31;
  const i64 nb = (n + bucket - 1) / bucket;
  const i64 warp = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const i64 nwarps = ((i64)gridDim.x * blockDim.x) >> 5;
  for (i64 b = warp; b < nb; b += nwarps) {
    float m;
    if (norms != 0) {
      m = norms[b];
    } else {
      const i64 base = b * bucket;
      const i64 len = n - base < bucket ? n - base : bucket;
      u32 bitmax = 0;
      for (i64 j = lane; j < len; j += 32)
        bitmax = max(bitmax, __float_as_uint(__fmul_rn(x[base + j], scale)) & 0x7FFFFFFFu);
      for (int off = 16; off >= 1; off >>= 1) bitmax = max(bitmax, __shfl_xor_sync(FULL_MASK, bitmax, off));
      m = __uint_as_float(bitmax);
    }
    u16 half;
    const float step = bucket_step(m, levels, scale_bytes, &half);
    if (lane == 0) {
      store_scale(out, b, step, half, scale_bytes);
      steps[b] = step;
    }
  }
}

// General path, step 2: one thread per byte of codes.
extern "C" __global__ void qsgd_quantize_bytes(const float* __restrict__ x, const float* __restrict__ steps,
                                               u8* __restrict__ payload, i64 n, int bits, int levels,
                                               int bucket, int stochastic, u32 k0, u32 k1, float scale) {
  const int per_byte = 8 / bits;
  const i64 nbytes = (n * bits + 7) / 8;
  for (i64 byte = (i64)blockIdx.x * blockDim.x + threadIdx.x; byte < nbytes;
       byte += (i64)gridDim.x * blockDim.x) {
    u32 packed = 0;
    for (int e = 0; e < per_byte; ++e) {
      const i64 i = byte * per_byte + e;
      if (i < n) {
        const u32 code = quantize_one(__fmul_rn(x[i], scale), steps[i / bucket], (u32)i, k0, k1,
                                      levels, bits - 1, stochastic);
        packed |= code << (e * bits);
      }
    }
    payload[byte] = (u8)packed;
  }
}

// Decode: one thread per element; out = decoded * alpha (+ out when accumulating).
extern "C" __global__ void qsgd_decode(const u8* __restrict__ wire, float* __restrict__ out, i64 n,
                                       int bits, int bucket, int scale_bytes, int accumulate,
                                       float alpha) {
  const i64 nb = (n + bucket - 1) / bucket;
  const u8* payload = wire + nb * scale_bytes;
  const int sign_shift = bits - 1;
  const int per_byte = 8 / bits;
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
    const u32 code = (payload[i / per_byte] >> ((int)(i % per_byte) * bits)) & ((1u << bits) - 1u);
    const float step = load_scale(wire, i / bucket, scale_bytes);
    float v = __fmul_rn(__int2float_rn((int)(code & ((1u << sign_shift) - 1u))), step);
    if (code >> sign_shift) v = -v;
    if (alpha != 1.0f) v = __fmul_rn(v, alpha);
    out[i] = accumulate ? __fadd_rn(out[i], v) : v;
  }
}

// ---------------------------------------------------------------- casts
// dtype: 0 float32, 1 float16, 2 bfloat16 (round to nearest even).
extern "C" __global__ void cast_encode(const float* __restrict__ x, void* __restrict__ out, i64 n,
                                       int dtype, float scale) {
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
    const float y = __fmul_rn(x[i], scale);
    if (dtype == 0) ((float*)out)[i] = y;
    else if (dtype == 1) ((u16*)out)[i] = f32_to_f16(y);
    else ((u16*)out)[i] = f32_to_bf16(y);
  }
}

extern "C" __global__ void cast_decode(const void* __restrict__ wire, float* __restrict__ out, i64 n,
                                       int dtype, int accumulate, float alpha) {
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
    float v;
    if (dtype == 0) v = ((const float*)wire)[i];
    else if (dtype == 1) v = f16_to_f32(((const u16*)wire)[i]);
    else v = __uint_as_float((u32)((const u16*)wire)[i] << 16);
    if (alpha != 1.0f) v = __fmul_rn(v, alpha);
    out[i] = accumulate ? __fadd_rn(out[i], v) : v;
  }
}
