"""`ringserve serve`: its flags (one per `Config` field, each also a `RINGSERVE_<NAME>` variable),
the model to serve (fetched and converted once), then the supervisor (`supervisor.py`)."""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import fields

from ringserve import models
from ringserve.config import Config, ConfigError, parse_bool
from ringserve.shm import layout as L
from ringserve.supervisor import Supervisor

log = logging.getLogger("ringserve.supervisor")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ringserve serve", description="run the server: supervisor, GPU process and API workers"
    )
    p.add_argument(
        "--model",
        help=f"a checkpoint directory, a .gguf file, `tiny` (the random test "
        f"model) or a model name (default: {models.DEFAULT_MODEL}, fetched once)",
    )
    p.add_argument("--shm-dir", default=L.DEFAULT_DIRECTORY, help=argparse.SUPPRESS)
    for f in fields(Config):
        if f.name == "model":
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = f.type if isinstance(f.type, str) else f.type.__name__
        typ = (
            int
            if kind.startswith("int")
            else float
            if kind.startswith("float")
            else (lambda raw, n=flag: parse_bool(raw, n))
            if kind == "bool"
            else str
        )
        # A bool flag alone means on (`--require-kernels`); `--cuda-graphs off` gives the value.
        doc = f"(default {f.default}; env RINGSERVE_{f.name.upper()})"
        if f.name == "lora_modules":  # vLLM's shape: --lora-modules a=/path/a b=/path/b
            p.add_argument(flag, nargs="+", default=None, metavar="NAME=PATH", help=doc)
        elif kind == "bool":
            p.add_argument(flag, type=typ, default=None, nargs="?", const=True, help=doc)
        else:
            p.add_argument(flag, type=typ, default=None, help=doc)
    return p


def config_from_args(argv: list[str] | None) -> Config:
    """The Config `ringserve serve ARGV` runs with (flags over RINGSERVE_* over defaults)."""
    args = parser().parse_args(argv)
    if args.lora_modules is not None:
        args.lora_modules = " ".join(args.lora_modules)
    return Config.from_env(**{k: v for k, v in vars(args).items() if k != "shm_dir"})


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        config = config_from_args(argv)
    except ConfigError as exc:
        print(f"ringserve serve: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s supervisor %(levelname)s %(message)s")
    try:
        # Fetching or converting (first start only) runs in a child process: no torch here.
        model = models.ensure(config.model, config.dtype)
    except models.ModelError as exc:
        log.error("%s", exc)
        return 1
    config = config.replace(
        model_name=config.model_name or model.name, chat_template=config.chat_template or model.chat_template
    )
    positions = models.max_positions(model.directory)
    if positions is not None and config.context_limit > positions:
        if config.context_limit != Config.context_limit:  # asked for: refuse (a longer prompt would crash the step)
            log.error(
                "--context-limit %d exceeds what %s's positions allow (max_position_embeddings %d); serve it with "
                "--context-limit %d or less",
                config.context_limit,
                model.name,
                positions,
                positions,
            )
            return 2
        log.info("context limit %d: %s's max_position_embeddings", positions, model.name)
        config = config.replace(context_limit=positions)
    return Supervisor(config, model.directory, args.shm_dir).run()
