// The Llama forward's small operations, one pass over memory each, for the CPU.
//
// Spec: the torch functions in gpu_proc/cpu_ops.py (`*_reference`, the same math as
// model/llama.py's modules and Hugging Face's Llama); launchers with the checks: cpu_ops.py; sweep
// test: tests/gpu_proc/test_cpu_ops.py. Rounding follows the reference step by step where the
// reference rounds to the model dtype (RMSNorm, SiLU-mul, residual adds); rotary embeddings round
// once, from float32.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <atomic>

#include "cpu_common.h"
#include "cpu_kernels.h"

namespace ringserve_cpu {
namespace {

constexpr int64_t kRowGrain = 8;  // rows per parallel task

// out = w * round(x / rms(x)); `x` and `out` may be the same row.
template <typename T>
inline void norm_row(const T* x, const T* w, T* out, int64_t n, float eps) {
  vf acc = splat(0.0f);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const vf v = load(x + i);
    acc += v * v;
  }
  float ss = hsum(acc);
  for (int64_t j = i; j < n; ++j) ss += to_f(x[j]) * to_f(x[j]);
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  i = 0;
  for (; i + kLanes <= n; i += kLanes) store(out + i, load(w + i) * round_to<T>(load(x + i) * r));
  for (; i < n; ++i) out[i] = from_f<T>(to_f(w[i]) * round_to<T>(to_f(x[i]) * r));
}

}  // namespace

// x [T, N] rows (row stride free, N contiguous) -> out [T, N] contiguous.
void rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor out) {
  RS_DISPATCH(x.scalar_type(), "rms_norm", [&] {
    const int64_t n = x.size(1), xs = x.stride(0);
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, x.size(0), kRowGrain, [&](int64_t lo, int64_t hi) {
      for (int64_t t = lo; t < hi; ++t) norm_row(xp + t * xs, wp, op + t * n, n, static_cast<float>(eps));
    });
  });
}

// residual += x (rounded to the dtype, as a tensor add is); x = rms_norm(residual). Both [T, N]
// contiguous; the new residual stream and the normalised rows replace their inputs.
void add_rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps) {
  RS_DISPATCH(x.scalar_type(), "add_rms_norm", [&] {
    const int64_t n = x.size(1);
    scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* rp = residual.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    at::parallel_for(0, x.size(0), kRowGrain, [&](int64_t lo, int64_t hi) {
      for (int64_t t = lo; t < hi; ++t) {
        scalar_t* xr = xp + t * n;
        scalar_t* rr = rp + t * n;
        int64_t i = 0;
        for (; i + kLanes <= n; i += kLanes) store(rr + i, load(rr + i) + load(xr + i));
        for (; i < n; ++i) rr[i] = from_f<scalar_t>(to_f(rr[i]) + to_f(xr[i]));
        norm_row(rr, wp, xr, n, static_cast<float>(eps));
      }
    });
  });
}

namespace {

// Rotate the heads of one token in place: x [heads, D] with head stride hs; cos/sin rows [D].
template <typename T>
inline void rotate(T* x, int64_t heads, int64_t hs, int64_t d, const float* c, const float* s) {
  const int64_t half = d / 2;
  for (int64_t h = 0; h < heads; ++h) {
    T* xh = x + h * hs;
    int64_t i = 0;
    for (; i + kLanes <= half; i += kLanes) {
      const vf x1 = load(xh + i), x2 = load(xh + i + half);
      store(xh + i, x1 * load(c + i) - x2 * load(s + i));
      store(xh + i + half, x2 * load(c + i + half) + x1 * load(s + i + half));
    }
    for (; i < half; ++i) {
      const float x1 = to_f(xh[i]), x2 = to_f(xh[i + half]);
      xh[i] = from_f<T>(x1 * c[i] - x2 * s[i]);
      xh[i + half] = from_f<T>(x2 * c[i + half] + x1 * s[i + half]);
    }
  }
}

}  // namespace

// Rotary embedding ("rotate half" form) of q [T, H, D] and k [T, KVH, D] in place (views into one
// projection output are fine: head_dim contiguous); cos/sin [max_pos, D] float32; positions int64 [T].
void rope(at::Tensor q, at::Tensor k, const at::Tensor& positions, const at::Tensor& cos,
          const at::Tensor& sin) {
  RS_DISPATCH(q.scalar_type(), "rope", [&] {
    const int64_t d = q.size(2), max_pos = cos.size(0);
    const int64_t* pos = positions.data_ptr<int64_t>();
    const float* cp = cos.data_ptr<float>();
    const float* sp = sin.data_ptr<float>();
    scalar_t* qp = q.data_ptr<scalar_t>();
    scalar_t* kp = k.data_ptr<scalar_t>();
    at::parallel_for(0, q.size(0), kRowGrain, [&](int64_t lo, int64_t hi) {
      for (int64_t t = lo; t < hi; ++t) {
        TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "rope: position ", pos[t], " outside the table of ", max_pos);
        const float* c = cp + pos[t] * d;
        const float* s = sp + pos[t] * d;
        rotate(qp + t * q.stride(0), q.size(1), q.stride(1), d, c, s);
        rotate(kp + t * k.stride(0), k.size(1), k.stride(1), d, c, s);
      }
    });
  });
}

// out [T, I] = silu(gate) * up with gate_up [T, 2I] = [gate | up] (the fused projection's output).
void silu_mul(const at::Tensor& gate_up, at::Tensor out) {
  RS_DISPATCH(gate_up.scalar_type(), "silu_mul", [&] {
    const int64_t n = out.size(1), gs = gate_up.stride(0);
    const scalar_t* gp = gate_up.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, out.size(0), kRowGrain, [&](int64_t lo, int64_t hi) {
      for (int64_t t = lo; t < hi; ++t) {
        const scalar_t* g = gp + t * gs;
        const scalar_t* u = g + n;
        scalar_t* o = op + t * n;
        int64_t i = 0;
        for (; i + kLanes <= n; i += kLanes) {
          const vf x = load(g + i);
          store(o + i, round_to<scalar_t>(x / (1.0f + vexp(-x))) * load(u + i));
        }
        for (; i < n; ++i) {
          const float x = to_f(g[i]);
          o[i] = from_f<scalar_t>(round_to<scalar_t>(x / (1.0f + sexp(-x))) * to_f(u[i]));
        }
      }
    });
  });
}

// How many threads one at::parallel_for of `items` items runs on: torch's intra-op count when the
// extension was compiled with OpenMP (ATen's parallel_for is a header template whose pragma is
// dropped without -fopenmp, and every kernel then ran on one thread whatever cpu_threads said).
int64_t parallel_width(int64_t items) {
  std::atomic<int64_t> widest{0};
  at::parallel_for(0, items, 1, [&](int64_t, int64_t) {
    const int64_t tid = at::get_thread_num() + 1;
    for (int64_t w = widest.load(); w < tid && !widest.compare_exchange_weak(w, tid);) {
    }
  });
  return widest.load();
}

TORCH_LIBRARY_FRAGMENT(ringserve_cpu, m) {
  m.def("parallel_width(int items) -> int", &parallel_width);
  m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor(a!) out) -> ()", &rms_norm);
  m.def("add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()", &add_rms_norm);
  m.def("rope(Tensor(a!) q, Tensor(b!) k, Tensor positions, Tensor cos, Tensor sin) -> ()", &rope);
  m.def("silu_mul(Tensor gate_up, Tensor(a!) out) -> ()", &silu_mul);
}

}  // namespace ringserve_cpu
