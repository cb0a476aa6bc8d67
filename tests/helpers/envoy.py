"""Envoy alone on a fleet config (`tools/fleet/envoy_config.py`), for tests that need the real proxy in
front of replicas they start themselves (or of none)."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

from ringserve.tools.fleet.envoy_config import FleetSpec, envoy_config, to_yaml
from ringserve.tools.fleet.replicas import envoy_binary


class EnvoyProcess:
    """`with EnvoyProcess(spec, tmp_path) as port:` Envoy listening on `spec.listen_port`."""

    def __init__(self, spec: FleetSpec, directory: Path) -> None:
        self.spec = spec
        self.config = directory / "envoy.yaml"
        self.log = directory / "envoy.log"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> int:
        self.config.write_text(to_yaml(envoy_config(self.spec)))
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [envoy_binary(), "-c", str(self.config), "--disable-hot-restart", "-l", "error"],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection((self.spec.listen_host, self.spec.listen_port), 0.2).close()
                return self.spec.listen_port
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.__exit__()
                    raise RuntimeError(f"Envoy did not listen: {self.log.read_text()[-2000:]}") from None
                time.sleep(0.1)

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
