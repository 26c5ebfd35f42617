// Vector helpers shared by the CPU kernels of this directory (one definition each): the vector
// type over ATen's at::vec::Vectorized<float> and its lane count for the ISA this translation unit
// is compiled for, dtype conversions, horizontal reductions and a float32 exp.
//
// Every kernel source is compiled once per ISA with torch's defines (moe/kernels/__init__.py):
// CPU_CAPABILITY=AVX2 and CPU_CAPABILITY_AVX2 with -mavx2 -mfma, or the AVX512 ones with
// -mavx512f/bw/vl/dq (plus -mavx512bf16 -DMOE_DBO_AVX512_BF16 for the avx512_bf16 build). A vector
// holds kLanes = Vec::size() floats: 8 with AVX2, 16 with AVX-512.

#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

namespace moe_dbo_cpu {

using Vec = at::vec::Vectorized<float>;
using IVec = at::vec::Vectorized<int32_t>;
constexpr int64_t kLanes = Vec::size();

// Vectors that hold running sums in the loops below: half the register file (32 vector registers
// with AVX-512, 16 with AVX2), the other half takes loads and broadcasts, so no sum is spilled.
// An FMA's result is ready ~4 cycles later and two issue per cycle: a loop needs ~8 independent
// sums to keep both units busy, which fits either budget.
#if defined(CPU_CAPABILITY_AVX512)
constexpr int kAccVectors = 16;
#else
constexpr int kAccVectors = 8;
#endif

inline float to_float(float x) { return x; }
inline double to_float(double x) { return x; }
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline Vec load_float(const float* p) { return Vec::loadu(p); }
inline Vec load_float(const c10::BFloat16* p) {  // kLanes bf16 -> float (a 16-bit shift each)
  Vec out;
  at::vec::load_fp32_from_bf16(p, out);
  return out;
}

inline float reduce_add(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](const Vec& a, const Vec& b) { return a + b; }, v);
}

inline float reduce_max(const Vec& v) {
  return at::vec::vec_reduce_all<float>(
      [](const Vec& a, const Vec& b) { return at::vec::maximum(a, b); }, v);
}

// exp(x) for x <= 0 (scores minus their max), kLanes floats at a time: x = k ln2 + r,
// |r| <= ln2 / 2, exp(r) by its Taylor polynomial to degree 6 (truncation < 3e-8 relative), then
// times 2^k, k + 127 written into the exponent bits (x >= kExpMin keeps k + 127 >= 1, a normal
// float). Measured against double on [-87, 0]: relative error at most 2.31e-7 with AVX2 and
// AVX-512 alike. at::vec's exp_u20 is not used: 3.7e-7 near -79, and 0 (not 1.6e-38) at -87.
constexpr float kExpMin = -87.0f;  // exp(-87) ~ 1.6e-38, still a normal float
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693145751953125f;  // ln 2 = kLn2Hi + kLn2Lo, kLn2Hi exact in float
constexpr float kLn2Lo = 1.42860682030941723212e-6f;
constexpr float kExpTaylor[7] = {1.0f / 720.0f, 1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f,
                                 0.5f,           1.0f,          1.0f};  // Horner, highest first

inline Vec exp_vec(Vec x) {
  x = at::vec::clamp_min(x, Vec(kExpMin));
  const Vec k = (x * Vec(kLog2e)).round();  // to nearest
  Vec r = at::vec::fmadd(k, Vec(-kLn2Hi), x);
  r = at::vec::fmadd(k, Vec(-kLn2Lo), r);
  Vec p(kExpTaylor[0]);
  for (int i = 1; i < 7; ++i) p = at::vec::fmadd(p, r, Vec(kExpTaylor[i]));
  const IVec bits = (at::vec::convert_to_int_of_same_size(k) + IVec(127)) << IVec(23);
  return p * at::vec::cast<float>(bits);
}

// The instruction set this build's vectors use (the Python side names each build after it).
inline const char* isa_name() {
#if defined(MOE_DBO_AVX512_BF16)
  return "avx512_bf16";
#elif defined(CPU_CAPABILITY_AVX512)
  return "avx512";
#elif defined(CPU_CAPABILITY_AVX2)
  return "avx2";
#else
  return "default";
#endif
}

}  // namespace moe_dbo_cpu
