// Paged prefill attention on tensor cores (fp16/bf16, sm_80+), FlashAttention-2 style: one CTA per
// (query tile, KV head). A tile holds RS_TC_ROWS = 64 query rows, each a (token, query head) pair
// of the KV head's group (row r: token r / group, head kvh * group + r % group), so the heads of a
// GQA group share every K/V tile the CTA reads; a tile covers 64 / group tokens of one sequence.
// Warp w owns rows 16w..16w+15 and keeps them in registers throughout:
//
//   Q (16 x D)   A fragments, loaded once with ldmatrix
//   S (16 x 64)  Q.K^T for one 64-key tile: mma.sync m16n8k16, fp32 accumulators
//   P            S after the online softmax (log2 domain), rounded to fp16/bf16; its accumulator
//                layout is the A-fragment layout of the next mma, so P never leaves registers
//   O (16 x D)   O = O * alpha + P.V: mma.sync with V fragments from ldmatrix.trans
//
// K/V tiles are staged in shared memory, 64 keys (4 blocks through the block table) at a time;
// keys past the tile's last visible position are stored as zeros, so no unwritten slot (NaN bit
// patterns) reaches a product. The causal mask (key position <= row position) is applied to S by
// selects. Shared rows are padded by 8 elements so the 8 rows an ldmatrix reads fall in distinct
// banks. Fragment layouts: PTX ISA, "Matrix fragments for mma.m16n8k16" and "ldmatrix".
//
// Tiles are numbered sequence by sequence, as in paged_prefill.cu (surplus CTAs exit at once);
// with `skip_single` one-token sequences get no tile (the decode kernel covers them).

#define RS_TC_ROWS 64
#define RS_TC_KEYS 64
static_assert(RS_TC_ROWS <= RS_TC_KEYS, "the Q tile is staged in sk, which holds RS_TC_KEYS rows");
#define RS_TC_THREADS 128
#define RS_TC_PAD 8

template <typename T>
struct RsMma;

// D[16x8] += A[16x16] . B[16x8], fp32 accumulate; `a` and `b` hold packed 16-bit pairs.
template <>
struct RsMma<RsF16> {
    static __device__ __forceinline__ void run(float* d, const unsigned* a, const unsigned* b) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%10,%11,%12,%13};"
            : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),
              "f"(d[0]), "f"(d[1]), "f"(d[2]), "f"(d[3]));
    }
};

template <>
struct RsMma<RsBF16> {
    static __device__ __forceinline__ void run(float* d, const unsigned* a, const unsigned* b) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%10,%11,%12,%13};"
            : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),
              "f"(d[0]), "f"(d[1]), "f"(d[2]), "f"(d[3]));
    }
};

// Four 8x8 16-bit matrices from shared memory: lanes 8i..8i+7 give the rows of matrix i; register
// i of lane l gets row l/4, columns 2(l%4)..+1 of matrix i (`.trans`: rows 2(l%4)..+1 of column l/4).
__device__ __forceinline__ void rs_ldmatrix_x4(unsigned* r, const void* row) {
    const unsigned addr = (unsigned)__cvta_generic_to_shared(row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}

__device__ __forceinline__ void rs_ldmatrix_x4_trans(unsigned* r, const void* row) {
    const unsigned addr = (unsigned)__cvta_generic_to_shared(row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}

template <typename T>
__device__ __forceinline__ unsigned rs_pack2(const float lo, const float hi) {
    return (unsigned)T::from_float(lo) | ((unsigned)T::from_float(hi) << 16);
}

template <typename T, int D>
__global__ void __launch_bounds__(RS_TC_THREADS) rs_paged_prefill_tc(
    const typename T::storage* __restrict__ q, const long long q_row_stride, const long long q_head_stride,
    const typename T::storage* __restrict__ k_cache, const typename T::storage* __restrict__ v_cache,
    const int* __restrict__ block_tables, const int max_blocks,
    const int* __restrict__ query_start_loc, const int num_seqs, const int skip_single,
    const long long* __restrict__ positions, const int num_heads, const int num_kv_heads,
    const float scale_log2, typename T::storage* __restrict__ out) {
    typedef typename T::storage S;
    constexpr int LD = D + RS_TC_PAD;     // shared row stride in elements (a multiple of 8: 16 bytes)
    constexpr int KSTEPS = D / 16;        // k-steps of Q.K^T
    constexpr int NT = RS_TC_KEYS / 8;    // 8-key column tiles of S
    constexpr int DT = D / 8;             // 8-channel column tiles of O
    constexpr int VECS = D / 8;           // 16-byte vectors per row
    static_assert(D == 32 || D == 64 || D == 128, "head_dim must be 32, 64 or 128");

    __shared__ __align__(16) S sk[RS_TC_KEYS * LD];  // the Q tile first, then each K tile
    __shared__ __align__(16) S sv[RS_TC_KEYS * LD];

    const int group = num_heads / num_kv_heads;  // the launcher guarantees group <= RS_TC_ROWS
    const int tile_tokens = RS_TC_ROWS / group;
    int seq, row0, ntok;
    rs_prefill_tile(query_start_loc, num_seqs, skip_single, tile_tokens, seq, row0, ntok);
    if (seq < 0) {
        return;  // surplus CTA; uniform over the CTA, so no barrier is skipped
    }
    const int kvh = blockIdx.y;
    const int tid = threadIdx.x;
    const int warp = tid / RS_WARP;
    const int lane = tid % RS_WARP;
    const int nrows = ntok * group;
    // NOTE: a chunk's positions increase by one per token, so row r sits at first_pos + r / group.
    const long long first_pos = positions[row0];
    const long long max_pos = first_pos + ntok - 1;

    for (int idx = tid; idx < RS_TC_ROWS * VECS; idx += RS_TC_THREADS) {
        const int r = idx / VECS;
        const int c = idx % VECS;
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (r < nrows) {
            const long long h = (long long)kvh * group + r % group;
            v = *reinterpret_cast<const uint4*>(q + (long long)(row0 + r / group) * q_row_stride + h * q_head_stride + c * 8);
        }
        *reinterpret_cast<uint4*>(sk + r * LD + c * 8) = v;
    }
    __syncthreads();
    unsigned qf[KSTEPS][4];
    {
        const int r = warp * 16 + (lane % 8) + ((lane / 8) % 2) * 8;
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ++ks) {
            rs_ldmatrix_x4(qf[ks], sk + r * LD + ks * 16 + (lane / 16) * 8);
        }
    }
    __syncthreads();  // sk now takes K tiles

    // This lane's two rows (fragment rows lane/4 and lane/4 + 8 of the warp's 16); -1: padding.
    const int ra = warp * 16 + lane / 4;
    const int rb = ra + 8;
    const long long pos_a = ra < nrows ? first_pos + ra / group : -1;
    const long long pos_b = rb < nrows ? first_pos + rb / group : -1;
    float o[DT][4];
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) {
        o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.f;
    }
    float m_a = RS_NEG_INF, m_b = RS_NEG_INF, l_a = 0.f, l_b = 0.f;
    const int* table = block_tables + (long long)seq * max_blocks;
    const int num_kt = (int)(max_pos / RS_TC_KEYS) + 1;

    for (int kt = 0; kt < num_kt; ++kt) {
        const long long key0 = (long long)kt * RS_TC_KEYS;
        for (int idx = tid; idx < RS_TC_KEYS * VECS; idx += RS_TC_THREADS) {
            const int j = idx / VECS;
            const int c = idx % VECS;
            uint4 kv = make_uint4(0u, 0u, 0u, 0u);
            uint4 vv = make_uint4(0u, 0u, 0u, 0u);
            const long long kpos = key0 + j;
            if (kpos <= max_pos) {
                const long long off = ((long long)table[kpos / RS_BLOCK_SIZE] * num_kv_heads + kvh) *
                                          (long long)(RS_BLOCK_SIZE * D) + (kpos % RS_BLOCK_SIZE) * D + c * 8;
                kv = *reinterpret_cast<const uint4*>(k_cache + off);
                vv = *reinterpret_cast<const uint4*>(v_cache + off);
            }
            *reinterpret_cast<uint4*>(sk + j * LD + c * 8) = kv;
            *reinterpret_cast<uint4*>(sv + j * LD + c * 8) = vv;
        }
        __syncthreads();

        float s[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
        }
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ++ks) {
#pragma unroll
            for (int nt = 0; nt < NT; nt += 2) {  // B fragments of column tiles nt and nt + 1
                unsigned b[4];
                const int key = nt * 8 + (lane % 8) + (lane / 16) * 8;
                rs_ldmatrix_x4(b, sk + key * LD + ks * 16 + ((lane / 8) % 2) * 8);
                RsMma<T>::run(s[nt], qf[ks], b);
                RsMma<T>::run(s[nt + 1], qf[ks], b + 2);
            }
        }

        // Online softmax over this tile's keys; a row's 64 scores are spread over the 4 lanes of
        // a quad, so row maxima need two shuffles; the sums stay per lane until the end.
        float mx_a = RS_NEG_INF, mx_b = RS_NEG_INF;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const long long kpos = key0 + nt * 8 + 2 * (lane % 4) + e;
                s[nt][e] = kpos <= pos_a ? s[nt][e] * scale_log2 : RS_NEG_INF;
                s[nt][2 + e] = kpos <= pos_b ? s[nt][2 + e] * scale_log2 : RS_NEG_INF;
                mx_a = fmaxf(mx_a, s[nt][e]);
                mx_b = fmaxf(mx_b, s[nt][2 + e]);
            }
        }
        mx_a = fmaxf(m_a, rs_max_xor<1, 4>(mx_a));
        mx_b = fmaxf(m_b, rs_max_xor<1, 4>(mx_b));
        // A row with nothing visible yet (max -inf) subtracts 0: exp2(-inf) gives 0, never NaN.
        const float base_a = mx_a == RS_NEG_INF ? 0.f : mx_a;
        const float base_b = mx_b == RS_NEG_INF ? 0.f : mx_b;
        const float alpha_a = exp2f(m_a - base_a);
        const float alpha_b = exp2f(m_b - base_b);
        m_a = mx_a;
        m_b = mx_b;
        float sum_a = 0.f, sum_b = 0.f;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                s[nt][e] = exp2f(s[nt][e] - base_a);
                s[nt][2 + e] = exp2f(s[nt][2 + e] - base_b);
                sum_a += s[nt][e];
                sum_b += s[nt][2 + e];
            }
        }
        l_a = l_a * alpha_a + sum_a;
        l_b = l_b * alpha_b + sum_b;
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) {
            o[dt][0] *= alpha_a;
            o[dt][1] *= alpha_a;
            o[dt][2] *= alpha_b;
            o[dt][3] *= alpha_b;
        }

#pragma unroll
        for (int kk = 0; kk < RS_TC_KEYS / 16; ++kk) {  // O += P . V, 16 keys per k-step
            unsigned a[4];
            a[0] = rs_pack2<T>(s[2 * kk][0], s[2 * kk][1]);
            a[1] = rs_pack2<T>(s[2 * kk][2], s[2 * kk][3]);
            a[2] = rs_pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            a[3] = rs_pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
            for (int dt = 0; dt < DT; dt += 2) {  // B fragments of channel tiles dt and dt + 1
                unsigned b[4];
                const int key = kk * 16 + (lane % 8) + ((lane / 8) % 2) * 8;
                rs_ldmatrix_x4_trans(b, sv + key * LD + dt * 8 + (lane / 16) * 8);
                RsMma<T>::run(o[dt], a, b);
                RsMma<T>::run(o[dt + 1], a, b + 2);
            }
        }
        __syncthreads();  // the next tile overwrites sk and sv
    }

    l_a = rs_sum_xor<1, 4>(l_a);
    l_b = rs_sum_xor<1, 4>(l_b);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int r = half ? rb : ra;
        if (r < nrows) {  // every real row saw key 0, so its sum is > 0
            const float inv = 1.f / (half ? l_b : l_a);
            const long long row = (long long)(row0 + r / group) * num_heads + (long long)kvh * group + r % group;
#pragma unroll
            for (int dt = 0; dt < DT; ++dt) {
                const int d = dt * 8 + 2 * (lane % 4);
                *reinterpret_cast<unsigned*>(out + row * D + d) =
                    rs_pack2<T>(o[dt][2 * half] * inv, o[dt][2 * half + 1] * inv);
            }
        }
    }
}
