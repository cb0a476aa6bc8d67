"""Bugs planted one at a time in the kernels and launchers, each of which the harness must catch.

A planted bug replaces one snippet of a kernel file or of a launcher module (`cupy_backend.py`,
`lora_cuda.py`, `quant_cuda.py`: LAUNCHER_MODULES). The
snippet must occur exactly once, so a kernel edit that removes it fails the check loudly instead of
silently testing nothing; update the snippet then.
"""

from __future__ import annotations

import importlib.util
import types
from dataclasses import dataclass
from pathlib import Path

from ringserve.gpu_proc import lora_cuda, quant_cuda
from ringserve.gpu_proc.attention import cupy_backend

LAUNCHERS = "cupy_backend.py"
LAUNCHER_MODULES = {LAUNCHERS: cupy_backend, "lora_cuda.py": lora_cuda, "quant_cuda.py": quant_cuda}


@dataclass(frozen=True)
class Planted:
    name: str
    file: str  # a kernel file, or a key of LAUNCHER_MODULES
    old: str
    new: str

    def apply(self, text: str) -> str:
        count = text.count(self.old)
        if count != 1:
            raise LookupError(
                f"planted bug {self.name!r}: snippet found {count} times in {self.file}; "
                f"update tests/kernel_harness/planted.py to the current source"
            )
        return text.replace(self.old, self.new)


PLANTED = [
    # ---- paged_decode.cu
    Planted(
        "decode: missing barrier before the cross-warp reduction",
        "paged_decode.cu",
        "    __syncthreads();\n\n    for (int idx = threadIdx.x; idx < GROUP * D;",
        "\n\n    for (int idx = threadIdx.x; idx < GROUP * D;",
    ),
    Planted(
        "decode: barrier inside a branch",
        "paged_decode.cu",
        "            sm_l[warp][g] = l[g];\n        }\n    }\n    __syncthreads();",
        "            sm_l[warp][g] = l[g];\n        }\n        __syncthreads();\n    }",
    ),
    Planted(
        "decode: off-by-one in the context mask",
        "paged_decode.cu",
        "(long long)b * RS_BLOCK_SIZE + tok < ctx",
        "(long long)b * RS_BLOCK_SIZE + tok <= ctx",
    ),
    Planted(
        "decode: V past the context not masked (0 x NaN)",
        "paged_decode.cu",
        "                    vf[i] = valid ? vf[i] : 0.f;\n",
        "",
    ),
    Planted(
        "decode: wrong query-head -> KV-head map",
        "paged_decode.cu",
        "const int kvh = h0 / (num_heads / num_kv_heads);",
        "const int kvh = h0 % num_kv_heads;",
    ),
    Planted(
        "decode: shuffle inside a branch",
        "paged_decode.cu",
        "s = rs_sum_xor<1, TPT>(s);",
        "if (valid) s = rs_sum_xor<1, TPT>(s);",
    ),
    Planted(
        "decode: block-table over-read past the context",
        "paged_decode.cu",
        "const int b_end = min(num_blocks, b_begin + per_split);",
        "const int b_end = b_begin + per_split;",
    ),
    Planted(
        "decode: running max reduced over half the warp",
        "paged_decode.cu",
        "rs_max_xor<TPT, RS_WARP>(s)",
        "rs_max_xor<TPT, RS_WARP / 2>(s)",
    ),
    Planted(
        "decode: output row ignores the head within the group",
        "paged_decode.cu",
        "const long long row = (long long)t * num_heads + h0 + g;",
        "const long long row = (long long)t * num_heads + h0;",
    ),
    Planted(
        "decode merge: a split dropped",
        "paged_decode.cu",
        "        const long long prow = s * rows + row;\n",
        "        if (s == num_splits - 1) break;\n        const long long prow = s * rows + row;\n",
    ),
    # ---- paged_prefill.cu
    Planted(
        "prefill: missing barrier after the softmax",
        "paged_prefill.cu",
        "            sm_alpha[r] = alpha;\n        }\n        __syncthreads();",
        "            sm_alpha[r] = alpha;\n        }",
    ),
    Planted(
        "prefill: missing barrier before the next KV block",
        "paged_prefill.cu",
        "        __syncthreads();  // the next block overwrites sk, sv and sp",
        "",
    ),
    Planted(
        "prefill: causal mask excludes the diagonal",
        "paged_prefill.cu",
        "if (kpos <= spos[r]) {",
        "if (kpos < spos[r]) {",
    ),
    Planted(
        "prefill: tile one row too long (both prefill kernels)",
        "common.cu",
        "ntok = min(tile_tokens, start + len - row0);",
        "ntok = min(tile_tokens, start + len - row0 + 1);",
    ),
    Planted(
        "prefill: wrong query-head -> KV-head map",
        "paged_prefill.cu",
        "const int kvh = h / (num_heads / num_kv_heads);",
        "const int kvh = h % num_kv_heads;",
    ),
    # ---- paged_prefill_tc.cu
    Planted(
        "tensor-core prefill: K overwrites the Q tile before every warp has read it",
        "paged_prefill_tc.cu",
        "    __syncthreads();  // sk now takes K tiles\n",
        "\n",
    ),
    Planted(
        "tensor-core prefill: missing barrier before the next K/V tile",
        "paged_prefill_tc.cu",
        "        __syncthreads();  // the next tile overwrites sk and sv\n",
        "\n",
    ),
    Planted(
        "tensor-core prefill: P fragment registers swapped",
        "paged_prefill_tc.cu",
        "            a[1] = rs_pack2<T>(s[2 * kk][2], s[2 * kk][3]);\n"
        "            a[2] = rs_pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]);\n",
        "            a[2] = rs_pack2<T>(s[2 * kk][2], s[2 * kk][3]);\n"
        "            a[1] = rs_pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]);\n",
    ),
    Planted(
        "tensor-core prefill: K fragments from the wrong ldmatrix rows",
        "paged_prefill_tc.cu",
        "const int key = nt * 8 + (lane % 8) + (lane / 16) * 8;",
        "const int key = nt * 8 + (lane % 8) + ((lane / 8) % 2) * 8;",
    ),
    Planted(
        "tensor-core prefill: V loaded untransposed",
        "paged_prefill_tc.cu",
        "rs_ldmatrix_x4_trans(b, sv + key * LD",
        "rs_ldmatrix_x4(b, sv + key * LD",
    ),
    Planted(
        "tensor-core prefill: row max over half the quad",
        "paged_prefill_tc.cu",
        "mx_a = fmaxf(m_a, rs_max_xor<1, 4>(mx_a));",
        "mx_a = fmaxf(m_a, rs_max_xor<1, 2>(mx_a));",
    ),
    Planted(
        "tensor-core prefill: causal mask excludes the diagonal",
        "paged_prefill_tc.cu",
        "s[nt][e] = kpos <= pos_a ?",
        "s[nt][e] = kpos < pos_a ?",
    ),
    Planted(
        "tensor-core prefill: wrong head of the group for a row",
        "paged_prefill_tc.cu",
        "const long long h = (long long)kvh * group + r % group;",
        "const long long h = (long long)kvh + (r % group) * num_kv_heads;",
    ),
    Planted(
        "tensor-core prefill: keys past the last position loaded",
        "paged_prefill_tc.cu",
        "            if (kpos <= max_pos) {\n                const long long off",
        "            if (kpos < key0 + RS_TC_KEYS) {\n                const long long off",
    ),
    # ---- kv_append.cu
    Planted(
        "kv_append: off-by-one slot offset",
        "kv_append.cu",
        "const int offset = (int)(slot % RS_BLOCK_SIZE);",
        "const int offset = (int)((slot + 1) % RS_BLOCK_SIZE);",
    ),
    Planted(
        "kv_append: copies one vector past the row",
        "kv_append.cu",
        "i < row_vecs; i += blockDim.x",
        "i <= row_vecs; i += blockDim.x",
    ),
    # ---- quant_linear.cu
    Planted(
        "qgemv: the high nibble read as the low one",
        "quant_linear.cu",
        "q[j + 16] = (float)((byte >> 4) |",
        "q[j + 16] = (float)((byte & 0xfu) |",
    ),
    Planted(
        "qgemv: Q5's fifth bit of weight j + 16 taken from bit j",
        "quant_linear.cu",
        "(((high >> (j + 16)) & 1u) << 4));",
        "(((high >> j) & 1u) << 4));",
    ),
    Planted(
        "qgemv: a row's last block skipped",
        "quant_linear.cu",
        "b < n_blocks; b += RS_WARP",
        "b < n_blocks - 1; b += RS_WARP",
    ),
    Planted(
        "qgemv: the shuffle tree one level short",
        "quant_linear.cu",
        "int offset = RS_WARP / 2;",
        "int offset = RS_WARP / 4;",
    ),
    Planted(
        "qgemv: rows of x past the last written",
        "quant_linear.cu",
        "for (int t = 0; t < tokens; ++t) {\n            out[",
        "for (int t = 0; t < RS_QGEMV_TOKENS; ++t) {\n            out[",
    ),
    Planted(
        "qdequant: Q4_1's offset not added",
        "quant_linear.cu",
        "return __fadd_rn(__fmul_rn(d, q), m);",
        "return __fmul_rn(d, q);",
    ),
    Planted(
        "qdequant: a gathered row read from the wrong stride",
        "quant_linear.cu",
        "w + (src * n_blocks + b) * F::kWords",
        "w + (src * (n_blocks - 1) + b) * F::kWords",
    ),
    # ---- lora_sgmv.cu
    Planted(
        "lora shrink: a fan-in tail past the last warp stride dropped",
        "lora_sgmv.cu",
        "for (int k = lane; k < in; k += RS_WARP) {",
        "for (int k = lane; k + RS_WARP <= in; k += RS_WARP) {",
    ),
    Planted(
        "lora shrink: the shuffle tree one level short",
        "lora_sgmv.cu",
        "acc = rs_sum_xor<1, RS_WARP>(acc);",
        "acc = rs_sum_xor<1, RS_WARP / 2>(acc);",
    ),
    Planted(
        "lora expand: a base-model token (slot -1) gets a delta",
        "lora_sgmv.cu",
        "    if (s < 0 || o >= out) {",
        "    if (o >= out) {",
    ),
    Planted(
        "lora expand: target columns read every target's ranks (B's zero blocks not skipped, wrong g)",
        "lora_sgmv.cu",
        "const int g = (o >= seg1) + (o >= seg2);",
        "const int g = (o >= seg1);",
    ),
    Planted(
        "lora expand: the delta written over y instead of added",
        "lora_sgmv.cu",
        "*yo = T::from_float(T::to_float(*yo) + acc);",
        "*yo = T::from_float(acc);",
    ),
    Planted(
        "lora expand: the slot's Bt at the wrong stride",
        "lora_sgmv.cu",
        "bt + ((long long)s * rank + g * r) * out + o;",
        "bt + ((long long)s * rank + g * r) * (out - 1) + o;",
    ),
    # ---- launchers (snippets follow the formatted source: one argument per line, 16 spaces)
    Planted(
        "launcher: 8 bytes for the 4-byte num_heads",
        LAUNCHERS,
        "meta.token_seq,\n                _i32(num_heads),",
        "meta.token_seq,\n                num_heads,",
    ),
    Planted(
        "launcher: merge told one split fewer",
        LAUNCHERS,
        "part_acc, part_ml, _i32(num_splits), single_qsl",
        "part_acc, part_ml, _i32(num_splits - 1), single_qsl",
    ),
    Planted(
        "launcher: prefill grid without the partial-tile allowance",
        LAUNCHERS,
        "tiles = math.ceil(t / tile_tokens) + s",
        "tiles = math.ceil(t / tile_tokens)",
    ),
    Planted(
        "launcher: q row stride assumed packed",
        LAUNCHERS,
        "q.stride(0),\n                q.stride(1),\n                k_cache,\n                v_cache,\n"
        "                meta.block_tables,\n                _i32(meta.block_tables.shape[1]),\n"
        "                meta.positions,",
        "num_heads * head_dim,\n                q.stride(1),\n                k_cache,\n                v_cache,\n"
        "                meta.block_tables,\n                _i32(meta.block_tables.shape[1]),\n"
        "                meta.positions,",
    ),
    Planted(
        "launcher: softmax scale without log2(e)",
        LAUNCHERS,
        "_f32(scale * _LOG2E),\n                out,",
        "_f32(scale),\n                out,",
    ),
    # ---- lora_cuda.py launchers
    Planted(
        "lora launcher: shrink grid rounds the ranks down (a rank not a multiple of 4 warps dropped)",
        "lora_cuda.py",
        "(math.ceil(rank / cupy_backend.LORA_SHRINK_WARPS), t),",
        "(rank // cupy_backend.LORA_SHRINK_WARPS, t),",
    ),
    Planted(
        "lora launcher: x's row stride assumed packed",
        "lora_cuda.py",
        "(x, x.stride(0), a, slot_of,",
        "(x, x.shape[1], a, slot_of,",
    ),
    Planted(
        "lora launcher: y's row stride assumed packed",
        "lora_cuda.py",
        "y,\n                y.stride(0),\n",
        "y,\n                out,\n",
    ),
    Planted(
        "lora launcher: target boundaries one target late",
        "lora_cuda.py",
        "starts = [sum(segs[:i]) for i in range(1, len(segs))]",
        "starts = [sum(segs[: i + 1]) for i in range(1, len(segs))]",
    ),
    Planted(
        "lora launcher: expand told one target",
        "lora_cuda.py",
        "numpy.int32(len(segs)),",
        "numpy.int32(1),",
    ),
    Planted(
        "lora launcher: 8 bytes for the expand's 4-byte rank",
        "lora_cuda.py",
        "numpy.int32(out),\n                numpy.int32(rank),",
        "numpy.int32(out),\n                rank,",
    ),
    # ---- quant_cuda.py launchers
    Planted(
        "quant launcher: GEMV grid rounds the tokens down (a partial token tile never runs)",
        "quant_cuda.py",
        "math.ceil(t / GEMV_TOKENS)),",
        "t // GEMV_TOKENS),",
    ),
    Planted(
        "quant launcher: dequantize ignores the rows asked for",
        "quant_cuda.py",
        "rows if rows is not None else 0, out, r),",
        "0, out, r),",
    ),
    Planted(
        "quant launcher: 8 bytes for the dequantize's 4-byte block count",
        "quant_cuda.py",
        "(blocks, n, numpy.int32(nb), rows",
        "(blocks, n, nb, rows",
    ),
]


def kernel_files(bug: Planted | None) -> list[tuple[str, str]]:
    """The kernel source parts with `bug` applied (when it is a kernel bug)."""
    files = cupy_backend.kernel_files()
    if bug is None or bug.file in LAUNCHER_MODULES:
        return files
    if bug.file not in {name for name, _ in files}:
        raise LookupError(f"planted bug {bug.name!r}: no kernel file {bug.file}")
    return [(name, bug.apply(text) if name == bug.file else text) for name, text in files]


def launcher_module(bug: Planted | None, file: str = LAUNCHERS) -> types.ModuleType:
    """The launcher module `file` itself, or a copy of its source with `bug` applied, loaded as a
    module of the same package (its relative imports resolve as the real one's)."""
    real = LAUNCHER_MODULES[file]
    if bug is None or bug.file != file:
        return real
    path = Path(real.__file__)
    source = bug.apply(path.read_text())
    spec = importlib.util.spec_from_loader(f"{real.__name__}_planted", loader=None)
    module = importlib.util.module_from_spec(spec)
    module.__package__ = real.__package__
    module.__file__ = str(path)
    exec(compile(source, str(path), "exec"), module.__dict__)
    return module
