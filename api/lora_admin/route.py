"""vLLM's runtime LoRA routes: `POST /v1/load_lora_adapter` `{"lora_name", "lora_path"}` and
`POST /v1/unload_lora_adapter` `{"lora_name"}`, answered as vLLM answers them (200 and a line of
text; errors in the OpenAI shape).

Only an admin key opens them (`--admin-keys-file`, checked by the auth middleware: `ADMIN_PATHS`),
and only with `--lora-dir DIR`: a path is read relative to DIR, and one that resolves outside it
(`..`, an absolute path elsewhere, a symlink out) is refused before the GPU process sees it. The
GPU process reads the checkpoint off its loop (`gpu_proc/lora_admin.py`) and answers once the
adapter is served; every worker then sees it in `Control.loras`. Unloading takes the name away at
once; the requests already queued or running on it finish.
"""

from __future__ import annotations

import os

import msgspec
from aiohttp import web

from ringserve.api.body import decode_body
from ringserve.api.errors import ApiError, bad_request
from ringserve.api.state import STATE, note_ignored
from ringserve.shm.messages import MAX_LORA_NAME_CHARS, MAX_LORA_PATH_CHARS, LoadLora, UnloadLora


class _LoadBody(msgspec.Struct):
    lora_name: str
    lora_path: str


class _UnloadBody(msgspec.Struct):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's; names are what ringserve goes by


_load = msgspec.json.Decoder(_LoadBody)
_unload = msgspec.json.Decoder(_UnloadBody)


async def handle_load_lora_adapter(request: web.Request) -> web.Response:
    st = request.app[STATE]
    directory = _lora_dir(request)
    body, ignored = decode_body(_load, await request.read())
    note_ignored(request, ignored)
    name = _check_name(body.lora_name, st)
    path = _inside(directory, body.lora_path)
    await st.client.change_loras(lambda rid: LoadLora(rid=rid, name=name, path=path))
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def handle_unload_lora_adapter(request: web.Request) -> web.Response:
    st = request.app[STATE]
    _lora_dir(request)
    body, ignored = decode_body(_unload, await request.read())
    note_ignored(request, ignored)
    name = body.lora_name
    if name not in {e.name for e in st.status.loras()}:
        raise ApiError(
            404,
            f"The lora adapter '{name[:MAX_LORA_NAME_CHARS]}' cannot be found.",
            param="lora_name",
            code="model_not_found",
        )
    await st.client.change_loras(lambda rid: UnloadLora(rid=rid, name=name))
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


def _lora_dir(request: web.Request) -> str:
    directory = request.app[STATE].config.lora_dir
    if not directory:
        raise ApiError(
            404,
            "Loading LoRA adapters at runtime is off on this server (start it with --lora-dir and --admin-keys-file).",
            code="not_found",
        )
    return os.path.realpath(directory)


def _check_name(name: str, st) -> str:
    if not name or len(name) > MAX_LORA_NAME_CHARS or any(c.isspace() or c == "," for c in name):
        raise bad_request(
            f"lora_name must be 1 to {MAX_LORA_NAME_CHARS} characters without spaces or commas.", "lora_name"
        )
    if name == st.model_name or name in st.model_aliases:
        raise bad_request(f"lora_name {name!r} is the base model's name.", "lora_name")
    if name in {e.name for e in st.status.loras()}:
        raise bad_request(f"The lora adapter '{name}' has already been loaded.", "lora_name")
    return name


def _inside(directory: str, given: str) -> str:
    """`given` (relative to `directory`, or absolute) with every link resolved, if it lies inside
    `directory`; else a 400 naming the directory."""
    if not given or len(given) > MAX_LORA_PATH_CHARS or "\0" in given:
        raise bad_request(f"lora_path must be a path of 1 to {MAX_LORA_PATH_CHARS} characters.", "lora_path")
    path = os.path.realpath(os.path.join(directory, given))
    if os.path.commonpath([path, directory]) != directory or path == directory:
        raise bad_request(
            f"lora_path must name an adapter directory inside the adapter directory {directory}.", "lora_path"
        )
    return path
