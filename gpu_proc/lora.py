"""LoRA adapters (PEFT checkpoints) served beside the base model, rows of many adapters in one step.

An adapter adds `scaling * B @ A` to some of a block's projections (q/k/v/o/gate/up/down), with A
`[r, in]` and B `[out, r]`. Nothing is merged into the base weights: a step's rows may each run
another adapter, or none, so each projection's output gets its rows' deltas as a gathered
low-rank product (Punica's SGMV in kind): the step's tokens are grouped by adapter once, and per
group and projection `y[rows] += (x[rows] @ A_s^T) @ B_s^T`, two small matmuls.

Resident adapters live in `max_loras` slots of stacked tensors per layer and fusion group (the
fused CPU forward's q/k/v and gate/up: `LoraSlots`): A `[slots, R, in]`, B transposed
`[slots, R, out]` with R the group's ranks side by side (zero-padded to `--max-lora-rank` each)
and B block-diagonal over the group's projections, the scaling folded into B; a projection the
adapter does not train is zeros. So one product serves the whole fused projection (the CPU
kernel skips the zero blocks), and slot contents change by a copy.
`LoraRegistry` holds every loaded adapter's weights on the host and maps adapter ids to slots,
least recently used out (`slots_for`); the scheduler keeps a step's adapters within `max_loras`.

Spec: PEFT's `LoraLayer` (`lora_B(lora_A(dropout(x))) * scaling`, scaling `alpha / r`, or
`alpha / sqrt(r)` with rsLoRA). Test: tests/gpu_proc/test_lora.py (greedy output against
transformers + PEFT, alone and mixed in one step).
"""

from __future__ import annotations

import json
import math
import re
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from ringserve.shm.control import LoraEntry
from ringserve.shm.messages import MAX_LORA_ADAPTERS

# Fusion groups in the order of their projections' outputs (cpu_ops.BlockWeights): q|k|v, o,
# gate|up, down. Attribute paths under `model.layers.N.`.
GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o": ("self_attn.o_proj",),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "down": ("mlp.down_proj",),
}
TARGETS = tuple(p.rsplit(".", 1)[1] for ps in GROUPS.values() for p in ps)  # q_proj ... down_proj
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class AdapterError(ValueError):
    """An adapter that cannot be served; the message names the file and the field."""


@dataclass(frozen=True)
class Adapter:
    """One PEFT LoRA adapter as loaded: `weights[(layer, "self_attn.q_proj")] = (A, B)`, float32
    on the host, B already scaled."""

    name: str
    path: str
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def projection_shapes(args) -> dict[str, tuple[int, int]]:
    """(in, out) of each projection of a block."""
    h, i = args.hidden_size, args.intermediate_size
    q, kv = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
    return {
        "self_attn.q_proj": (h, q),
        "self_attn.k_proj": (h, kv),
        "self_attn.v_proj": (h, kv),
        "self_attn.o_proj": (q, h),
        "mlp.gate_proj": (h, i),
        "mlp.up_proj": (h, i),
        "mlp.down_proj": (i, h),
    }


def load_adapter(name: str, path: str | Path, args, max_rank: int) -> Adapter:
    """Read and check a PEFT LoRA checkpoint directory (`adapter_config.json` and
    `adapter_model.safetensors`) for a base model of `args` (`ModelArgs`)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    cfg_path, weights_path = path / CONFIG_FILE, path / WEIGHTS_FILE
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except OSError:
        raise AdapterError(f"{cfg_path}: not found (a PEFT LoRA adapter directory needs it)") from None
    except ValueError as e:
        raise AdapterError(f"{cfg_path}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise AdapterError(f"{cfg_path}: not a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{cfg_path}: peft_type {cfg.get('peft_type')!r}; only LORA adapters are served")
    unsupported = {
        "use_dora": bool(cfg.get("use_dora")),
        "fan_in_fan_out": bool(cfg.get("fan_in_fan_out")),
        "modules_to_save": bool(cfg.get("modules_to_save")),
        "rank_pattern": bool(cfg.get("rank_pattern")),
        "alpha_pattern": bool(cfg.get("alpha_pattern")),
        "bias": cfg.get("bias", "none") != "none",
    }
    for field, used in unsupported.items():
        if used:
            raise AdapterError(f"{cfg_path}: {field} {cfg.get(field)!r} is not supported")
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
        raise AdapterError(f"{cfg_path}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise AdapterError(f"{cfg_path}: r {rank} exceeds --max-lora-rank {max_rank}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise AdapterError(f"{cfg_path}: lora_alpha must be a number, got {alpha!r}")
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    try:
        tensors = load_file(str(weights_path))
    except FileNotFoundError:
        raise AdapterError(f"{weights_path}: not found (only safetensors adapters are read)") from None
    except (SafetensorError, OSError) as e:
        raise AdapterError(f"{weights_path}: unreadable ({e})") from None
    shapes = projection_shapes(args)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        module = f"{m.group(2)}.{m.group(3)}" if m else ""
        if m is None or module not in shapes or int(m.group(1)) >= args.num_layers:
            raise AdapterError(
                f"{weights_path}: tensor {key!r} is not a LoRA A/B weight of a projection of this model "
                f"(targets: {', '.join(TARGETS)}, layers 0-{args.num_layers - 1})"
            )
        pairs.setdefault((int(m.group(1)), module), {})[m.group(4)] = t
    if not pairs:
        raise AdapterError(f"{weights_path}: no LoRA weights")
    weights = {}
    for (layer, module), ab in sorted(pairs.items()):
        a, b = ab.get("A"), ab.get("B")
        fan_in, fan_out = shapes[module]
        where = f"{weights_path}: layer {layer} {module}"
        if a is None or b is None:
            raise AdapterError(f"{where}: lora_{'A' if a is None else 'B'} is missing")
        if tuple(a.shape) != (rank, fan_in) or tuple(b.shape) != (fan_out, rank):
            raise AdapterError(
                f"{where}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)}, expected ({rank}, {fan_in}) / "
                f"({fan_out}, {rank})"
            )
        weights[(layer, module)] = (a.float().contiguous(), (b.float() * scaling).contiguous())
    return Adapter(name=name, path=str(path), rank=rank, weights=weights)


class LoraSlots:
    """The resident adapters' weights per layer and group (module docstring), on the model's device:
    `a[layer][group]` `[slots, R, in]`, `b[layer][group]` `[slots, R, out]` (B transposed, so the
    CPU kernel's expand reads output columns in a row)."""

    def __init__(self, args, slots: int, max_rank: int, device: torch.device, dtype: torch.dtype) -> None:
        self.slots, self.max_rank = slots, max_rank
        shapes = projection_shapes(args)
        self.a: list[dict[str, torch.Tensor]] = []
        self.b: list[dict[str, torch.Tensor]] = []
        for _ in range(args.num_layers):
            a, b = {}, {}
            for group, modules in GROUPS.items():
                fan_in = shapes[modules[0]][0]
                out = sum(shapes[m][1] for m in modules)
                a[group] = torch.zeros(slots, max_rank * len(modules), fan_in, device=device, dtype=dtype)
                b[group] = torch.zeros(slots, max_rank * len(modules), out, device=device, dtype=dtype)
            self.a.append(a)
            self.b.append(b)
        self.shapes = shapes
        # each group's targets' output widths: the columns each target's ranks write
        self.segs = {g: tuple(shapes[m][1] for m in ms) for g, ms in GROUPS.items()}

    def fill(self, slot: int, adapter: Adapter) -> None:
        """Slot `slot` holds `adapter` (zeros where it trains nothing)."""
        r = self.max_rank
        for layer, (a_groups, b_groups) in enumerate(zip(self.a, self.b)):
            for group, modules in GROUPS.items():
                a, b = a_groups[group][slot], b_groups[group][slot]
                a.zero_()
                b.zero_()
                row = 0
                for j, module in enumerate(modules):
                    out = self.shapes[module][1]
                    held = adapter.weights.get((layer, module))
                    if held is not None:
                        wa, wb = held
                        a[j * r : j * r + wa.shape[0]].copy_(wa)
                        b[j * r : j * r + wb.shape[1], row : row + out].copy_(wb.t())
                    row += out

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.a + self.b for t in layer.values())


@dataclass(frozen=True)
class LoraStep:
    """A step's adapter rows: per resident slot used, the step's token indices (int64, on the
    device) that run it. Tokens of the base model are in none."""

    slots: tuple[int, ...]
    rows: tuple[torch.Tensor, ...]
    weights: LoraSlots
    slot_of: torch.Tensor | None = None  # int32 [T], each token's slot (-1: the base model)
    kernels: object | None = None  # `lora_cuda.LoraKernels` on CUDA when its start-up check passed

    def delta(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """`y[rows] += (x[rows] @ A^T) @ B^T` for each slot's rows: the reference the fused
        CPU block computes (cpu_block.cpp, lora_add), and the CUDA kernels (lora_cuda.py) when
        the step has them. The slots hold B transposed."""
        a, b = self.weights.a[layer][group], self.weights.b[layer][group]
        if self.kernels is not None and self.slot_of is not None:
            self.kernels.add_(x, y, a, b, self.slot_of, self.weights.segs[group])  # type: ignore[attr-defined]
            return
        for slot, rows in zip(self.slots, self.rows):
            xs = x.index_select(0, rows)
            y.index_add_(0, rows, (xs @ a[slot].t()) @ b[slot])

    def args(self, layer: int) -> list[torch.Tensor]:
        """What the fused block takes: A and B of each group, in GROUPS order."""
        a, b = self.weights.a[layer], self.weights.b[layer]
        return [t for g in GROUPS for t in (a[g], b[g])]


class LoraRegistry:
    """Every loaded adapter (host memory) by id (1, 2, ...; 0 is the base model) and name, and
    which of them the `LoraSlots` hold, least recently used first.

    Ids are never reused within a process (the prefix cache salts blocks with them). Each served
    adapter also holds a stats index below MAX_LORA_ADAPTERS (`table`, the GPU stats'
    lora_running_<i>): kept across a GPU-process restart for the adapters loaded again. An adapter
    unloaded while requests of it are queued or running is retired — no longer named, so new
    requests are 404s — and its weights and index are freed once none is left (`collect`)."""

    def __init__(self, args, max_loras: int, max_rank: int, device: torch.device, dtype: torch.dtype) -> None:
        self.args, self.max_loras, self.max_rank = args, max_loras, max_rank
        self.slots = LoraSlots(args, max_loras, max_rank, device, dtype)
        self.adapters: dict[int, Adapter] = {}  # served and retired
        self.ids: dict[str, int] = {}  # served only
        self.index: dict[int, int] = {}  # adapter id -> stats index (served and retired)
        self.runtime: set[int] = set()  # ids loaded by /v1/load_lora_adapter
        self.retired: set[int] = set()
        self._resident: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, LRU first
        self._next_id = 1
        self.swaps = 0  # slot fills since start (an adapter copied in from the host)
        # Time in slot fills: since `take_fill_ms` last took it, and a running mean per fill (0
        # before the first): the GPU loop keeps it out of the cost model's step fit and the
        # scheduler prices a request whose adapter is not resident with it.
        self._fill_ms, self.fill_ms = 0.0, 0.0
        self.kernels: object | None = None  # the CUDA kernels (lora_cuda.py), set once checked

    def load(self, name: str, path: str | Path) -> int:
        """Load the adapter at `path` as `name`; its id."""
        self.check_name(name)
        return self.add(load_adapter(name, path, self.args, self.max_rank))

    def check_name(self, name: str, pending: int = 0) -> None:
        """AdapterError unless an adapter `name` may be added (with `pending` loads in progress)."""
        if name in self.ids:
            raise AdapterError(f"The LoRA adapter {name!r} has already been loaded.")
        if len(self.index) + pending >= MAX_LORA_ADAPTERS:
            raise AdapterError(f"At most {MAX_LORA_ADAPTERS} LoRA adapters are served at once; unload one first.")

    def add(self, adapter: Adapter, runtime: bool = False, index: int | None = None) -> int:
        """Serve a loaded adapter (at stats index `index` if given and free); its id."""
        self.check_name(adapter.name)
        used = set(self.index.values())
        if index is None or index in used or not 0 <= index < MAX_LORA_ADAPTERS:
            index = min(set(range(MAX_LORA_ADAPTERS)) - used)
        lid, self._next_id = self._next_id, self._next_id + 1
        self.adapters[lid], self.ids[adapter.name], self.index[lid] = adapter, lid, index
        if runtime:
            self.runtime.add(lid)
        return lid

    def unload(self, name: str) -> int:
        """Stop serving `name` (KeyError if not served); its id, retired until `collect` frees it."""
        lid = self.ids.pop(name)
        self.retired.add(lid)
        return lid

    def collect(self, live: set[int]) -> None:
        """Free the retired adapters no request in `live` (ids of queued and running requests) runs."""
        for lid in self.retired - live:
            self.retired.discard(lid)
            self.runtime.discard(lid)
            del self.adapters[lid], self.index[lid]
            self._resident.pop(lid, None)

    def table(self) -> list[LoraEntry]:
        """The served adapters as `Control.set_loras` publishes them, in stats-index order."""
        entries = [
            LoraEntry(self.index[lid], name, self.adapters[lid].path, lid in self.runtime)
            for name, lid in self.ids.items()
        ]
        return sorted(entries)

    def slots_for(self, ids: set[int]) -> dict[int, int]:
        """A slot for each adapter id in `ids` (at most `max_loras`), filling the least recently
        used slots not among them with the ones not resident."""
        if len(ids) > self.max_loras:
            raise ValueError(f"{len(ids)} adapters in one step; at most {self.max_loras} are resident")
        for lid in ids:
            if lid in self._resident:
                self._resident.move_to_end(lid)
        used = set(self._resident.values())
        free = [s for s in range(self.max_loras) if s not in used]
        for lid in ids:
            if lid in self._resident:
                continue
            if free:
                slot = free.pop()
            else:
                old = next(k for k in self._resident if k not in ids)
                slot = self._resident.pop(old)
            t0 = time.perf_counter()
            self.slots.fill(slot, self.adapters[lid])
            ms = (time.perf_counter() - t0) * 1e3
            self._fill_ms += ms
            self.fill_ms = ms if not self.swaps else 0.8 * self.fill_ms + 0.2 * ms
            self._resident[lid] = slot
            self.swaps += 1
        return {lid: self._resident[lid] for lid in ids}

    def take_fill_ms(self) -> float:
        """Milliseconds spent filling slots since the last call."""
        ms, self._fill_ms = self._fill_ms, 0.0
        return ms

    @property
    def resident(self) -> frozenset[int]:
        return frozenset(self._resident)

    def step(self, token_lora: list[int], device: torch.device) -> LoraStep | None:
        """The `LoraStep` of a step whose tokens run adapters `token_lora` (0: the base model);
        None when none runs one."""
        ids = set(token_lora) - {0}
        if not ids:
            return None
        slots = self.slots_for(ids)
        by_slot: dict[int, list[int]] = {}
        for i, lid in enumerate(token_lora):
            if lid:
                by_slot.setdefault(slots[lid], []).append(i)
        order = sorted(by_slot)
        rows = tuple(torch.tensor(by_slot[s], dtype=torch.int64).to(device) for s in order)
        if self.kernels is None:
            return LoraStep(tuple(order), rows, self.slots)
        slot_of = torch.tensor([slots[lid] if lid else -1 for lid in token_lora], dtype=torch.int32).to(device)
        return LoraStep(tuple(order), rows, self.slots, slot_of, self.kernels)
