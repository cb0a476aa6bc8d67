// Shared prelude for every ringserve attention kernel. The backend prepends this file to each
// kernel source before NVRTC compiles it (and the CI test does the same before `nvcc -ptx`), so the
// kernels need no headers at all: NVRTC ships no libc/libstdc++ headers, and not depending on
// cuda_fp16.h / cuda_bf16.h keeps the build identical across CUDA toolkits and CuPy wheels.
//
// Layout facts every kernel relies on (fixed by gpu_proc/kv_pool.py):
//   k_cache, v_cache: [num_blocks, num_kv_heads, RS_BLOCK_SIZE, head_dim], contiguous,
//                     fp16, bf16 (production) or fp32 (exact comparisons with the CPU engine)
//   a token at position p of a sequence lives in block block_table[p / 16] at offset p % 16.
// Half-precision values travel as raw 16-bit patterns (unsigned short) and are converted to fp32
// for all arithmetic; softmax runs in the log2 domain (q is pre-scaled by scale * log2(e)).
// Each dtype is a traits struct: `storage` (the element type in memory), to_float / from_float,
// and load8 (8 consecutive elements, 16- or 32-byte aligned, into fp32 registers).

#define RS_BLOCK_SIZE 16
#define RS_NEG_INF (__int_as_float(0xff800000))
#define RS_WARP 32

// fp16 <-> fp32 through the PTX conversion instructions (round to nearest even).
struct RsF16 {
    typedef unsigned short storage;
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
    typedef unsigned short storage;
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

// One 16-byte vector -> 8 consecutive 16-bit values (little-endian: element 2i is the low half).
template <typename T>
__device__ __forceinline__ void rs_unpack8(const uint4 v, float* out) {
    const unsigned int w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        out[2 * i] = T::to_float((unsigned short)(w[i] & 0xffffu));
        out[2 * i + 1] = T::to_float((unsigned short)(w[i] >> 16));
    }
}

struct RsF32 {
    typedef float storage;
    static __device__ __forceinline__ float to_float(float x) { return x; }
    static __device__ __forceinline__ float from_float(float f) { return f; }
};

// 8 consecutive elements starting at p (aligned to 8 elements) into fp32.
template <typename T>
__device__ __forceinline__ void rs_load8(const typename T::storage* p, float* out) {
    rs_unpack8<T>(*reinterpret_cast<const uint4*>(p), out);
}

template <>
__device__ __forceinline__ void rs_load8<RsF32>(const float* p, float* out) {
    const float4 a = reinterpret_cast<const float4*>(p)[0];
    const float4 b = reinterpret_cast<const float4*>(p)[1];
    out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w;
    out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
}

// 8 consecutive elements as loaded, before conversion: one 16-byte vector of 16-bit values, or two
// of floats. A kernel that issues many loads before its math holds them raw (4 registers per 8
// fp16/bf16 values, not 8) and converts each where it is used.
template <typename T>
struct RsRaw8 {
    uint4 v;
};
template <>
struct RsRaw8<RsF32> {
    float4 a, b;
};

template <typename T>
__device__ __forceinline__ RsRaw8<T> rs_load_raw8(const typename T::storage* p) {
    RsRaw8<T> r;
    r.v = *reinterpret_cast<const uint4*>(p);
    return r;
}

template <>
__device__ __forceinline__ RsRaw8<RsF32> rs_load_raw8<RsF32>(const float* p) {
    RsRaw8<RsF32> r;
    r.a = reinterpret_cast<const float4*>(p)[0];
    r.b = reinterpret_cast<const float4*>(p)[1];
    return r;
}

template <typename T>
__device__ __forceinline__ void rs_convert8(const RsRaw8<T>& r, float* out) {
    rs_unpack8<T>(r.v, out);
}

template <>
__device__ __forceinline__ void rs_convert8<RsF32>(const RsRaw8<RsF32>& r, float* out) {
    out[0] = r.a.x; out[1] = r.a.y; out[2] = r.a.z; out[3] = r.a.w;
    out[4] = r.b.x; out[5] = r.b.y; out[6] = r.b.z; out[7] = r.b.w;
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

// True when token t belongs to a sequence with more than one new token in this step (a prefill
// chunk), false for a decode row; mixed steps split work between the kernels by this test.
__device__ __forceinline__ bool rs_chunk_token(const int* __restrict__ query_start_loc,
                                               const long long* __restrict__ token_seq, const int t) {
    const long long s = token_seq[t];
    return query_start_loc[s + 1] - query_start_loc[s] != 1;
}

// The prefill tile this CTA (blockIdx.x) owns: the prompt chunks of the step are cut into tiles of
// `tile_tokens` query tokens, sequence by sequence (single-token sequences are decode rows when
// `skip_single`, and get no tile). On return `seq` is the tile's sequence (-1: a surplus CTA, with
// nothing to do), `row0` its first query row and `ntok` its tokens. Every thread of the CTA computes
// the same answer, so a CTA that returns early skips no barrier.
__device__ __forceinline__ void rs_prefill_tile(const int* query_start_loc, int num_seqs, int skip_single,
                                                int tile_tokens, int& seq, int& row0, int& ntok) {
    seq = -1;
    row0 = 0;
    ntok = 0;
    int seen = 0;
    for (int s = 0; s < num_seqs; ++s) {
        const int start = query_start_loc[s];
        const int len = query_start_loc[s + 1] - start;
        const int tiles = (skip_single && len == 1) ? 0 : (len + tile_tokens - 1) / tile_tokens;
        if ((int)blockIdx.x < seen + tiles) {
            seq = s;
            row0 = start + ((int)blockIdx.x - seen) * tile_tokens;
            ntok = min(tile_tokens, start + len - row0);
            return;
        }
        seen += tiles;
    }
}
