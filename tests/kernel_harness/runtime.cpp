// The CPU execution harness runtime: user-space threads, the block scheduler, real barriers and
// warp collectives with their checks, guarded device buffers and fault reports. x86-64 Linux, g++.
//
// Every CUDA thread of a block is a user-space thread (its own mmap'd stack with a guard page, and
// a hand-written context switch that saves the callee-saved registers, MXCSR and the x87 control
// word). A thread runs until it blocks at __syncthreads, a warp collective or its end. Then:
// A barrier or collective is identified by its source line (the same `__syncthreads()` call in the
// source; compiled code may duplicate one call, so call addresses would not do). Then:
//   * a barrier opens when every thread of the block waits at it; threads waiting at different
//     barriers, or a barrier reached while other threads have exited, is an error (CUDA leaves
//     both undefined), and so is a state where no thread can move (a deadlock);
//   * a warp collective completes when every lane named in its mask has arrived at the same
//     collective (line and kind) with the same mask; a named lane that has exited, waits at a barrier or at another
//     collective is an error at once.
// Blocks run one at a time; before each, the `__shared__` window is filled with 0xff bytes (NaN
// in fp32, fp16 and bf16). Blocks run in forward, reverse or seeded random order; threads depth
// first from the lowest or the highest index, or in random sweeps (see run_block).
#include <csetjmp>
#include <csignal>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sys/mman.h>
#include <unistd.h>

#include "rs_runtime.h"

// Bounds of the `__shared__` window: the linker script gathers every function-local static of the
// kernel translation unit (what `__shared__` becomes) between these two symbols.
extern "C" char __rs_shared_start[], __rs_shared_stop[];

// rs_ctx_switch(save, load): push the callee-saved state, store rsp in *save, switch to `load`.
extern "C" void rs_ctx_switch(void** save, void* load);
asm(R"(
    .text
    .globl rs_ctx_switch
    .hidden rs_ctx_switch
    .type rs_ctx_switch, @function
rs_ctx_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $16, %rsp
    stmxcsr 8(%rsp)
    fnstcw (%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    fldcw (%rsp)
    ldmxcsr 8(%rsp)
    addq $16, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size rs_ctx_switch, .-rs_ctx_switch
)");

namespace rs {

Thread* g_cur = nullptr;
Dim3 g_grid, g_block, g_block_idx;

namespace {

constexpr size_t kPage = 4096;
constexpr size_t kStackBytes = 256 * 1024;
constexpr int kMaxThreads = 1024;
constexpr int kMaxKernels = 1024;
// MXCSR with all exceptions masked plus flush-to-zero and denormals-are-zero: CuPy compiles
// with -ftz=true, so subnormal results flush on the GPU too.
constexpr uint32_t kMxcsr = 0x1f80u | 0x8000u | 0x0040u;

struct Kernel {
    const char* name;
    void (*fn)();
    Invoker invoke;
    int nparams;
    const ParamInfo* params;
};

struct Launch {
    const Kernel* kernel;
    void* const* params;
    char error[4096];
    bool failed;
    void* sched_sp;
    int order;  // 0 forward, 1 reverse, 2 random
    uint64_t rng;
    int nthreads;
};

Kernel g_kernels[kMaxKernels];
uint64_t g_ready[kMaxThreads / 64];  // bit i: thread i is Ready (kept in step with Thread::state)
int g_nkernels = 0;
Thread g_threads[kMaxThreads];
char* g_stack_area = nullptr;
int g_stack_count = 0;
Launch g_launch;
sigjmp_buf g_fault_jmp;
char* g_altstack = nullptr;

uint64_t next_random() {
    uint64_t x = (g_launch.rng += 0x9e3779b97f4a7c15ull);
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

void set_error(const char* fmt, va_list ap) {
    if (g_launch.failed) {
        return;  // keep the first error
    }
    vsnprintf(g_launch.error, sizeof g_launch.error, fmt, ap);
    g_launch.failed = true;
}

void set_errorf(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
void set_errorf(const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    set_error(fmt, ap);
    va_end(ap);
}

void set_state(Thread* t, State s) {
    t->state = s;
    const uint64_t bit = 1ull << (t->linear % 64);
    if (s == State::Ready) {
        g_ready[t->linear / 64] |= bit;
    } else {
        g_ready[t->linear / 64] &= ~bit;
    }
}

// The lowest (forward) or highest (reverse) ready thread, or -1.
int next_ready(bool reverse) {
    const int words = (g_launch.nthreads + 63) / 64;
    for (int k = 0; k < words; ++k) {
        const int w = reverse ? words - 1 - k : k;
        if (g_ready[w]) {
            return w * 64 + (reverse ? 63 - __builtin_clzll(g_ready[w]) : __builtin_ctzll(g_ready[w]));
        }
    }
    return -1;
}

// Back to the scheduler; returns when the scheduler resumes this thread.
void yield_to_scheduler() {
    rs_ctx_switch(&g_cur->sp, g_launch.sched_sp);
}

[[noreturn]] void thread_main() {
    Thread* t = g_cur;
    g_launch.kernel->invoke(g_launch.kernel->fn, g_launch.params);
    set_state(t, State::Exited);
    // A lane that leaves while others of its warp wait for it at a collective can never be met.
    const int first = t->warp * 32;
    for (int i = first; i < first + 32 && i < g_launch.nthreads; ++i) {
        Thread* o = &g_threads[i];
        if (o->state == State::Warp && (o->mask >> t->lane & 1u)) {
            if (t->done_line == o->site_line && t->done_mask != o->mask) {
                set_errorf("%s (line %d): lane %d waits with mask 0x%08x, but lane %d passed it with mask 0x%08x: "
                           "lanes of a warp must use the same mask", o->site_what, o->site_line, o->lane, o->mask,
                           t->lane, t->done_mask);
                break;
            }
            set_errorf("thread %d (lane %d of warp %d) exited while lane %d waits for it at %s (line %d, "
                       "mask 0x%08x)", t->linear, t->lane, t->warp, o->lane, o->site_what, o->site_line, o->mask);
            break;
        }
    }
    yield_to_scheduler();
    abort();  // an exited thread is never resumed
}

// Fresh stack for thread i: the first switch into it "returns" into thread_main.
void init_thread(int i) {
    Thread* t = &g_threads[i];
    char* top = t->stack_hi;
    auto* sp = reinterpret_cast<uint64_t*>(top);
    *--sp = 0;                                            // thread_main's (never used) return address
    *--sp = reinterpret_cast<uint64_t>(&thread_main);     // where the first switch's `ret` goes
    for (int r = 0; r < 6; ++r) *--sp = 0;                // rbp rbx r12 r13 r14 r15
    *--sp = kMxcsr;                                       // 8(%rsp): mxcsr
    *--sp = 0x037f;                                       // (%rsp): x87 control word
    t->sp = sp;
    set_state(t, State::Ready);
    t->site_line = 0;
    t->site_what = "";
    t->mask = 0;
    t->done_line = 0;
    t->done_mask = 0;
}

// Stacks for one launch's n threads, unmapped again when it ends: each guard page splits the
// mapping, so a kept area would hold 2 * kMaxThreads of the process's ~65k memory maps per loaded
// library, and a test session loads hundreds of libraries (every planted bug is one).
bool map_stacks(int n) {
    if (n > kMaxThreads) {
        return false;
    }
    const size_t per = kStackBytes + kPage;  // a guard page below each stack
    void* area = mmap(nullptr, per * n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (area == MAP_FAILED) {
        return false;
    }
    g_stack_area = static_cast<char*>(area);
    g_stack_count = n;
    for (int i = 0; i < n; ++i) {
        char* lo = g_stack_area + per * i;
        mprotect(lo, kPage, PROT_NONE);
        g_threads[i].stack_lo = lo + kPage;
        g_threads[i].stack_hi = lo + per;
    }
    return true;
}

void unmap_stacks() {
    munmap(g_stack_area, (kStackBytes + kPage) * g_stack_count);
    g_stack_area = nullptr;
    g_stack_count = 0;
}

int append_range(char* out, size_t cap, int lo, int hi) {
    return lo == hi ? snprintf(out, cap, "%d", lo) : snprintf(out, cap, "%d-%d", lo, hi);
}

// "threads 0-63 wait at barrier (line 120); 64-127 exited" for a deadlock report.
void describe_threads(char* out, size_t cap) {
    size_t used = 0;
    int start = 0;
    auto same = [](const Thread& a, const Thread& b) {
        return a.state == b.state && a.site_line == b.site_line && a.mask == b.mask;
    };
    for (int i = 1; i <= g_launch.nthreads && used < cap; ++i) {
        if (i < g_launch.nthreads && same(g_threads[i], g_threads[start])) {
            continue;
        }
        const Thread& t = g_threads[start];
        used += snprintf(out + used, cap - used, "%sthreads ", used ? "; " : "");
        if (used < cap) used += append_range(out + used, cap - used, start, i - 1);
        if (used < cap) {
            switch (t.state) {
                case State::Exited: used += snprintf(out + used, cap - used, " exited"); break;
                case State::Ready: used += snprintf(out + used, cap - used, " ready"); break;
                case State::Barrier:
                    used += snprintf(out + used, cap - used, " wait at __syncthreads (line %d)", t.site_line);
                    break;
                case State::Warp:
                    used += snprintf(out + used, cap - used, " wait at %s (line %d, mask 0x%08x)", t.site_what,
                                     t.site_line, t.mask);
                    break;
            }
        }
        start = i;
    }
}

// Every thread is blocked or exited: open the barrier or report why nothing can move.
bool resolve_stall() {
    int live = 0, at_barrier = 0, exited = 0;
    const Thread* first_barrier = nullptr;
    for (int i = 0; i < g_launch.nthreads; ++i) {
        const Thread& t = g_threads[i];
        if (t.state == State::Exited) {
            ++exited;
            continue;
        }
        ++live;
        if (t.state == State::Barrier) {
            ++at_barrier;
            if (first_barrier == nullptr) first_barrier = &t;
        }
    }
    char who[2048];
    describe_threads(who, sizeof who);
    if (at_barrier == live) {
        for (int i = 0; i < g_launch.nthreads; ++i) {
            const Thread& t = g_threads[i];
            if (t.state == State::Barrier && t.site_line != first_barrier->site_line) {
                set_errorf("threads wait at different __syncthreads calls: %s", who);
                return false;
            }
        }
        if (exited) {
            set_errorf("__syncthreads (line %d) reached while %d thread(s) of the block have exited: %s",
                       first_barrier->site_line, exited, who);
            return false;
        }
        for (int i = 0; i < g_launch.nthreads; ++i) set_state(&g_threads[i], State::Ready);
        return true;
    }
    set_errorf("deadlock: no thread can proceed: %s", who);
    return false;
}

void build_order(int* order, int n, int kind) {
    for (int i = 0; i < n; ++i) order[i] = i;
    if (kind == 2) {
        for (int i = n - 1; i > 0; --i) {
            const int j = static_cast<int>(next_random() % static_cast<uint64_t>(i + 1));
            const int tmp = order[i];
            order[i] = order[j];
            order[j] = tmp;
        }
    }
}

void run_thread(Thread* t) {
    g_cur = t;
    rs_ctx_switch(&g_launch.sched_sp, t->sp);
    g_cur = nullptr;
}

// Forward and reverse run depth first: the lowest (highest) ready thread always runs next, so one
// warp runs as far ahead of the others as barriers allow (a missing barrier between warps shows).
// Random runs sweeps over all ready threads in a fresh random order each time.
bool run_block() {
    const int n = g_launch.nthreads;
    memset(__rs_shared_start, 0xff, static_cast<size_t>(__rs_shared_stop - __rs_shared_start));
    memset(g_ready, 0, sizeof g_ready);
    for (int i = 0; i < n; ++i) init_thread(i);
    int order[kMaxThreads];
    for (;;) {
        bool ran = false;
        if (g_launch.order == 2) {
            build_order(order, n, 2);
            for (int k = 0; k < n; ++k) {
                Thread* t = &g_threads[order[k]];
                if (t->state == State::Ready) {
                    run_thread(t);
                    if (g_launch.failed) return false;
                    ran = true;
                }
            }
        } else {
            for (int i; (i = next_ready(g_launch.order == 1)) >= 0;) {
                run_thread(&g_threads[i]);
                if (g_launch.failed) return false;
                ran = true;
            }
        }
        bool all_exited = true;
        for (int i = 0; i < n && all_exited; ++i) all_exited = g_threads[i].state == State::Exited;
        if (all_exited) {
            return true;
        }
        if (!ran && !resolve_stall()) {
            return false;
        }
    }
}

const char* describe_address(const void* addr, char* out, size_t cap) {
    const char* a = static_cast<const char*>(addr);
    if (describe_buffer_address(a, out, cap)) {
        return out;
    }
    for (int i = 0; i < g_stack_count; ++i) {
        if (a >= g_threads[i].stack_lo - kPage && a < g_threads[i].stack_lo) {
            snprintf(out, cap, "the guard page of thread %d's stack (stack overflow)", i);
            return out;
        }
    }
    if (a >= __rs_shared_start - kPage && a < __rs_shared_stop + kPage) {
        snprintf(out, cap, "near the __shared__ window");
        return out;
    }
    snprintf(out, cap, "an address no harness buffer holds");
    return out;
}

void on_fault(int sig, siginfo_t* info, void*) {
    char where[256];
    describe_address(info->si_addr, where, sizeof where);
    if (g_cur != nullptr) {
        set_errorf("%s at %p (%s) in thread (%u,%u,%u) of block (%u,%u,%u)",
                   sig == SIGSEGV ? "invalid memory access" : "bus error", info->si_addr, where,
                   g_cur->idx.x, g_cur->idx.y, g_cur->idx.z, g_block_idx.x, g_block_idx.y, g_block_idx.z);
    } else {
        set_errorf("invalid memory access at %p (%s) outside any kernel thread", info->si_addr, where);
    }
    siglongjmp(g_fault_jmp, 1);
}

}  // namespace

void fail(const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    char msg[2048];
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    set_errorf("thread (%u,%u,%u) of block (%u,%u,%u): %s", g_cur->idx.x, g_cur->idx.y, g_cur->idx.z,
               g_block_idx.x, g_block_idx.y, g_block_idx.z, msg);
    yield_to_scheduler();
    abort();
}

const char* message(const char* fmt, ...) {
    static char buf[512];  // NOTE: runtime.cpp is not in the shared window (no -fdata-sections)
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    return buf;
}

void syncthreads(int line) {
    set_state(g_cur, State::Barrier);
    g_cur->site_line = line;
    g_cur->site_what = "__syncthreads";
    yield_to_scheduler();
}

void warp_collective(int line, const char* what, uint32_t mask, Resolver resolve) {
    Thread* me = g_cur;
    if (!(mask >> me->lane & 1u)) {
        fail("%s (line %d): mask 0x%08x does not name the calling lane %d", what, line, mask, me->lane);
    }
    set_state(me, State::Warp);
    me->site_line = line;
    me->site_what = what;
    me->mask = mask;
    Thread* lanes[32] = {};
    bool all_here = true;
    for (int l = 0; l < 32; ++l) {
        if (!(mask >> l & 1u)) continue;
        const int i = me->warp * 32 + l;
        if (i >= g_launch.nthreads) {
            fail("%s (line %d): mask 0x%08x names lane %d, which does not exist in a block of %d threads", what,
                 line, mask, l, g_launch.nthreads);
        }
        Thread* o = &g_threads[i];
        lanes[l] = o;
        if (o != me && o->state != State::Ready && o->state != State::Warp && o->done_line == line &&
            o->done_mask != mask) {
            fail("%s (line %d): lane %d names lane %d in mask 0x%08x, but lane %d passed this collective with "
                 "mask 0x%08x: lanes of a warp must use the same mask", what, line, me->lane, l, mask, l,
                 o->done_mask);
        }
        switch (o->state) {
            case State::Ready:
                all_here = false;
                break;
            case State::Exited:
                fail("%s (line %d): lane %d named in mask 0x%08x has exited", what, line, l, mask);
            case State::Barrier:
                fail("%s (line %d): lane %d named in mask 0x%08x waits at __syncthreads (line %d) instead", what,
                     line, l, mask, o->site_line);
            case State::Warp:
                if (o->site_line != line || strcmp(o->site_what, what) != 0 || o->mask != mask) {
                    fail("%s (line %d, mask 0x%08x): lane %d waits at %s (line %d, mask 0x%08x) instead: lanes "
                         "of a warp must reach the same collective", what, line, mask, l, o->site_what,
                         o->site_line, o->mask);
                }
                break;
        }
    }
    if (all_here) {
        // Lanes outside this mask that wait here under a mask naming some of these lanes disagree.
        for (int l = 0; l < 32; ++l) {
            const int i = me->warp * 32 + l;
            if (lanes[l] != nullptr || i >= g_launch.nthreads) continue;
            const Thread* o = &g_threads[i];
            if (o->state == State::Warp && o->site_line == line && (o->mask & mask)) {
                fail("%s (line %d): lane %d waits here with mask 0x%08x, lane %d with mask 0x%08x: lanes of a warp "
                     "must use the same mask", what, line, l, o->mask, me->lane, mask);
            }
        }
        if (const char* err = resolve(lanes, mask)) {
            fail("%s (line %d): %s", what, line, err);
        }
        for (int l = 0; l < 32; ++l) {
            if (lanes[l] != nullptr) {
                set_state(lanes[l], State::Ready);
                lanes[l]->done_line = line;
                lanes[l]->done_mask = mask;
            }
        }
        return;
    }
    yield_to_scheduler();
}

namespace {
const char* resolve_nothing(Thread* const*, uint32_t) { return nullptr; }
}  // namespace

void syncwarp(int line, uint32_t mask) {
    warp_collective(line, "__syncwarp", mask, resolve_nothing);
}

char* shared_ptr(uint32_t addr, size_t bytes) {
    const size_t window = static_cast<size_t>(__rs_shared_stop - __rs_shared_start);
    if (addr > window || bytes > window - addr) {
        fail("shared-memory address 0x%x (+%zu bytes) is outside the %zu-byte __shared__ window", addr, bytes, window);
    }
    return __rs_shared_start + addr;
}

uint32_t shared_addr(const void* p) {
    const char* c = static_cast<const char*>(p);
    if (c < __rs_shared_start || c > __rs_shared_stop) {
        fail("cvta.to.shared of %p, which is not __shared__ memory", p);
    }
    return static_cast<uint32_t>(c - __rs_shared_start);
}

int register_kernel(const char* name, void (*fn)(), Invoker invoke, int nparams, const ParamInfo* params) {
    if (g_nkernels < kMaxKernels) {
        g_kernels[g_nkernels] = Kernel{name, fn, invoke, nparams, params};
    }
    return g_nkernels++;
}

}  // namespace rs

using namespace rs;

// ---- the C API the Python executor calls through ctypes -------------------------------------

extern "C" int rs_kernel_count() { return g_nkernels; }

extern "C" const char* rs_kernel_name(int k) { return g_kernels[k].name; }

extern "C" int rs_kernel_nparams(int k) { return g_kernels[k].nparams; }

extern "C" void rs_kernel_param(int k, int p, int* size, int* kind, int* is_const) {
    const ParamInfo& info = g_kernels[k].params[p];
    *size = info.size;
    *kind = info.kind;
    *is_const = info.is_const;
}

extern "C" size_t rs_shared_window_bytes() { return static_cast<size_t>(__rs_shared_stop - __rs_shared_start); }

// Run kernel `k` over the grid. `params[i]` points to parameter i's bytes (as cuLaunchKernel's
// kernelParams). `order`: 0 forward, 1 reverse, 2 random (seeded) for blocks and for threads.
// Returns 0, or -1 with the first error written to `err`.
extern "C" int rs_launch(int k, const unsigned* grid, const unsigned* block, void* const* params, int order,
                         uint64_t seed, char* err, size_t errlen) {
    const int nthreads = static_cast<int>(block[0] * block[1] * block[2]);
    if (k < 0 || k >= g_nkernels || nthreads <= 0 || !map_stacks(nthreads)) {
        snprintf(err, errlen, "bad launch: kernel %d, %d threads per block (at most %d, each with a mapped stack)", k, nthreads, kMaxThreads);
        return -1;
    }
    g_launch = Launch{};
    g_launch.kernel = &g_kernels[k];
    g_launch.params = params;
    g_launch.order = order;
    g_launch.rng = seed;
    g_launch.nthreads = nthreads;
    g_grid = Dim3{grid[0], grid[1], grid[2]};
    g_block = Dim3{block[0], block[1], block[2]};
    for (int i = 0; i < nthreads; ++i) {
        Thread& t = g_threads[i];
        t.linear = i;
        t.idx = Dim3{i % block[0], (i / block[0]) % block[1], i / (block[0] * block[1])};
        t.lane = i % 32;
        t.warp = i / 32;
    }
    if (g_altstack == nullptr) {
        g_altstack = static_cast<char*>(malloc(1 << 16));
        stack_t ss{};
        ss.ss_sp = g_altstack;
        ss.ss_size = 1 << 16;
        sigaltstack(&ss, nullptr);
    }
    struct sigaction act{}, old_segv{}, old_bus{};
    act.sa_sigaction = on_fault;
    act.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
    sigemptyset(&act.sa_mask);
    sigaction(SIGSEGV, &act, &old_segv);
    sigaction(SIGBUS, &act, &old_bus);
    const uint64_t nblocks = static_cast<uint64_t>(grid[0]) * grid[1] * grid[2];
    // Random order: an affine permutation n -> (n * stride + offset) mod nblocks, stride coprime.
    uint64_t stride = nblocks > 1 ? 1 + (next_random() % nblocks) : 1, offset = next_random();
    auto gcd = [](uint64_t a, uint64_t c) {
        while (c) {
            const uint64_t r = a % c;
            a = c;
            c = r;
        }
        return a;
    };
    while (nblocks > 1 && gcd(stride, nblocks) != 1) ++stride;
    bool ok = true;
    if (sigsetjmp(g_fault_jmp, 1) == 0) {
        for (uint64_t n = 0; n < nblocks && ok; ++n) {
            const uint64_t b = order == 0 ? n : order == 1 ? nblocks - 1 - n : (n * stride + offset) % nblocks;
            g_block_idx = Dim3{static_cast<unsigned>(b % grid[0]), static_cast<unsigned>((b / grid[0]) % grid[1]),
                               static_cast<unsigned>(b / (static_cast<uint64_t>(grid[0]) * grid[1]))};
            ok = run_block();
        }
    } else {
        ok = false;
    }
    g_cur = nullptr;
    unmap_stacks();
    sigaction(SIGSEGV, &old_segv, nullptr);
    sigaction(SIGBUS, &old_bus, nullptr);
    if (!ok) {
        snprintf(err, errlen, "%s: %s", g_launch.kernel->name, g_launch.error);
        return -1;
    }
    return 0;
}
