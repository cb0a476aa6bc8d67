"""An API worker process: uvloop, a SO_REUSEPORT listening socket, the app, graceful drain.

The supervisor starts N of these on one port; the kernel spreads connections between them. Each
worker owns its transport to the GPU process (its ring pair once attached to shared memory), built
by the `transport` factory inside the worker's event loop; `run_attached` is the supervised
worker's entry (shared-memory rings, control block). `python -m ringserve.api.worker --fake`
runs one worker against the in-process fake GPU, for trying the API without a model;
`--attach` runs a supervised worker (see `main`).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable

import uvloop
from aiohttp import web

from ringserve.api import last_words, log_filter
from ringserve.api.app import init_app
from ringserve.api.auth import Authenticator, load_key_scopes, load_keys
from ringserve.api.chat.template import ChatTemplate, ChatTemplateError
from ringserve.api.connections import raise_open_file_limit
from ringserve.api.gpu_client import GpuClient, Transport
from ringserve.api.gpu_status import ControlStatus, GpuStatus
from ringserve.api.peer_cancel import PeerCancel
from ringserve.api.responses.store import ResponseStore
from ringserve.api.state import STATE, ApiState
from ringserve.api.tokenizer import TextCodec
from ringserve.config import Config
from ringserve.models import hidden_size
from ringserve.shm.messages import first_rid

log = logging.getLogger("ringserve.api.worker")


def listen_socket(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """A listening TCP socket that other workers can bind too (SO_REUSEPORT). `serve` listens on
    it again with the configured backlog."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(backlog)
    sock.setblocking(False)
    return sock


async def serve(config: Config, app: web.Application, sock: socket.socket, stop: asyncio.Event) -> None:
    """Serve `app` on `sock` until `stop` is set, then drain: fail /ready for `unready_lead_s`
    while still serving, refuse new requests (503), let open streams finish for up to
    `drain_timeout_s`, and shut down. Connections are accepted and timed
    by the app's `ConnectionGuard` (api/connections.py)."""
    # handler_cancellation: a client that disconnects cancels its handler, which cancels its row.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    if runner.server is None:
        raise RuntimeError("the app runner made no server")
    state = app[STATE]
    listener = await state.connections.listen(runner.server, sock)
    host, port = sock.getsockname()[:2]
    log.info(
        "api worker %d serving %s on http://%s:%d (backlog %d, up to %d connections)",
        state.registry.worker,
        state.model_name,
        host,
        port,
        config.listen_backlog,
        state.connections.max_connections,
    )
    try:
        await stop.wait()
        if config.unready_lead_s > 0:
            state.leaving = True  # a balancer's health checks see it and stop sending first
            await asyncio.sleep(config.unready_lead_s)
        state.draining = True
        # No GPU process will be started for a draining worker: requests held for one answer now.
        state.client.restart_hold.stop_holding(
            "server_shutdown",
            "The server is shutting down and this request "
            "had not started (the GPU process was restarting). Retry it on "
            "another instance.",
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + config.drain_timeout_s
        while len(state.registry) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if len(state.registry):
            await _end_unfinished(state, loop)
    finally:
        listener.close()
        await runner.cleanup()


SHUTDOWN_WRITE_S = 2.0  # how long the handlers get to write the shutdown error event and [DONE]


async def _end_unfinished(state: ApiState, loop: asyncio.AbstractEventLoop) -> None:
    """The drain deadline passed: give every open request the `server_shutdown` error (an SSE
    error event and [DONE], or a 503) instead of dropping its connection, and let the handlers
    write it before the runner closes the connections."""
    log.warning("drain timeout: ending %d unfinished requests with the server_shutdown error", len(state.registry))
    state.client.fail_all(
        "server_shutdown",
        "The server is shutting down and the request did not "
        "finish within the drain timeout. Retry it on another instance.",
    )
    deadline = loop.time() + SHUTDOWN_WRITE_S
    while len(state.registry) and loop.time() < deadline:
        await asyncio.sleep(0.02)


def run_worker(
    config: Config,
    *,
    index: int,
    transport: Callable[[], Transport],
    status: GpuStatus,
    tokenizer_dir: str,
    model_name: str,
    peers: PeerCancel | None = None,
    sock: socket.socket | None = None,
    first_rid: int = 1,
    model_aliases: frozenset[str] = frozenset(),
    response_store_path: str | None = None,
    embedding_dims: int | None = None,
) -> int:
    """The worker process's main: runs until SIGTERM (drain) or SIGINT. `response_store_path` is
    the instance's stored-responses database, which every worker opens (None: this worker's own,
    in memory); `embedding_dims`: the model's hidden size (None: read from its config.json)."""
    # A SIGTERM while still starting (nothing to drain yet) is a clean exit; the event loop's own
    # handler, installed below, takes over once serving.
    signal.signal(signal.SIGTERM, _exit_cleanly)
    before, now = raise_open_file_limit()
    if now != before:
        log.info("open-file limit raised from %d to %d (each connection is a file)", before, now)
    log_filter.install()  # before serving: no aiohttp record may quote a request
    codec = TextCodec.from_dir(tokenizer_dir)
    chat_template = _load_chat_template(tokenizer_dir, codec, config.chat_template)
    auth = Authenticator(
        load_key_scopes(config.api_keys_file) if config.api_keys_file else None,
        metrics_keys=load_keys(config.metrics_keys_file) if config.metrics_keys_file else None,
        admin_keys=load_keys(config.admin_keys_file) if config.admin_keys_file else None,
    )
    sock = sock or listen_socket(config.host, config.port, config.listen_backlog)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        client = GpuClient(
            transport(),
            worker=index,
            ready=status.ready,
            hold_s=config.restart_hold_s,
            down_reason=lambda: (status.restart_status() or {}).get("last_error"),
            first_rid=first_rid,
            quarantined=status.quarantined,
            fingerprint_key=status.fingerprint_key(),
            priced=status.note_price,
        )
        app = init_app(
            config,
            client,
            codec,
            status,
            model_name=model_name,
            auth=auth,
            worker=index,
            peers=peers,
            chat_template=chat_template,
            model_aliases=model_aliases,
            response_store=ResponseStore.for_config(config, response_store_path),
            embedding_dims=embedding_dims or hidden_size(tokenizer_dir),
        )
        last_words.install(app[STATE].registry)  # the supervisor's SIGUSR1 before it kills us
        await serve(config, app, sock, stop)

    uvloop.run(main())
    return 0


def _load_chat_template(model_dir: str, codec: TextCodec, source_file: str | None = None) -> ChatTemplate | None:
    """The model's chat template (or `--chat-template`'s); one that does not compile leaves
    /v1/chat/completions answering 400 (and says why here) while /v1/completions keeps serving."""
    try:
        return ChatTemplate.load(model_dir, codec, source_file)
    except ChatTemplateError as exc:
        log.error("%s; /v1/chat/completions is unavailable", exc)
        return None


def run_attached(
    config: Config,
    *,
    slot: int,
    instance: str,
    bell_fds: list[int],
    tokenizer_dir: str,
    model_name: str,
    directory: str | None = None,
    sock: socket.socket | None = None,
    model_aliases: frozenset[str] = frozenset(),
) -> int:
    """A worker of a supervised server: attach to the shm instance, talk to the GPU process over
    ring pair `slot`, read readiness and /metrics from the control block, publish this worker's
    stats and heartbeat into its slot."""
    from ringserve.api.ring_transport import RingTransport
    from ringserve.shm.instance import ShmInstance
    from ringserve.shm.segment import instance_started_at, segment_name

    shm = ShmInstance.attach(instance, bell_fds=bell_fds, **({"directory": directory} if directory else {}))
    started_at = instance_started_at(instance)
    control = shm.control
    generation = _slot_generation(control, slot)
    try:
        return run_worker(
            config,
            index=slot,
            transport=lambda: RingTransport.for_slot(shm, slot),
            status=ControlStatus(control, slot, started_at),
            tokenizer_dir=tokenizer_dir,
            model_name=model_name,
            peers=PeerCancel(instance, slot, control.n_workers),
            sock=sock,
            first_rid=first_rid(generation),
            model_aliases=model_aliases,
            response_store_path=os.path.join(shm.directory, segment_name(instance, RESPONSE_STORE_PART)),
        )
    finally:
        shm.close()


SLOT_WAIT_S = 10.0
# The instance's stored responses sit beside its rings (removed with them: ShmInstance.unlink).
RESPONSE_STORE_PART = "responses"


def _slot_generation(control, slot: int) -> int:
    """This worker's slot generation. The supervisor records it right after spawning us; until the
    slot names our pid, what it holds is our predecessor's."""
    deadline = time.monotonic() + SLOT_WAIT_S
    while (info := control.worker_slot(slot))["pid"] != os.getpid():
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"worker slot {slot} was not assigned to pid {os.getpid()} within "
                f"{SLOT_WAIT_S:.0f} s (slot pid {info['pid']})"
            )
        time.sleep(0.005)
    return info["generation"]


def _config(host: str | None, port: int | None) -> Config:
    """The supervisor's Config (RINGSERVE_CONFIG_JSON) when there is one, else the environment;
    then --host / --port."""
    raw = os.environ.get("RINGSERVE_CONFIG_JSON")
    config = Config.from_json(raw) if raw else Config.from_env()
    changes = {k: v for k, v in (("host", host), ("port", port)) if v is not None}
    return config.replace(**changes) if changes else config


def _exit_cleanly(signum, frame) -> None:
    raise SystemExit(0)


def main(argv: list[str] | None = None) -> int:
    """`python -m ringserve.api.worker --tokenizer DIR (--fake | --attach INSTANCE --slot I
    --bell-fds FDS)`: one worker on the fake GPU, or one supervised worker on shared memory."""
    p = argparse.ArgumentParser(prog="ringserve-api-worker", description=__doc__.splitlines()[0])
    p.add_argument("--tokenizer", required=True, help="directory holding tokenizer.json")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--fake", action="store_true", help="answer with the in-process fake GPU (echoes the prompt)")
    mode.add_argument("--attach", metavar="INSTANCE", help="shm instance id to attach to")
    p.add_argument("--slot", type=int, default=0, help="worker slot (ring pair) with --attach")
    p.add_argument(
        "--bell-fds",
        default="",
        help="inherited doorbell fds, comma-separated: input, then one per worker slot (ShmInstance.bell_fds())",
    )
    p.add_argument("--shm-dir", default=None, help="shared-memory directory (default /dev/shm)")
    p.add_argument("--model-name", default="fake", help="the model id the API reports")
    p.add_argument(
        "--model-alias",
        action="append",
        default=[],
        help="another name requests may give the model (the path it was served from); repeatable",
    )
    p.add_argument("--host", default=None)
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--step-ms", type=float, default=20.0, help="fake GPU step time")
    args = p.parse_args(argv)
    if args.attach and "RINGSERVE_CONFIG_JSON" in os.environ:
        config = Config.from_json(os.environ["RINGSERVE_CONFIG_JSON"])  # the supervisor's one Config
    else:
        config = _config(args.host, args.port)
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.attach:
        fds = [int(x) for x in args.bell_fds.split(",") if x]
        return run_attached(
            config,
            slot=args.slot,
            instance=args.attach,
            bell_fds=fds,
            tokenizer_dir=args.tokenizer,
            model_name=args.model_name,
            directory=args.shm_dir,
            model_aliases=frozenset(args.model_alias),
        )
    from ringserve.api.fake_gpu import FAKE_HIDDEN_SIZE, FakeGpu, FakeStatus

    fake = FakeGpu(step_interval_s=args.step_ms / 1000.0)
    return run_worker(
        config,
        index=0,
        transport=lambda: fake,
        status=FakeStatus(fake),
        tokenizer_dir=args.tokenizer,
        model_name=args.model_name,
        model_aliases=frozenset(args.model_alias),
        embedding_dims=FAKE_HIDDEN_SIZE,
    )


if __name__ == "__main__":
    sys.exit(main())
