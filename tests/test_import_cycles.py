"""No import cycle between product modules (issue 33): the installed layout (`ringserve.api` is
api/, ...) mirrored as `make lint` mirrors it, its import graph read by grimp (import-linter's
graph), `TYPE_CHECKING` imports included, and every strongly connected component a single module."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("api", "gpu_proc", "shm", "tools")

# Run in a child whose first path entry is the mirror, so `ringserve` is the mirror's and not the
# editable install's (which maps api/ and the rest through an import hook grimp cannot walk).
_GRAPH = """
import json, sys, grimp
g = grimp.build_graph("ringserve", exclude_type_checking_imports=False)
print(json.dumps({m: sorted(g.find_modules_directly_imported_by(m)) for m in g.modules}))
"""


def cycles(imports: dict[str, list[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(imports):
        if root in index:
            continue
        work = [(root, iter(imports.get(root, ())))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(imports.get(w, ()))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def _mirror(tmp: Path) -> Path:
    pkg = tmp / "ringserve"
    for src, dst in [(ROOT / "ringserve", pkg), *((ROOT / d, pkg / d) for d in FOLDERS)]:
        for path in src.rglob("*.py"):
            if "__pycache__" in path.parts:
                continue
            target = dst / path.relative_to(src)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.symlink_to(path)
    return tmp


def test_the_cycle_finder_sees_a_planted_cycle():
    """A three-module loop and a self-contained tree: only the loop is reported."""
    graph = {"a": ["b"], "b": ["c"], "c": ["a", "d"], "d": [], "e": ["d"]}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": ["b"], "b": []}) == []


def test_no_import_cycle_between_product_modules(tmp_path):
    """Every module of ringserve, api, gpu_proc, shm and tools sits in no import cycle."""
    out = subprocess.run(
        [sys.executable, "-c", _GRAPH], cwd=_mirror(tmp_path), capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    imports = json.loads(out.stdout)
    assert len(imports) > 150 and "ringserve.api.chat.route" in imports
    assert cycles(imports) == []
