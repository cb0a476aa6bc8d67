// The harness runtime's interface between the block scheduler (runtime.cpp) and the CUDA
// emulation the kernel source is compiled against (cuda_emulation.h). No CUDA keywords here.
//
// Model: one launch runs its blocks one after another on the calling OS thread. Each CUDA thread
// of a block is a user-space thread with its own stack; it runs until it reaches a barrier, a warp
// collective (shuffle, ldmatrix, mma) or its end, then switches back to the scheduler, which picks
// the next ready thread in forward, reverse or random order.
#pragma once

#include <cstddef>
#include <cstdint>

namespace rs {

struct Dim3 {
    unsigned x, y, z;
};

enum class State : uint8_t { Ready, Barrier, Warp, Exited };

// A warp collective's per-lane operands: `in` is written by the lane before it blocks, `out` by
// the resolver once every lane named in the mask has arrived.
constexpr int kWarpWords = 16;

struct Thread {
    void* sp;  // saved stack pointer while switched out
    char* stack_lo;
    char* stack_hi;
    Dim3 idx;
    int linear, lane, warp;
    State state;
    int site_line;  // the source line of the barrier / collective it waits at (its identity)
    const char* site_what;
    uint32_t mask;
    int done_line;       // the last collective this lane completed, and its mask: a lane that
    uint32_t done_mask;  // passed "this" collective under another mask is reported as such
    uint32_t in[kWarpWords];
    uint32_t out[kWarpWords];
};

// Computes `out` of every lane in `mask` from their `in`; lanes[i] is null outside the mask.
// Returns nullptr, or a message naming what was wrong (a lane read outside the mask, ...).
using Resolver = const char* (*)(Thread* const* lanes, uint32_t mask);

extern Thread* g_cur;
extern Dim3 g_grid, g_block, g_block_idx;

// Called from kernel code (a user thread):
void syncthreads(int line);
void syncwarp(int line, uint32_t mask);
// `g_cur->in` holds the operands; on return `g_cur->out` holds the results.
void warp_collective(int line, const char* what, uint32_t mask, Resolver resolve);
[[noreturn]] void fail(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
// A formatted message in a runtime buffer, valid until the next call (resolvers return it).
const char* message(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
// Translates a 32-bit shared-window address (what cvta.to.shared gives) back to a host pointer.
char* shared_ptr(uint32_t addr, size_t bytes);
uint32_t shared_addr(const void* p);

// guarded_buffers.cpp: when `a` lies in or around a harness buffer, describe where (for faults).
bool describe_buffer_address(const char* a, char* out, size_t cap);

// Kernel registry: the generated glue registers each entry point at load time.
enum ParamKind : int { kPointer = 0, kInteger = 1, kFloat = 2 };
struct ParamInfo {
    int size;
    int kind;
    int is_const;  // pointers: the pointee is const (the harness maps the buffer read-only)
};
using Invoker = void (*)(void (*fn)(), void* const* params);
int register_kernel(const char* name, void (*fn)(), Invoker invoke, int nparams, const ParamInfo* params);

}  // namespace rs
