// LoRA adapters' deltas on a projection's output, rows of different adapters in one launch: the
// gathered low-rank product (SGMV; gpu_proc/lora.py, LoraStep.delta is the spec, the CPU block's
// lora_add its twin). Launchers: gpu_proc/lora_cuda.py.
//
// x [T, in] and y [T, out] rows (strided), a [slots, R, in] and bt [slots, R, out] (B transposed,
// scaled), contiguous, in the model's dtype; slot_of [T] int32, -1 for a token of the base model
// (its row of y is never touched). A fused group's R = G * r ranks are its G targets' in order;
// target g writes only its own output columns, [seg[g], seg[g + 1]), so B's zero blocks are never
// read.
// rs_lora_shrink: tmp[t, j] = x[t] . a[slot, j] in fp32, one warp per (token, rank), lanes strided
// over in, a fixed xor-shuffle tree: a token's result depends on its own row and slot only.
// rs_lora_expand: y[t, o] += sum_k tmp[t, g r + k] * bt[slot, g r + k, o], one thread per output
// column, added in fp32 and rounded once into y's dtype.

#define RS_LORA_WARPS 4  // ranks per shrink CTA: 128 threads
#define RS_LORA_COLS 128 // output columns per expand CTA

template <typename T>
__global__ void rs_lora_shrink(const typename T::storage* __restrict__ x, long long x_stride,
                               const typename T::storage* __restrict__ a, const int* __restrict__ slot_of,
                               float* __restrict__ tmp, int in, int rank) {
    const int t = blockIdx.y;
    const int s = slot_of[t];
    const int warp = threadIdx.x / RS_WARP, lane = threadIdx.x % RS_WARP;
    const int j = blockIdx.x * RS_LORA_WARPS + warp;
    if (s < 0 || j >= rank) {
        return;  // uniform over the warp: every lane of it leaves, none waits in a shuffle
    }
    const typename T::storage* xr = x + (long long)t * x_stride;
    const typename T::storage* ar = a + ((long long)s * rank + j) * in;
    float acc = 0.f;
    for (int k = lane; k < in; k += RS_WARP) {
        acc += T::to_float(xr[k]) * T::to_float(ar[k]);
    }
    acc = rs_sum_xor<1, RS_WARP>(acc);
    if (lane == 0) {
        tmp[(long long)t * rank + j] = acc;
    }
}

template <typename T>
__global__ void rs_lora_expand(typename T::storage* __restrict__ y, long long y_stride,
                               const float* __restrict__ tmp, const typename T::storage* __restrict__ bt,
                               const int* __restrict__ slot_of, int out, int rank, int groups, int seg1,
                               int seg2) {
    const int t = blockIdx.y;
    const int s = slot_of[t];
    const int o = blockIdx.x * RS_LORA_COLS + threadIdx.x;
    if (s < 0 || o >= out) {
        return;
    }
    const int r = rank / groups;
    const int g = (o >= seg1) + (o >= seg2);  // seg1 / seg2: where targets 1 and 2 begin (out: none)
    const float* tr = tmp + (long long)t * rank + g * r;
    const typename T::storage* b = bt + ((long long)s * rank + g * r) * out + o;
    float acc = 0.f;
    for (int k = 0; k < r; ++k) {
        acc += tr[k] * T::to_float(b[(long long)k * out]);
    }
    typename T::storage* yo = y + (long long)t * y_stride + o;
    *yo = T::from_float(T::to_float(*yo) + acc);
}
