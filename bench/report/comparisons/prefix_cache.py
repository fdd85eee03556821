"""bench.prefix_cache: two stacks, prefix caching off and on, on a shared-prefix workload."""

from __future__ import annotations

from bench.prefix_cache import TARGET_RATIO
from bench.report.model import Comparison, Documents, Target, num, percent, ratio, table


def body(docs: Documents) -> list[str]:
    lines: list[str] = []
    for doc in docs.values():
        c, r = doc["config"], doc["ttft_ratio_off_on"]
        lines += [f"{c['num_prompts']} requests at {c['request_rate']:g}/s: {c['num_groups']} shared prefixes of "
                  f"{c['prefix_len']:,} tokens, each request one of them plus {c['suffix_len']} tokens of its own, "
                  f"{c['output_len']} output tokens.", ""]
        lines += table(
            ["prefix caching", "TTFT mean ms", "TTFT p50 ms", "TTFT p99 ms", "output tok/s", "hit rate",
             "KV handoff MiB/request"],
            [[row["prefix_caching"], num(row["ttft_mean_ms"], 0), num(row["ttft_p50_ms"], 0),
              num(row["ttft_p99_ms"], 0),
              num(row["output_throughput_tok_s"], 2), percent(row["prefix_cache_hit_rate"]),
              num(row["handoff_mib_per_request"])] for row in doc["summary"]],
        )
        lines += ["", f"TTFT off / on: {ratio(r['mean'])} on the mean, {ratio(r['p50'])} on the median."]
    return lines


def targets(docs: Documents) -> list[Target]:
    return [Target(f"prefix caching cuts the mean TTFT at least {TARGET_RATIO:g}x on a shared-prefix workload",
                   doc["ttft_ratio_off_on"]["mean"], TARGET_RATIO,
                   f"{ratio(doc['ttft_ratio_off_on']['mean'])} ({name})") for name, doc in docs.items()]


COMPARISON = Comparison(
    prefix="prefix_cache",
    title="Prefix caching on vs off",
    what="Two stacks one after the other, identical but for `LLMD_KV_CACHE__ENABLE_PREFIX_CACHING`, on the same "
         "requests; the hit rate is the prefill workers' `vllm:prefix_cache_hits` over their queries.",
    body=body,
    targets=targets,
)
