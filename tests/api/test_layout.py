"""api/ is grouped by route: the folders and top-level files on disk are the ones the import contracts
(pyproject.toml) name, so a new file has to be placed as core or in a route before it lands."""

from __future__ import annotations

import configparser
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
API = ROOT / "api"
# The app and the worker wire the routes; they are the only top-level modules the core contract skips.
WIRING = {"app", "worker"}


def _contract(name_start: str) -> dict:
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (contract,) = [c for c in contracts if c["name"].startswith(name_start)]
    return contract


def _short(modules: list[str]) -> set[str]:
    return {m.removeprefix("ringserve.api.") for m in modules}


def test_every_top_level_api_module_is_core_or_wiring():
    """A module at api/'s top level is in the core contract's list, or is the app or the worker."""
    on_disk = {p.stem for p in API.glob("*.py")} - {"__init__"}
    core = _short(_contract("the API's core knows no route")["source_modules"])
    assert on_disk - WIRING == core


def test_every_api_folder_is_a_route_the_contracts_hold_apart():
    """Each folder under api/ is a route family of the independence contract, and each route exists."""
    on_disk = {p.parent.name for p in API.glob("*/__init__.py")}
    routes = _short(_contract("the API's route folders build on the core")["modules"])
    assert on_disk == routes
    assert _short(_contract("the routes sit under the app")["source_modules"]) == routes


def test_setup_cfg_installs_every_code_folder():
    """Every folder with an __init__.py under api/ and tools/ is a package setup.cfg installs."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    packages = set(cfg["options"]["packages"].split())
    for top in ("api", "tools"):
        for init in (ROOT / top).rglob("__init__.py"):
            if "__pycache__" in init.parts:
                continue
            dotted = ".".join(("ringserve", top, *init.parent.relative_to(ROOT / top).parts))
            assert dotted in packages, f"{dotted} is missing from setup.cfg's packages"


def test_tools_is_split_by_purpose():
    """tools/ holds only its four folders (product commands, the fleet, benchmarks, harnesses) and the
    data they read: a new tool has to say which kind it is."""
    entries = {p.name for p in (ROOT / "tools").iterdir() if p.name != "__pycache__"}
    assert entries == {"__init__.py", "commands", "fleet", "bench", "harness", "data"}
