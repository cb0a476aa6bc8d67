// Guarded device buffers for the CPU execution harness: every tensor a kernel receives is copied
// into memory between two inaccessible pages, so a read or write one byte outside it faults, and
// a buffer behind a `const` parameter is mapped read-only. runtime.cpp turns the fault into a
// message naming the buffer and the offset (describe_buffer_address).
#include <cstdio>
#include <cstring>
#include <sys/mman.h>

#include "rs_runtime.h"

namespace rs {
namespace {

constexpr size_t kPage = 4096;
constexpr int kMaxBuffers = 256;

struct Buffer {
    char* map;
    size_t map_len;
    char* data;
    size_t nbytes;
    bool readonly;
    char name[64];
};

Buffer g_buffers[kMaxBuffers];

}  // namespace

bool describe_buffer_address(const char* a, char* out, size_t cap) {
    for (const Buffer& b : g_buffers) {
        if (b.map == nullptr || a < b.map || a >= b.map + b.map_len) continue;
        if (a < b.data) {
            snprintf(out, cap, "%zu bytes before the start of buffer `%s` (%zu bytes)",
                     static_cast<size_t>(b.data - a), b.name, b.nbytes);
        } else if (a >= b.data + b.nbytes) {
            snprintf(out, cap, "%zu bytes past the end of buffer `%s` (%zu bytes)",
                     static_cast<size_t>(a - (b.data + b.nbytes)), b.name, b.nbytes);
        } else {
            snprintf(out, cap, "byte %zu of buffer `%s`%s", static_cast<size_t>(a - b.data), b.name,
                     b.readonly ? ", which is const in the kernel's signature (a write to an input)" : "");
        }
        return true;
    }
    return false;
}

}  // namespace rs

using rs::Buffer;
using rs::g_buffers;
using rs::kMaxBuffers;
using rs::kPage;

// A buffer of `nbytes` between two inaccessible pages: flush against the page after it
// (`at_end`), so an overrun faults, or starting right after the page before it, so an underrun
// faults. `phase` keeps the original pointer's alignment modulo 16 (slack of up to 15 bytes).
extern "C" void* rs_buffer_new(size_t nbytes, size_t phase, int at_end, const char* name) {
    int slot = -1;
    for (int i = 0; i < kMaxBuffers; ++i) {
        if (g_buffers[i].map == nullptr) {
            slot = i;
            break;
        }
    }
    if (slot < 0) return nullptr;
    phase %= 16;
    const size_t data_pages = (nbytes + 32 + kPage - 1) / kPage;
    const size_t len = (data_pages + 2) * kPage;
    void* map = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (map == MAP_FAILED) return nullptr;
    char* base = static_cast<char*>(map);
    mprotect(base, kPage, PROT_NONE);
    mprotect(base + len - kPage, kPage, PROT_NONE);
    char* data;
    if (at_end) {
        data = base + len - kPage - nbytes;
        data -= (reinterpret_cast<uintptr_t>(data) - phase) % 16;
    } else {
        data = base + kPage + phase;
    }
    Buffer& b = g_buffers[slot];
    b.map = base;
    b.map_len = len;
    b.data = data;
    b.nbytes = nbytes;
    b.readonly = false;
    snprintf(b.name, sizeof b.name, "%s", name);
    return data;
}

extern "C" int rs_buffer_set_readonly(void* data) {
    for (auto& b : g_buffers) {
        if (b.data == data && b.map != nullptr) {
            b.readonly = true;
            return mprotect(b.map + kPage, b.map_len - 2 * kPage, PROT_READ);
        }
    }
    return -1;
}

extern "C" void rs_buffer_free(void* data) {
    for (auto& b : g_buffers) {
        if (b.data == data && b.map != nullptr) {
            munmap(b.map, b.map_len);
            b = Buffer{};
            return;
        }
    }
}
