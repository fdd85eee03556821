"""bench.handoff: the KV handoff by transport, one result per transport (handoff_tcp, handoff_shm, ...)."""

from __future__ import annotations

from typing import Any

from bench.report.model import Comparison, Document, Documents, Target, num, ratio, table

MIB = 2**20
TARGET_FACTOR = 5.0  # the issue's: the socket's wait after a long prefill at least 5x below Redis's


def body(docs: Documents) -> list[str]:
    rows = [[_row_transport(doc, r), f"{r['prompt_tokens']:,}", num(r["kv_bytes_per_request"] / MIB), _ms(r["handoff_mean_s"]),
             _ms(r["itl0_client_mean_s"]), _ms(r["ttft_client_mean_s"])]
            for doc in docs.values() for r in doc["summary"]]
    return table(["transport", "prompt tokens", "KV MiB", "handoff ms", "ITL[0] ms", "TTFT ms"], rows)


def targets(docs: Documents) -> list[Target]:
    """The socket (streamed) against Redis at the longest prompt both measured, where both ran."""
    by = {transport(doc): doc for doc in docs.values()}
    socket, redis = by.get("tcp, streamed"), by.get("redis")
    if socket is None or redis is None:
        return []
    lengths = _handoff_s(socket).keys() & _handoff_s(redis).keys()
    if not lengths:
        return []
    n = max(lengths)
    ours, theirs = _handoff_s(socket)[n], _handoff_s(redis)[n]
    return [Target(f"KV handoff over the socket: the wait left after a {n:,}-token prefill at least "
                   f"{TARGET_FACTOR:g}x below Redis's", theirs / ours, TARGET_FACTOR,
                   f"{ours * 1000:,.1f} vs {theirs * 1000:,.1f} ms, {ratio(theirs / ours)}")]


def transport(doc: Document) -> str:
    """How the KV went: over the data port it streams layer by layer unless --stream-min-tokens 0."""
    name = doc["config"]["transport"]
    if name != "tcp":
        return name
    return "tcp, whole" if doc["config"].get("stream_min_tokens") == 0 else "tcp, streamed"


def _row_transport(doc: Document, row: dict[str, Any]) -> str:
    """A prompt shorter than the stream minimum goes whole even where the socket streams."""
    name = transport(doc)
    return "tcp, whole" if name == "tcp, streamed" and not row.get("streamed") else name


def _handoff_s(doc: Document) -> dict[int, float]:
    return {r["prompt_tokens"]: r["handoff_mean_s"] for r in doc["summary"] if r["handoff_mean_s"]}


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else num(seconds * 1000)


COMPARISON = Comparison(
    prefix="handoff",
    title="The KV handoff by transport",
    what="One stack per transport (docs/deploy.md, \"KV handoff\"), prefix caching off, requests one at a time. "
         "Handoff: from the end of the prefill to the KV being ready on the decode worker, which the second token "
         "waits for (ITL[0]).",
    body=body,
    targets=targets,
)
