"""A server's /metrics page as the tools and tests read it: every sample by name."""

from __future__ import annotations

import urllib.request


def samples(text: str) -> dict[str, float]:
    """The samples of a Prometheus text page by name; labelled ones keyed `name{k="v",...}`
    (labels sorted). `model_name`, the one label every `vllm:` series of a server (ringserve's
    or vLLM's) carries alike, is left out of the key: one server serves one model."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()) if k != "model_name")
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def scrape(url: str, timeout: float = 10.0, key: str | None = None) -> dict[str, float]:
    """`samples` of `url`/metrics (`key`: a metrics key, for a server with `--metrics-keys-file`)."""
    headers = {"authorization": f"Bearer {key}"} if key else {}
    req = urllib.request.Request(url + "/metrics", headers=headers)
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return samples(resp.read().decode())
