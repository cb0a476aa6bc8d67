// Paged decode attention: one CTA per (query token, group of query heads sharing a KV head,
// KV split). Every token t attends to positions 0..positions[t] of its sequence through the block
// table, so the kernel is exact for any flat batch; it is the fast path when each row has one
// query token (decode), where a whole CTA streams one row's cache once for all heads of a group.
//
// Work split inside a CTA (RS_DEC_WARPS warps): warp w takes KV blocks w, w + RS_DEC_WARPS, ... of
// the CTA's block range. Inside a warp, each token of a pass is held by TPT = D / 8 lanes, each
// lane owning 8 consecutive channels (one 16-byte load each of K and V in fp16/bf16); a pass covers
// 32 / TPT tokens. Scores are reduced inside a lane group, the running max is warp-wide, and each
// lane keeps partial sum-exp and V accumulators that are reduced across groups, then across warps
// through shared memory at the end.
//
// Mixed steps: with `single_qsl` (query_start_loc) set, a CTA whose token belongs to a sequence
// with more than one new token exits at once; the prefill kernel covers those tokens, skipping the
// one-token sequences, so each output row is written by exactly one of the two launches.
//
// Split-KV (long contexts at small batch): grid.z = number of splits. Each row shares out its own
// blocks among them (ceil(blocks / splits), at least min_blocks_per_split each), so a short row
// under a grid planned for a longer context (a CUDA graph's) still uses every split; each CTA writes
// its unnormalised accumulator plus (max, sum-exp) to fp32 scratch, and rs_decode_merge combines
// the splits (an empty one writes max -inf, sum 0). With one split the CTA writes the output.
//
// Resources (`ringserve kernel-resources`: NVRTC 13.0, sm_90): fp16 D = 128 takes 82 / 113 / 162
// registers for groups 1 / 2 / 4, each lane keeping eight 16-byte loads in flight. A group of 8
// would need more than 255 registers, so a GQA-8 model runs two CTAs of 4 heads per KV head; the
// second reads the same blocks, mostly from L2. Groups of 3 (SmolLM2: 9 query heads on 3 KV heads)
// read each KV head once.

#define RS_DEC_WARPS 4
// Resident CTAs asked of ptxas: without a floor it settles some variants at 64 or 96 registers
// and spills 4-32 bytes (NVRTC 13.0); with 4 (3 for groups of 4 or more, which need more
// registers) no half-precision variant spills on sm_80 or sm_90 (`ringserve kernel-resources`).
#define RS_DEC_MIN_CTAS(GROUP) ((GROUP) >= 4 ? 3 : 4)

template <typename T, int D, int GROUP>
__global__ void __launch_bounds__(RS_DEC_WARPS * RS_WARP, RS_DEC_MIN_CTAS(GROUP)) rs_paged_decode(
    const typename T::storage* __restrict__ q, const long long q_row_stride, const long long q_head_stride,
    const typename T::storage* __restrict__ k_cache, const typename T::storage* __restrict__ v_cache,
    const int* __restrict__ block_tables, const int max_blocks,
    const long long* __restrict__ positions, const long long* __restrict__ token_seq,
    const int num_heads, const int num_kv_heads, const float scale_log2, const int min_blocks_per_split,
    const int* __restrict__ single_qsl,
    typename T::storage* __restrict__ out, float* __restrict__ part_acc, float* __restrict__ part_ml) {
    constexpr int TPT = D / 8;             // lanes per token
    constexpr int TOK_PER_PASS = RS_WARP / TPT;
    constexpr int PASSES = RS_BLOCK_SIZE / TOK_PER_PASS;
    // Passes whose K and V loads are issued together: as many as fit in 32 registers of raw data
    // per lane (4 passes, eight 16-byte loads, in fp16/bf16). Whole blocks at once would double the
    // loads in flight but cost 64 registers and a third of the resident CTAs (ptxas: 186 registers
    // for fp16 D = 128 group 4, 2 CTAs per SM).
    constexpr int RAW_REGS_PER_PASS = 2 * (int)sizeof(RsRaw8<T>) / 4;
    constexpr int BATCH = PASSES < 32 / RAW_REGS_PER_PASS ? PASSES : 32 / RAW_REGS_PER_PASS;
    static_assert(D == 32 || D == 64 || D == 128, "head_dim must be 32, 64 or 128");

    __shared__ float sm_m[RS_DEC_WARPS][GROUP];
    __shared__ float sm_l[RS_DEC_WARPS][GROUP];
    __shared__ float sm_acc[RS_DEC_WARPS][GROUP][D];

    const int t = blockIdx.x;
    const int num_tokens = gridDim.x;
    if (single_qsl != nullptr && rs_chunk_token(single_qsl, token_seq, t)) {
        return;  // uniform over the CTA, before any barrier
    }
    const int h0 = blockIdx.y * GROUP;                    // first query head of this CTA
    const int kvh = h0 / (num_heads / num_kv_heads);      // GROUP divides heads-per-KV-head
    const int split = blockIdx.z;
    const int warp = threadIdx.x / RS_WARP;
    const int lane = threadIdx.x % RS_WARP;
    const int grp = lane / TPT;                           // which token of a pass
    const int li = lane % TPT;                            // which 8 channels

    const long long ctx = positions[t] + 1;               // keys 0..positions[t] are visible
    const int num_blocks = (int)((ctx + RS_BLOCK_SIZE - 1) / RS_BLOCK_SIZE);
    const int per_split = max(min_blocks_per_split, (num_blocks + (int)gridDim.z - 1) / (int)gridDim.z);
    const int b_begin = split * per_split;
    const int b_end = min(num_blocks, b_begin + per_split);
    const int* table = block_tables + token_seq[t] * (long long)max_blocks;

    float qr[GROUP][8];
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
        rs_load8<T>(q + t * q_row_stride + (long long)(h0 + g) * q_head_stride + li * 8, qr[g]);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            qr[g][i] *= scale_log2;
        }
    }

    float m[GROUP], l[GROUP], acc[GROUP][8];
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
        m[g] = RS_NEG_INF;
        l[g] = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            acc[g][i] = 0.f;
        }
    }

    const long long head_block_elems = (long long)RS_BLOCK_SIZE * D;
    for (int b = b_begin + warp; b < b_end; b += RS_DEC_WARPS) {
        const long long base = ((long long)table[b] * num_kv_heads + kvh) * head_block_elems;
#pragma unroll 1
        for (int p0 = 0; p0 < PASSES; p0 += BATCH) {
            // NOTE: block table[b] belongs to this sequence, so all 16 of its slots are readable: the
            // K and V of BATCH passes are loaded unguarded, before any math, and are in flight
            // together. A slot past the context may hold anything (NaN bit patterns from an unwritten
            // slot): its score becomes -inf and its V zeros, by selects, never by arithmetic.
            RsRaw8<T> kraw[BATCH], vraw[BATCH];
#pragma unroll
            for (int p = 0; p < BATCH; ++p) {
                const long long off = base + (long long)((p0 + p) * TOK_PER_PASS + grp) * D + li * 8;
                kraw[p] = rs_load_raw8<T>(k_cache + off);
                vraw[p] = rs_load_raw8<T>(v_cache + off);
            }
#pragma unroll
            for (int p = 0; p < BATCH; ++p) {
                const int tok = (p0 + p) * TOK_PER_PASS + grp;
                const bool valid = (long long)b * RS_BLOCK_SIZE + tok < ctx;
                float kf[8], vf[8];
                rs_convert8<T>(kraw[p], kf);
                rs_convert8<T>(vraw[p], vf);
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    vf[i] = valid ? vf[i] : 0.f;
                }
#pragma unroll
                for (int g = 0; g < GROUP; ++g) {
                    float s = 0.f;
#pragma unroll
                    for (int i = 0; i < 8; ++i) {
                        s = fmaf(qr[g][i], kf[i], s);
                    }
                    s = rs_sum_xor<1, TPT>(s);
                    s = valid ? s : RS_NEG_INF;
                    // The first pass a warp runs always holds position b*16 < ctx, so m_new is finite
                    // from then on; the guard only protects against a pass with no valid token first.
                    const float m_new = fmaxf(m[g], rs_max_xor<TPT, RS_WARP>(s));
                    const float alpha = (m_new == RS_NEG_INF) ? 1.f : exp2f(m[g] - m_new);
                    const float pr = valid ? exp2f(s - m_new) : 0.f;
                    l[g] = l[g] * alpha + pr;
#pragma unroll
                    for (int i = 0; i < 8; ++i) {
                        acc[g][i] = fmaf(pr, vf[i], acc[g][i] * alpha);
                    }
                    m[g] = m_new;
                }
            }
        }
    }

    // Lanes holding the same channels in different token groups share the warp-wide max, so
    // their partial sums add directly.
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
        l[g] = rs_sum_xor<TPT, RS_WARP>(l[g]);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            acc[g][i] = rs_sum_xor<TPT, RS_WARP>(acc[g][i]);
        }
    }
    if (grp == 0) {
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                sm_acc[warp][g][li * 8 + i] = acc[g][i];
            }
        }
    }
    if (lane == 0) {
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
            sm_m[warp][g] = m[g];
            sm_l[warp][g] = l[g];
        }
    }
    __syncthreads();

    for (int idx = threadIdx.x; idx < GROUP * D; idx += blockDim.x) {
        const int g = idx / D;
        const int d = idx % D;
        float mx = RS_NEG_INF;
#pragma unroll
        for (int w = 0; w < RS_DEC_WARPS; ++w) {
            mx = fmaxf(mx, sm_m[w][g]);
        }
        float sum = 0.f, o = 0.f;
        if (mx != RS_NEG_INF) {  // -inf only for an empty split of a short row
#pragma unroll
            for (int w = 0; w < RS_DEC_WARPS; ++w) {
                const float c = exp2f(sm_m[w][g] - mx);  // exp2(-inf) == 0 for idle warps
                sum = fmaf(sm_l[w][g], c, sum);
                o = fmaf(sm_acc[w][g][d], c, o);
            }
        }
        const long long row = (long long)t * num_heads + h0 + g;  // [T, H] row of the output
        if (part_acc == nullptr) {
            out[row * D + d] = T::from_float(o / sum);
        } else {
            const long long prow = (long long)split * num_tokens * num_heads + row;  // [S, T, H]
            part_acc[prow * D + d] = o;
            if (d == 0) {
                part_ml[prow * 2] = mx;
                part_ml[prow * 2 + 1] = sum;
            }
        }
    }
}

// Merge the splits of one (token, head): grid (T, H), D threads, one channel each.
template <typename T, int D>
__global__ void rs_decode_merge(
    const float* __restrict__ part_acc, const float* __restrict__ part_ml, const int num_splits,
    const int* __restrict__ single_qsl, const long long* __restrict__ token_seq,
    typename T::storage* __restrict__ out) {
    if (single_qsl != nullptr && rs_chunk_token(single_qsl, token_seq, blockIdx.x)) {
        return;  // the decode kernel skipped this token: its scratch rows were never written
    }
    const long long row = (long long)blockIdx.x * gridDim.y + blockIdx.y;
    const long long rows = (long long)gridDim.x * gridDim.y;
    const int d = threadIdx.x;
    float mx = RS_NEG_INF;
    for (int s = 0; s < num_splits; ++s) {
        mx = fmaxf(mx, part_ml[(s * rows + row) * 2]);
    }
    // Split 0 always holds position 0, so mx is finite.
    float num = 0.f, den = 0.f;
    for (int s = 0; s < num_splits; ++s) {
        const long long prow = s * rows + row;
        const float c = exp2f(part_ml[prow * 2] - mx);
        den = fmaf(part_ml[prow * 2 + 1], c, den);
        num = fmaf(part_acc[prow * D + d], c, num);
    }
    out[row * D + d] = T::from_float(num / den);
}
