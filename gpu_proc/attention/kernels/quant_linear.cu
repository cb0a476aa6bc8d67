// Quantized linear layers on GGUF blocks as they are stored (gpu_proc/quant.py is the spec).
//
// w: a weight's blocks [N, K / 32, block bytes], contiguous, read as 16-bit words: every block
//    size is even (18, 20, 22, 24, 34 bytes), so a block starts 2-byte aligned and nothing wider is.
// A block is 32 consecutive weights of one row: an fp16 scale d, for Q4_1 / Q5_1 an fp16 offset
// m, for Q5 32 high bits, then 16 bytes of nibbles (weights j and j + 16 share byte j) or, for
// Q8_0, 32 int8. A weight is d (q - zero) (Q4_0: zero 8, Q5_0: 16, Q8_0: 0) or d q + m.
//
// rs_qgemv (decode-shaped, few rows): one warp per output row, lanes strided over the row's
// blocks, up to RS_QGEMV_TOKENS rows of x per CTA reading each unpacked block; the block's part is
// d * sum(q x) + m' * sum(x) (m' = m, or -zero d), added in fp32, then a fixed xor-shuffle tree.
// An output's order of operations depends on its row and the weight only, never on how many rows
// of x share the launch (batch invariance, as the CPU kernel).
// rs_qdequant (prefill-shaped): blocks to a dense weight (optionally a gather of rows: the
// embedding), bit for bit quant.dequantize (the products and sums are not contracted into fmas),
// for the tensor-core GEMM that follows.

#define RS_QGEMV_WARPS 4     // output rows per CTA: 128 threads
#define RS_QGEMV_TOKENS 8    // rows of x per CTA (grid.y covers the rest)
#define RS_QBLOCK 32

// WORDS: block size in 16-bit words; NIB: word of the first nibble byte (Q8_0: of the first int8);
// HIGH: word of Q5's high bits (-1: none); ZERO: the integer's offset; MIN: an fp16 m at word 1.
template <int WORDS, int NIB, int HIGH, int ZERO, bool MIN, bool INT8>
struct RsQFormat {
    enum { kWords = WORDS, kMin = MIN };

    // The block's 32 integers (as floats), its scale d and the offset m' of w = d q + m'.
    static __device__ __forceinline__ void unpack(const unsigned short* __restrict__ blk, float* q, float& d,
                                                  float& m) {
        d = RsF16::to_float(blk[0]);
        if (INT8) {
#pragma unroll
            for (int i = 0; i < 16; ++i) {
                const unsigned int word = blk[NIB + i];
                q[2 * i] = (float)(signed char)(word & 0xffu);
                q[2 * i + 1] = (float)(signed char)(word >> 8);
            }
        } else {
            unsigned int high = 0;
            if (HIGH >= 0) {
                high = (unsigned int)blk[HIGH] | ((unsigned int)blk[HIGH + 1] << 16);
            }
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const unsigned int word = blk[NIB + i];  // bytes 2i and 2i + 1 of the nibbles
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const unsigned int byte = (word >> (8 * h)) & 0xffu;
                    const int j = 2 * i + h;
                    q[j] = (float)((byte & 0xfu) | (((high >> j) & 1u) << 4));
                    q[j + 16] = (float)((byte >> 4) | (((high >> (j + 16)) & 1u) << 4));
                }
            }
        }
        if (MIN) {
            m = RsF16::to_float(blk[1]);
        } else {
            m = -(float)ZERO * d;
        }
    }

    // Integer j of the block (a runtime j: no register array indexed at run time).
    static __device__ __forceinline__ float integer(const unsigned short* __restrict__ blk, int j) {
        if (INT8) {
            return (float)(signed char)((blk[NIB + j / 2] >> (8 * (j & 1))) & 0xffu);
        }
        const int byte = j % 16;
        unsigned int n = (blk[NIB + byte / 2] >> (8 * (byte & 1) + 4 * (j / 16))) & 0xfu;
        if (HIGH >= 0) {
            const unsigned int high = (unsigned int)blk[HIGH] | ((unsigned int)blk[HIGH + 1] << 16);
            n |= ((high >> j) & 1u) << 4;
        }
        return (float)n;
    }

    // Weight j of the block exactly as quant.dequantize computes it.
    static __device__ __forceinline__ float value(float q, float d, float m) {
        if (MIN) {
            return __fadd_rn(__fmul_rn(d, q), m);
        }
        return __fmul_rn(d, q - (float)ZERO);
    }
};

struct RsQ4_0 : RsQFormat<9, 1, -1, 8, false, false> {};
struct RsQ4_1 : RsQFormat<10, 2, -1, 0, true, false> {};
struct RsQ5_0 : RsQFormat<11, 3, 1, 16, false, false> {};
struct RsQ5_1 : RsQFormat<12, 4, 2, 0, true, false> {};
struct RsQ8_0 : RsQFormat<17, 1, -1, 0, false, true> {};

// out[t, n] = sum_k x[t, k] w[n, k] (+ bias[n]) for t < t_rows, n < n_rows.
// x: [t_rows, K] rows x_stride elements apart (a multiple of 8, 16-byte aligned: the launcher checks).
template <typename F, typename T>
__global__ void __launch_bounds__(RS_QGEMV_WARPS * RS_WARP) rs_qgemv(
    const unsigned short* __restrict__ w,
    const typename T::storage* __restrict__ x, const long long x_stride,
    const typename T::storage* __restrict__ bias,  // [N], or null
    typename T::storage* __restrict__ out, const long long out_stride,
    const int n_rows, const int n_blocks, const int t_rows) {
    const int lane = threadIdx.x % RS_WARP;
    const int row = blockIdx.x * RS_QGEMV_WARPS + threadIdx.x / RS_WARP;
    const int t0 = blockIdx.y * RS_QGEMV_TOKENS;
    if (row >= n_rows || t0 >= t_rows) {
        return;  // a whole warp: the shuffles below never see a missing lane
    }
    const int tokens = min(RS_QGEMV_TOKENS, t_rows - t0);
    float acc[RS_QGEMV_TOKENS];
#pragma unroll
    for (int t = 0; t < RS_QGEMV_TOKENS; ++t) {
        acc[t] = 0.f;
    }
    const unsigned short* w_row = w + (long long)row * n_blocks * F::kWords;
    for (int b = lane; b < n_blocks; b += RS_WARP) {
        float q[RS_QBLOCK], d, m;
        F::unpack(w_row + (long long)b * F::kWords, q, d, m);
#pragma unroll
        for (int t = 0; t < RS_QGEMV_TOKENS; ++t) {
            if (t < tokens) {
                const typename T::storage* xb = x + (long long)(t0 + t) * x_stride + (long long)b * RS_QBLOCK;
                float dot = 0.f, sum = 0.f;
#pragma unroll
                for (int c = 0; c < RS_QBLOCK / 8; ++c) {
                    float xs[8];
                    rs_load8<T>(xb + 8 * c, xs);
#pragma unroll
                    for (int i = 0; i < 8; ++i) {
                        dot += q[8 * c + i] * xs[i];
                        sum += xs[i];
                    }
                }
                acc[t] += d * dot + m * sum;
            }
        }
    }
#pragma unroll
    for (int t = 0; t < RS_QGEMV_TOKENS; ++t) {
#pragma unroll
        for (int offset = RS_WARP / 2; offset > 0; offset >>= 1) {
            acc[t] += __shfl_xor_sync(0xffffffffu, acc[t], offset);
        }
    }
    if (lane == 0) {
        const float b = bias ? T::to_float(bias[row]) : 0.f;
        for (int t = 0; t < tokens; ++t) {
            out[(long long)(t0 + t) * out_stride + row] = T::from_float(acc[t] + b);
        }
    }
}

// out[r, :] = the dequantized row rows[r] of w (rows null: row r), for r < out_rows; a row index
// outside [0, n_src_rows) gives a row of NaN (a bad token id is loud, never another row's data).
// One thread per 8 weights: consecutive threads write consecutive runs of a row.
template <typename F, typename T>
__global__ void __launch_bounds__(256) rs_qdequant(
    const unsigned short* __restrict__ w, const long long n_src_rows, const int n_blocks,
    const long long* __restrict__ rows,  // [out_rows], or null
    typename T::storage* __restrict__ out, const long long out_rows) {
    const long long per_row = (long long)n_blocks * (RS_QBLOCK / 8);
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= out_rows * per_row) {
        return;
    }
    const long long r = i / per_row;
    const int part = (int)(i - r * per_row);
    const int b = part / (RS_QBLOCK / 8);
    const int j0 = (part % (RS_QBLOCK / 8)) * 8;
    typename T::storage* dst = out + r * n_blocks * RS_QBLOCK + (long long)b * RS_QBLOCK + j0;
    const long long src = rows ? rows[r] : r;
    if (src < 0 || src >= n_src_rows) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            dst[j] = T::from_float(__int_as_float(0x7fc00000));
        }
        return;
    }
    const unsigned short* blk = w + (src * n_blocks + b) * F::kWords;
    const float d = RsF16::to_float(blk[0]);
    const float m = F::kMin ? RsF16::to_float(blk[1]) : 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        dst[j] = T::from_float(F::value(F::integer(blk, j0 + j), d, m));
    }
}
