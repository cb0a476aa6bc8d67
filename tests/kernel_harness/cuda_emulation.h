// CUDA C++ on the host: what the kernel source needs to compile with g++ in the CPU execution
// harness, included ahead of the exact `kernel_source()` (after build.py has turned each inline
// `asm` statement into a call to the `rs_ptx_*` emulation of its instruction, below).
//
// Barriers and warp collectives are macros that pass their source line: "the same __syncthreads"
// and "the same shuffle" mean the same call in the source (see runtime.cpp).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <type_traits>

#include "rs_runtime.h"

#define __global__
#define __device__
#define __host__
#define __forceinline__ __attribute__((always_inline)) inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
// One static per kernel instantiation, shared by the block's user threads (they all run on one OS
// thread); the linker script gathers these into the window the scheduler fills with NaN.
#define __shared__ static
#define threadIdx (::rs::g_cur->idx)
#define blockIdx (::rs::g_block_idx)
#define blockDim (::rs::g_block)
#define gridDim (::rs::g_grid)
#define warpSize 32

struct alignas(16) uint4 { unsigned int x, y, z, w; };
struct alignas(16) int4 { int x, y, z, w; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(8) uint2 { unsigned int x, y; };
struct alignas(8) float2 { float x, y; };

inline uint4 make_uint4(unsigned int x, unsigned int y, unsigned int z, unsigned int w) { return uint4{x, y, z, w}; }
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }

inline float __int_as_float(int x) { float f; memcpy(&f, &x, 4); return f; }
inline float __uint_as_float(unsigned int x) { float f; memcpy(&f, &x, 4); return f; }
inline int __float_as_int(float f) { int x; memcpy(&x, &f, 4); return x; }
inline unsigned int __float_as_uint(float f) { unsigned int x; memcpy(&x, &f, 4); return x; }
// Round-to-nearest products and sums never contracted into an fma (-O1 without -mfma: none is).
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }

// CUDA's min/max take mixed integer types and return the wider one.
template <class A, class B>
inline typename std::common_type<A, B>::type min(A a, B b) {
    typedef typename std::common_type<A, B>::type C;
    return static_cast<C>(a) < static_cast<C>(b) ? static_cast<C>(a) : static_cast<C>(b);
}
template <class A, class B>
inline typename std::common_type<A, B>::type max(A a, B b) {
    typedef typename std::common_type<A, B>::type C;
    return static_cast<C>(a) < static_cast<C>(b) ? static_cast<C>(b) : static_cast<C>(a);
}

namespace rs {

inline void cuda_syncwarp(int line, unsigned mask = 0xffffffffu) { syncwarp(line, mask); }

enum ShflOp : uint32_t { kIdx, kXor, kUp, kDown };

// in: [0..1] value bits, [2] the lane/mask/delta operand, [3] width, [4] op, [5] value words.
inline const char* resolve_shfl(Thread* const* lanes, uint32_t mask) {
    for (int l = 0; l < 32; ++l) {
        if (lanes[l] == nullptr) continue;
        const uint32_t* in = lanes[l]->in;
        const int width = static_cast<int>(in[3]);
        if (width <= 0 || width > 32 || (width & (width - 1))) return "width must be a power of two up to 32";
        const int seg = l / width * width;
        const int operand = static_cast<int>(in[2]);
        int src = l;
        switch (in[4]) {
            case kIdx: src = seg + ((operand % width) + width) % width; break;
            case kXor: src = l ^ operand; if (src >= seg + width || src < 0 || src > 31) src = l; break;
            case kUp: src = l - operand; if (src < seg) src = l; break;
            case kDown: src = l + operand; if (src >= seg + width) src = l; break;
        }
        if (lanes[src] == nullptr) {
            return message("lane %d reads lane %d, which is not in mask 0x%08x (undefined value)", l, src, mask);
        }
        lanes[l]->out[0] = lanes[src]->in[0];
        lanes[l]->out[1] = lanes[src]->in[1];
    }
    return nullptr;
}

template <class T>
T cuda_shfl(int line, const char* what, ShflOp op, unsigned mask, T var,
                                      int operand, int width) {
    static_assert(sizeof(T) == 4 || sizeof(T) == 8, "shuffles move 32- or 64-bit values");
    uint32_t* in = g_cur->in;
    in[0] = in[1] = 0;
    memcpy(in, &var, sizeof(T));
    in[2] = static_cast<uint32_t>(operand);
    in[3] = static_cast<uint32_t>(width);
    in[4] = op;
    warp_collective(line, what, mask, resolve_shfl);
    T out;
    memcpy(&out, g_cur->out, sizeof(T));
    return out;
}

template <class T>
T shfl_xor(int line, unsigned mask, T var, int lane_mask, int width = 32) {
    return cuda_shfl(line, "__shfl_xor_sync", kXor, mask, var, lane_mask, width);
}
template <class T>
T shfl_idx(int line, unsigned mask, T var, int src, int width = 32) {
    return cuda_shfl(line, "__shfl_sync", kIdx, mask, var, src, width);
}
template <class T>
T shfl_up(int line, unsigned mask, T var, unsigned delta, int width = 32) {
    return cuda_shfl(line, "__shfl_up_sync", kUp, mask, var, (int)delta, width);
}
template <class T>
T shfl_down(int line, unsigned mask, T var, unsigned delta, int width = 32) {
    return cuda_shfl(line, "__shfl_down_sync", kDown, mask, var, (int)delta, width);
}

inline const char* resolve_ballot(Thread* const* lanes, uint32_t) {
    uint32_t bits = 0;
    for (int l = 0; l < 32; ++l) {
        if (lanes[l] != nullptr && lanes[l]->in[0]) bits |= 1u << l;
    }
    for (int l = 0; l < 32; ++l) {
        if (lanes[l] != nullptr) lanes[l]->out[0] = bits;
    }
    return nullptr;
}

inline unsigned ballot(int line, unsigned mask, int pred) {
    g_cur->in[0] = pred != 0;
    warp_collective(line, "__ballot_sync", mask, resolve_ballot);
    return g_cur->out[0];
}

// ---- PTX emulations: build.py maps each inline asm statement to one of these -----------------
// Operand wrappers check each asm constraint's type as ptxas would: "h" 16-bit, "r" 32-bit
// integers, "f" float, "l" 64-bit.
namespace ptx {
inline float& out_f(float& x) { return x; }
inline unsigned short& out_h(unsigned short& x) { return x; }
inline unsigned int& out_r(unsigned int& x) { return x; }
inline unsigned int& out_r(int& x) { return reinterpret_cast<unsigned int&>(x); }
template <class T> inline unsigned short in_h(T x) {
    static_assert(std::is_integral<T>::value && sizeof(T) == 2, "an \"h\" operand must be a 16-bit integer");
    return static_cast<unsigned short>(x);
}
template <class T> inline unsigned int in_r(T x) {
    static_assert(std::is_integral<T>::value && sizeof(T) == 4, "an \"r\" operand must be a 32-bit integer");
    return static_cast<unsigned int>(x);
}
template <class T> inline float in_f(T x) {
    static_assert(std::is_same<T, float>::value, "an \"f\" operand must be a float");
    return x;
}
template <class T> inline unsigned long long in_l(T x) {
    static_assert(sizeof(T) == 8, "an \"l\" operand must be 64-bit");
    unsigned long long v;
    memcpy(&v, &x, 8);
    return v;
}
}  // namespace ptx

// fp16 through the C++ conversions of g++'s _Float16 (IEEE binary16, round to nearest even).
inline void ptx_cvt_f32_f16(float& out, unsigned short in) {
    _Float16 h;
    memcpy(&h, &in, 2);
    out = static_cast<float>(h);
}
inline void ptx_cvt_rn_f16_f32(unsigned short& out, float in) {
    const _Float16 h = static_cast<_Float16>(in);
    memcpy(&out, &h, 2);
}

inline float half_bits_to_float(uint32_t bits16, bool bf16) {
    if (bf16) return __uint_as_float(bits16 << 16);
    float f;
    ptx_cvt_f32_f16(f, static_cast<unsigned short>(bits16));
    return f;
}

// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}: D[16x8] = A[16x16] * B[16x8] + C, fp32
// accumulate. Fragment layout (PTX ISA, "Matrix fragments for mma.m16n8k16"), with g = lane / 4
// and c = lane % 4: A regs {a0,a1,a2,a3} hold (g, 2c..2c+1), (g+8, 2c..), (g, 2c+8..), (g+8, 2c+8..);
// B regs {b0,b1} hold rows (2c..2c+1, col g) and (2c+8..2c+9, col g); C/D {c0..c3} hold (g, 2c),
// (g, 2c+1), (g+8, 2c), (g+8, 2c+1). Each 32-bit register packs two 16-bit values, low half first.
template <bool BF16>
inline const char* resolve_mma_m16n8k16(Thread* const* lanes, uint32_t mask) {
    if (mask != 0xffffffffu) return "mma.sync needs all 32 lanes (mask 0xffffffff)";
    float a[16][16], b[16][8], c[16][8];
    for (int l = 0; l < 32; ++l) {
        const uint32_t* in = lanes[l]->in;
        const int g = l / 4, q = l % 4;
        const int arow[4] = {g, g + 8, g, g + 8}, acol[4] = {2 * q, 2 * q, 2 * q + 8, 2 * q + 8};
        for (int r = 0; r < 4; ++r) {
            a[arow[r]][acol[r]] = half_bits_to_float(in[r] & 0xffffu, BF16);
            a[arow[r]][acol[r] + 1] = half_bits_to_float(in[r] >> 16, BF16);
        }
        const int brow[2] = {2 * q, 2 * q + 8};
        for (int r = 0; r < 2; ++r) {
            b[brow[r]][g] = half_bits_to_float(in[4 + r] & 0xffffu, BF16);
            b[brow[r] + 1][g] = half_bits_to_float(in[4 + r] >> 16, BF16);
        }
        c[g][2 * q] = __uint_as_float(in[6]);
        c[g][2 * q + 1] = __uint_as_float(in[7]);
        c[g + 8][2 * q] = __uint_as_float(in[8]);
        c[g + 8][2 * q + 1] = __uint_as_float(in[9]);
    }
    for (int l = 0; l < 32; ++l) {
        const int g = l / 4, q = l % 4;
        const int rows[4] = {g, g, g + 8, g + 8}, cols[4] = {2 * q, 2 * q + 1, 2 * q, 2 * q + 1};
        for (int r = 0; r < 4; ++r) {
            // Products of 16-bit floats are exact in double; one rounding to fp32 at the end.
            double acc = c[rows[r]][cols[r]];
            for (int k = 0; k < 16; ++k) acc += static_cast<double>(a[rows[r]][k]) * b[k][cols[r]];
            lanes[l]->out[r] = __float_as_uint(static_cast<float>(acc));
        }
    }
    return nullptr;
}

template <bool BF16>
inline void ptx_mma_m16n8k16(int line, const char* what, float& d0, float& d1,
                                                       float& d2, float& d3, unsigned a0, unsigned a1, unsigned a2,
                                                       unsigned a3, unsigned b0, unsigned b1, float c0, float c1,
                                                       float c2, float c3) {
    uint32_t* in = g_cur->in;
    const uint32_t words[10] = {a0, a1, a2, a3, b0, b1, __float_as_uint(c0), __float_as_uint(c1),
                                __float_as_uint(c2), __float_as_uint(c3)};
    memcpy(in, words, sizeof words);
    warp_collective(line, what, 0xffffffffu, resolve_mma_m16n8k16<BF16>);
    d0 = __uint_as_float(g_cur->out[0]);
    d1 = __uint_as_float(g_cur->out[1]);
    d2 = __uint_as_float(g_cur->out[2]);
    d3 = __uint_as_float(g_cur->out[3]);
}

// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: lanes 8i..8i+7 give the 16-byte row addresses
// of 8x8 matrix i; register i of lane l receives, untransposed, row l/4, columns 2(l%4)..+1 of
// matrix i; transposed, rows 2(l%4) and 2(l%4)+1 of column l/4.
template <bool TRANS>
inline const char* resolve_ldmatrix_x4(Thread* const* lanes, uint32_t mask) {
    if (mask != 0xffffffffu) return "ldmatrix needs all 32 lanes (mask 0xffffffff)";
    for (int l = 0; l < 32; ++l) {
        if (lanes[l]->in[0] % 16) return "ldmatrix row addresses must be 16-byte aligned";
    }
    for (int l = 0; l < 32; ++l) {
        for (int i = 0; i < 4; ++i) {
            uint16_t lo, hi;
            if (!TRANS) {
                const char* row = shared_ptr(lanes[8 * i + l / 4]->in[0], 16);
                memcpy(&lo, row + 4 * (l % 4), 2);
                memcpy(&hi, row + 4 * (l % 4) + 2, 2);
            } else {
                const char* r0 = shared_ptr(lanes[8 * i + 2 * (l % 4)]->in[0], 16);
                const char* r1 = shared_ptr(lanes[8 * i + 2 * (l % 4) + 1]->in[0], 16);
                memcpy(&lo, r0 + 2 * (l / 4), 2);
                memcpy(&hi, r1 + 2 * (l / 4), 2);
            }
            lanes[l]->out[i] = static_cast<uint32_t>(lo) | static_cast<uint32_t>(hi) << 16;
        }
    }
    return nullptr;
}

template <bool TRANS>
inline void ptx_ldmatrix_x4(int line, const char* what, unsigned& r0, unsigned& r1,
                                                      unsigned& r2, unsigned& r3, unsigned addr) {
    g_cur->in[0] = addr;
    warp_collective(line, what, 0xffffffffu, resolve_ldmatrix_x4<TRANS>);
    r0 = g_cur->out[0];
    r1 = g_cur->out[1];
    r2 = g_cur->out[2];
    r3 = g_cur->out[3];
}

}  // namespace rs

#define __syncthreads() ::rs::syncthreads(__LINE__)
#define __syncwarp(...) ::rs::cuda_syncwarp(__LINE__, ##__VA_ARGS__)
#define __shfl_xor_sync(...) ::rs::shfl_xor(__LINE__, __VA_ARGS__)
#define __shfl_sync(...) ::rs::shfl_idx(__LINE__, __VA_ARGS__)
#define __shfl_up_sync(...) ::rs::shfl_up(__LINE__, __VA_ARGS__)
#define __shfl_down_sync(...) ::rs::shfl_down(__LINE__, __VA_ARGS__)
#define __ballot_sync(...) ::rs::ballot(__LINE__, __VA_ARGS__)

inline size_t __cvta_generic_to_shared(const void* p) { return ::rs::shared_addr(p); }

// The instructions build.py translates inline asm into (the name is the PTX opcode, dots as
// underscores). Warp-collective ones pass their source line, as the shuffles do.
#define rs_ptx_cvt_f32_f16(out, in) ::rs::ptx_cvt_f32_f16(out, in)
#define rs_ptx_cvt_rn_f16_f32(out, in) ::rs::ptx_cvt_rn_f16_f32(out, in)
#define rs_ptx_mma_sync_aligned_m16n8k16_row_col_f32_f16_f16_f32(...) \
    ::rs::ptx_mma_m16n8k16<false>(__LINE__, "mma.sync.m16n8k16.f16", __VA_ARGS__)
#define rs_ptx_mma_sync_aligned_m16n8k16_row_col_f32_bf16_bf16_f32(...) \
    ::rs::ptx_mma_m16n8k16<true>(__LINE__, "mma.sync.m16n8k16.bf16", __VA_ARGS__)
#define rs_ptx_ldmatrix_sync_aligned_m8n8_x4_shared_b16(...) \
    ::rs::ptx_ldmatrix_x4<false>(__LINE__, "ldmatrix.x4", __VA_ARGS__)
#define rs_ptx_ldmatrix_sync_aligned_m8n8_x4_trans_shared_b16(...) \
    ::rs::ptx_ldmatrix_x4<true>(__LINE__, "ldmatrix.x4.trans", __VA_ARGS__)
