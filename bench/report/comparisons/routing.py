"""bench.routing: cache-aware routing off vs on, multi-turn chats on 2 prefill + 2 decode workers."""

from __future__ import annotations

from bench.report.model import Comparison, Document, Documents, Target, num, percent, ratio, table

OFF, ON, PAIR = "2+2, off", "2+2, on", "1+1, on"  # bench.routing's modes
HIT_SHARE = 0.9  # the issue's: 2+2 workers cache at least 90% of what one pair does
KV_FACTOR = 3.0  # KV moved per follow-up at least 3x less than the shared stream
TTFT_FACTOR = 2.0  # follow-ups' TTFT p50 at least 2x lower than the shared stream


def body(docs: Documents) -> list[str]:
    lines: list[str] = []
    for doc in docs.values():
        c = doc["config"]
        lines += [f"{c['conversations']} conversations of {c['turns']} turns: a {c['system_len']:,}-token system "
                  f"prompt, {c['user_len']}-token messages; the follow-ups measured apart.", ""]
        lines += table(
            ["workers, routing", "follow-ups cached", "follow-ups' TTFT p50 ms", "TTFT p99 ms", "ITL p99 ms",
             "KV MiB per follow-up"],
            [[mode, percent(m["follow_up_hit_rate"]), num(m["follow_up_ttft_p50_ms"], 0),
              num(m["follow_up_ttft_p99_ms"], 0), num(m["itl_p99_ms"], 0), num(m["kv_mib_per_follow_up"], 2)]
             for mode, m in doc["modes"].items()],
        )
    return lines


def targets(docs: Documents) -> list[Target]:
    doc = docs.get("routing")  # the load-weight sweep (routing_load_weights) has no modes to compare
    if doc is None or not {OFF, ON, PAIR} <= doc["modes"].keys():
        return []
    off, on, pair = (doc["modes"][mode] for mode in (OFF, ON, PAIR))
    hits = on["follow_up_hit_rate"] / pair["follow_up_hit_rate"]
    # no KV moved at all with routing: infinitely less, which meets any factor
    kv = off["kv_mib_per_follow_up"] / on["kv_mib_per_follow_up"] if on["kv_mib_per_follow_up"] else float("inf")
    ttft = off["follow_up_ttft_p50_ms"] / on["follow_up_ttft_p50_ms"]
    return [
        Target(f"routing, 2+2 workers: follow-ups' prefix hit rate at least {HIT_SHARE:.0%} of 1+1's", hits, HIT_SHARE,
               f"{hits:.0%}: {percent(on['follow_up_hit_rate'])} vs {percent(pair['follow_up_hit_rate'])}"),
        Target(f"routing: KV moved per follow-up at least {KV_FACTOR:g}x less than the shared stream", kv, KV_FACTOR,
               f"{num(on['kv_mib_per_follow_up'], 2)} vs {num(off['kv_mib_per_follow_up'], 2)} MiB"),
        Target(f"routing: follow-ups' TTFT p50 at least {TTFT_FACTOR:g}x lower than the shared stream", ttft,
               TTFT_FACTOR, f"{ratio(ttft)}: {_ms(on)} vs {_ms(off)} ms"),
    ]


def _ms(mode: Document) -> str:
    return num(mode["follow_up_ttft_p50_ms"], 0)


COMPARISON = Comparison(
    prefix="routing",
    title="Routing by cached prefix off vs on",
    what="Stacks identical but for `LLMD_ROUTING__ENABLED` and the worker count; every turn sends the whole "
         "history plus a new message. Cached: the follow-ups' `usage.prompt_tokens_details`.",
    body=body,
    targets=targets,
)
