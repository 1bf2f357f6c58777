"""A running daemon's Prometheus metrics, as a test reads them: one scrape of ``/metrics``
into {(sample name, labels): value}."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(http_url: str, token: str | None = None) -> Samples:
    request = urllib.request.Request(http_url + "/metrics")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    text = urllib.request.urlopen(request, timeout=10).read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def sample(samples: Samples, name: str, **labels: str) -> float:
    """The value of one series (0 when the daemon never created it)."""
    return samples.get((name, frozenset(labels.items())), 0.0)
