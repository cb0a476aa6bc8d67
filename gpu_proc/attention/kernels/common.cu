// Shared prelude for every ringserve attention kernel. The backend prepends this file to each
// kernel source before NVRTC compiles it (and the CI test does the same before `nvcc -ptx`), so the
// kernels need no headers at all: NVRTC ships no libc/libstdc++ headers, and not depending on
// cuda_fp16.h / cuda_bf16.h keeps the build identical across CUDA toolkits and CuPy wheels.
//
// Layout facts every kernel relies on (fixed by gpu_proc/kv_pool.py):
//   k_cache, v_cache: [num_blocks, num_kv_heads, RS_BLOCK_SIZE, head_dim], contiguous, fp16 or bf16
//   a token at position p of a sequence lives in block block_table[p / 16] at offset p % 16.
// Half-precision values travel as raw 16-bit patterns (unsigned short) and are converted to fp32
// for all arithmetic; softmax runs in the log2 domain (q is pre-scaled by scale * log2(e)).

#define RS_BLOCK_SIZE 16
#define RS_NEG_INF (__int_as_float(0xff800000))
#define RS_WARP 32

// fp16 <-> fp32 through the PTX conversion instructions (round to nearest even).
struct RsF16 {
    static __device__ __forceinline__ float to_float(unsigned short x) {
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
        return f;
    }
    static __device__ __forceinline__ unsigned short from_float(float f) {
        unsigned short h;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
        return h;
    }
};

// bf16 is the top half of an fp32, so widening is a shift; narrowing rounds to nearest even by
// integer arithmetic (portable to every architecture, unlike cvt.rn.bf16.f32 which needs sm_80).
struct RsBF16 {
    static __device__ __forceinline__ float to_float(unsigned short x) {
        return __uint_as_float(((unsigned int)x) << 16);
    }
    static __device__ __forceinline__ unsigned short from_float(float f) {
        unsigned int u = __float_as_uint(f);
        if ((u & 0x7fffffffu) > 0x7f800000u) {
            return (unsigned short)0x7fc0;  // NaN stays a (quiet) NaN
        }
        u += 0x7fffu + ((u >> 16) & 1u);
        return (unsigned short)(u >> 16);
    }
};

// 8 consecutive 16-bit values <-> one 16-byte vector (little-endian: element 2i is the low half).
template <typename T>
__device__ __forceinline__ void rs_unpack8(const uint4 v, float* out) {
    const unsigned int w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        out[2 * i] = T::to_float((unsigned short)(w[i] & 0xffffu));
        out[2 * i + 1] = T::to_float((unsigned short)(w[i] >> 16));
    }
}

template <typename T>
__device__ __forceinline__ uint4 rs_pack8(const float* in) {
    unsigned int w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        w[i] = (unsigned int)T::from_float(in[2 * i]) | ((unsigned int)T::from_float(in[2 * i + 1]) << 16);
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
}

// Butterfly reductions over lanes whose ids differ only in the bits FIRST..LAST-1 (powers of two),
// so a warp split into groups of lanes can reduce inside a group (offsets 1..group/2) or across
// groups (offsets group..16). Every lane ends with the result.
template <int FIRST, int LAST>
__device__ __forceinline__ float rs_sum_xor(float v) {
#pragma unroll
    for (int off = FIRST; off < LAST; off <<= 1) {
        v += __shfl_xor_sync(0xffffffffu, v, off);
    }
    return v;
}

template <int FIRST, int LAST>
__device__ __forceinline__ float rs_max_xor(float v) {
#pragma unroll
    for (int off = FIRST; off < LAST; off <<= 1) {
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
    }
    return v;
}
