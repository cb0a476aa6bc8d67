// KV append: copy one step's new keys and values into their cache slots.
//
// k, v:        [T, num_kv_heads, head_dim] with heads contiguous; rows may be strided (a view of a
//              fused qkv projection), row stride given in 16-byte vectors.
// slot_mapping: int64 [T], flat slot = block_id * 16 + position % 16; a negative slot is padding
//              and is skipped.
// The copy is dtype-agnostic, so one kernel serves fp16, bf16 and fp32; it moves 16-byte vectors,
// which the launcher guarantees by checking head_dim * itemsize % 16 == 0 and alignment.

__global__ void rs_kv_append(
    const uint4* __restrict__ k, const uint4* __restrict__ v,
    uint4* __restrict__ k_cache, uint4* __restrict__ v_cache,
    const long long* __restrict__ slot_mapping,
    const long long k_row_vecs, const long long v_row_vecs,  // row strides of k and v, in vectors
    const int num_kv_heads, const int head_vecs,  // head_dim / 8
    const long long num_slots) {
    const long long t = blockIdx.x;
    const long long slot = slot_mapping[t];
    // NOTE: an out-of-range slot cannot be reported from here; skipping it keeps a bad step from
    // corrupting other sequences' blocks (the reference would raise, and the sweep tests compare).
    if (slot < 0 || slot >= num_slots) {
        return;
    }
    const long long block = slot / RS_BLOCK_SIZE;
    const int offset = (int)(slot % RS_BLOCK_SIZE);
    const int row_vecs = num_kv_heads * head_vecs;
    for (int i = threadIdx.x; i < row_vecs; i += blockDim.x) {
        const int h = i / head_vecs;
        const int d = i - h * head_vecs;
        const long long dst = ((block * num_kv_heads + h) * RS_BLOCK_SIZE + offset) * head_vecs + d;
        k_cache[dst] = k[t * k_row_vecs + i];
        v_cache[dst] = v[t * v_row_vecs + i];
    }
}
