// Paged prefill attention for the flat batch: one CTA per (query tile, query head). A tile is up
// to RS_PF_ROWS consecutive new tokens of one sequence; it attends fully to the sequence's cached
// prefix and causally inside its own chunk, both read from the paged cache (write_kv has already
// stored the chunk), one 16-token KV block at a time with an online softmax (FlashAttention-style,
// fp32 accumulation on CUDA cores).
//
// With `skip_single` set (mixed steps), one-token sequences get no tile: the decode kernel has
// already covered them.
//
// Tiles are numbered sequence by sequence; the grid is launched with the upper bound
// ceil(T / RS_PF_ROWS) + num_seqs (no host sync to count them) and surplus CTAs exit at once.
// Each CTA finds its sequence by a scan of query_start_loc, which is a few hundred L1-resident
// loads at most.

#define RS_PF_ROWS 32
#define RS_PF_THREADS 128

template <typename T, int D>
__global__ void __launch_bounds__(RS_PF_THREADS) rs_paged_prefill(
    const typename T::storage* __restrict__ q, const long long q_row_stride, const long long q_head_stride,
    const typename T::storage* __restrict__ k_cache, const typename T::storage* __restrict__ v_cache,
    const int* __restrict__ block_tables, const int max_blocks,
    const int* __restrict__ query_start_loc, const int num_seqs, const int skip_single,
    const long long* __restrict__ positions, const int num_heads, const int num_kv_heads,
    const float scale_log2, typename T::storage* __restrict__ out) {
    constexpr int VECS = D / 8;                                   // 16-byte vectors per head row
    constexpr int ROW_STEP = RS_PF_THREADS / D;                   // rows between a thread's rows
    constexpr int ROWS_PER_THREAD = RS_PF_ROWS / ROW_STEP;
    static_assert(D == 32 || D == 64 || D == 128, "head_dim must be 32, 64 or 128");

    // +1 padding: the score loop reads 16 different K rows (and 2 Q rows) at one channel per warp.
    __shared__ float sq[RS_PF_ROWS][D + 1];
    __shared__ float sk[RS_BLOCK_SIZE][D + 1];
    __shared__ float sv[RS_BLOCK_SIZE][D + 1];  // padded like sk: staging rows start on other banks
    __shared__ float sp[RS_PF_ROWS][RS_BLOCK_SIZE + 1];
    __shared__ float sm_m[RS_PF_ROWS];
    __shared__ float sm_l[RS_PF_ROWS];
    __shared__ float sm_alpha[RS_PF_ROWS];
    __shared__ long long spos[RS_PF_ROWS];

    int seq, row0, nrows;
    rs_prefill_tile(query_start_loc, num_seqs, skip_single, RS_PF_ROWS, seq, row0, nrows);
    if (seq < 0) {
        return;  // surplus CTA; the condition is uniform over the CTA, so no barrier is skipped
    }
    const int h = blockIdx.y;
    const int kvh = h / (num_heads / num_kv_heads);
    const int tid = threadIdx.x;

    for (int idx = tid; idx < RS_PF_ROWS * VECS; idx += RS_PF_THREADS) {
        const int r = idx / VECS;
        const int c = idx % VECS;
        float f[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        if (r < nrows) {
            rs_load8<T>(q + (long long)(row0 + r) * q_row_stride + (long long)h * q_head_stride + c * 8, f);
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            sq[r][c * 8 + i] = f[i] * scale_log2;
        }
    }
    if (tid < RS_PF_ROWS) {
        spos[tid] = tid < nrows ? positions[row0 + tid] : -1;  // -1: padding row sees no key
        sm_m[tid] = RS_NEG_INF;
        sm_l[tid] = 0.f;
    }
    __syncthreads();

    // NOTE: a chunk's positions increase by one per token, so the last row sees the most keys.
    const long long max_pos = spos[nrows - 1];
    const int num_kb = (int)(max_pos / RS_BLOCK_SIZE) + 1;
    const int* table = block_tables + (long long)seq * max_blocks;
    const int d_own = tid % D;
    const int r_first = tid / D;
    float acc[ROWS_PER_THREAD];
#pragma unroll
    for (int k = 0; k < ROWS_PER_THREAD; ++k) {
        acc[k] = 0.f;
    }

    for (int kb = 0; kb < num_kb; ++kb) {
        const long long base =
            ((long long)table[kb] * num_kv_heads + kvh) * (long long)(RS_BLOCK_SIZE * D);
        for (int idx = tid; idx < RS_BLOCK_SIZE * VECS; idx += RS_PF_THREADS) {
            const int j = idx / VECS;
            const int c = idx % VECS;
            // Slots past the last visible key may be uninitialised (NaN patterns): zeros instead,
            // so that p = 0 times V stays exactly 0.
            float kf[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
            float vf[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
            if ((long long)kb * RS_BLOCK_SIZE + j <= max_pos) {
                rs_load8<T>(k_cache + base + j * D + c * 8, kf);
                rs_load8<T>(v_cache + base + j * D + c * 8, vf);
            }
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                sk[j][c * 8 + i] = kf[i];
                sv[j][c * 8 + i] = vf[i];
            }
        }
        __syncthreads();

        {  // scores: thread -> key j, rows tid/16, tid/16 + 8, ...
            const int j = tid % RS_BLOCK_SIZE;
            const long long kpos = (long long)kb * RS_BLOCK_SIZE + j;
            for (int r = tid / RS_BLOCK_SIZE; r < RS_PF_ROWS; r += RS_PF_THREADS / RS_BLOCK_SIZE) {
                float s = RS_NEG_INF;
                if (kpos <= spos[r]) {  // causal inside the chunk, full over the prefix
                    s = 0.f;
#pragma unroll 16
                    for (int d = 0; d < D; ++d) {
                        s = fmaf(sq[r][d], sk[j][d], s);
                    }
                }
                sp[r][j] = s;
            }
        }
        __syncthreads();

        if (tid < RS_PF_ROWS) {  // online softmax, one thread per row
            const int r = tid;
            float mx = RS_NEG_INF;
#pragma unroll
            for (int j = 0; j < RS_BLOCK_SIZE; ++j) {
                mx = fmaxf(mx, sp[r][j]);
            }
            const float m_old = sm_m[r];
            const float m_new = fmaxf(m_old, mx);
            float alpha = 1.f, sum = 0.f;
            if (m_new != RS_NEG_INF) {
                alpha = exp2f(m_old - m_new);  // 0 on the row's first visible block
#pragma unroll
                for (int j = 0; j < RS_BLOCK_SIZE; ++j) {
                    const float p = exp2f(sp[r][j] - m_new);  // masked: exp2(-inf) == 0
                    sp[r][j] = p;
                    sum += p;
                }
            } else {  // padding row: nothing visible yet
#pragma unroll
                for (int j = 0; j < RS_BLOCK_SIZE; ++j) {
                    sp[r][j] = 0.f;
                }
            }
            sm_l[r] = sm_l[r] * alpha + sum;
            sm_m[r] = m_new;
            sm_alpha[r] = alpha;
        }
        __syncthreads();

#pragma unroll
        for (int k = 0; k < ROWS_PER_THREAD; ++k) {  // P . V, thread -> one channel of its rows
            const int r = r_first + k * ROW_STEP;
            float o = acc[k] * sm_alpha[r];
#pragma unroll
            for (int j = 0; j < RS_BLOCK_SIZE; ++j) {
                o = fmaf(sp[r][j], sv[j][d_own], o);
            }
            acc[k] = o;
        }
        __syncthreads();  // the next block overwrites sk, sv and sp
    }

#pragma unroll
    for (int k = 0; k < ROWS_PER_THREAD; ++k) {
        const int r = r_first + k * ROW_STEP;
        if (r < nrows) {  // every real row saw key 0, so sm_l[r] > 0
            out[((long long)(row0 + r) * num_heads + h) * D + d_own] = T::from_float(acc[k] / sm_l[r]);
        }
    }
}
