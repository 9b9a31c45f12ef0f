"""The report of bench/peers.py: figures from the raw samples, targets, tables and plots.

`summarize` turns a run's samples into medians, p90s, ratios, PASS/MISS and checks (a dict that
is also the JSON); `print_report` prints it as tables; `plot` writes docs/img/peers_*.png.
"""

from __future__ import annotations

import platform
import shlex
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np

from hpkv.benchmark.machine import describe

SYSTEMS = ("off", "hpkv", "lmcache")
ROWS = {  # TTFT row -> (what it measures, the tier its prefix must come from)
    "cold": ("cold, no connector (recompute)", None),
    "engine_hit": ("vLLM prefix-cache hit (in-engine limit)", "device"),
    "engine_hit_busy": ("vLLM prefix-cache hit right after the cold prefill, no pause", "device"),
    "hpkv_cold": ("cold, HPKV engine (computes + saves)", None),
    "hpkv_dram": ("HPKV DRAM hit", "host"),
    "hpkv_storage": ("HPKV storage hit (engine restarted)", "disk"),
    "lmcache_cold": ("cold, LMCache engine (computes + stores)", None),
    "lmcache_l1": ("LMCache L1 (DRAM) hit", "external"),
    "lmcache_l2": ("LMCache L2 (disk) hit (server and engine restarted)", "external"),
}
TTFT_TARGETS = {  # label -> (numerator row, denominator row, bound): median TTFT ratio <= bound
    "HPKV DRAM / LMCache L1": ("hpkv_dram", "lmcache_l1", 1.0),
    "HPKV storage / LMCache L2": ("hpkv_storage", "lmcache_l2", 1.0),
    "HPKV DRAM / in-engine hit": ("hpkv_dram", "engine_hit", 1.3),
}
NOREUSE_TARGET = 0.97
EXTERNAL = ("host", "disk", "p2p", "external_unspecified")
HPKV_LOAD = ("hpkv_load_time_s", "hpkv_loaded_bytes")  # the worker's copies into the engine's KV
LABELS = {"off": "no connector", "hpkv": "HPKV", "lmcache": "LMCache", "off_again": "no connector, again"}


def summarize(results) -> dict:
    ttft = {
        row: {n: ttft_row(row, samples) for n, samples in by_len.items()}
        for row, by_len in results.ttft.items()
        if by_len
    }
    ratios = {}
    for label, (num, den, bound) in TTFT_TARGETS.items():
        for n in sorted(ttft.get(num, {})):
            if n in ttft.get(den, {}):
                value = ttft[num][n]["median_ms"] / ttft[den][n]["median_ms"]
                ratios.setdefault(label, {})[n] = {"value": value, "target": f"<= {bound}", "passed": value <= bound}
    out = {
        "ttft": ttft,
        "ttft_ratios": ratios,
        "noreuse": {
            **summarize_noreuse(results.noreuse),
            "cpu_per_round": summarize_costs(results.noreuse_cpu),
            "requests_per_round": results.noreuse_requests,
        },
        "multiround": summarize_multiround(results.multiround),
    }
    out["notes"] = results.notes
    out["checks"] = checks(out)
    return out


def ttft_row(row: str, samples) -> dict:
    ttfts = [s.ttft_s for s in samples]
    tier = ROWS[row][1]
    cached = {
        k: float(np.median([s.sources.get(k, 0.0) for s in samples])) for k in ("device", "host", "disk", "external")
    }
    return {
        "measure": ROWS[row][0],
        "n": len(ttfts),
        "prompt_tokens": samples[0].prompt_tokens,
        "median_ms": float(np.median(ttfts)) * 1e3,
        "p90_ms": float(np.percentile(ttfts, 90)) * 1e3,
        "cached_tokens": cached,
        "hpkv_load_ms": (
            float(np.median([s.sources["hpkv_load_time_s"] for s in samples])) * 1e3
            if "hpkv_load_time_s" in samples[0].sources and row.startswith("hpkv_")
            else None
        ),
        "tier": tier,
        "from_tier": None if tier is None else all(tier_ok(tier, s.sources) for s in samples),
        "same_token_ids": None if samples[0].same_ids is None else all(s.same_ids for s in samples),
        "same_logprobs": None if samples[0].same_logprobs is None else all(s.same_logprobs for s in samples),
        "samples_ms": [round(t * 1e3, 1) for t in ttfts],
    }


def tier_ok(tier: str, sources: dict[str, float]) -> bool:
    """Most of the prompt came from the tier, and none from a slower one of the same system."""
    if tier == "host":
        return sources.get("host", 0) > 0 and sources.get("disk", 0) == 0
    return sources.get(tier, 0) > 0


def summarize_noreuse(runs: dict[str, list[tuple[int, float]]]) -> dict:
    out = {}
    for kind, rounds in runs.items():
        if rounds:
            out[kind] = {
                "req_per_s": sum(n for n, _ in rounds) / sum(t for _, t in rounds),
                "rounds_req_per_s": [round(n / t, 3) for n, t in rounds],
            }
    if "off" in out:
        for kind in ("hpkv", "lmcache"):
            if kind in out:
                value = out[kind]["req_per_s"] / out["off"]["req_per_s"]
                per_round = [a / b for a, b in zip(out[kind]["rounds_req_per_s"], out["off"]["rounds_req_per_s"])]
                out[f"{kind} / off"] = {
                    "value": value,
                    "target": f">= {NOREUSE_TARGET}" if kind == "hpkv" else "",
                    "passed": value >= NOREUSE_TARGET if kind == "hpkv" else None,
                    "median_of_rounds": float(np.median(per_round)) if per_round else None,
                }
    if "hpkv" in out and "lmcache" in out:
        out["hpkv / lmcache"] = {"value": out["hpkv"]["req_per_s"] / out["lmcache"]["req_per_s"]}
    return out


def summarize_costs(rounds: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Per system, the median over its no-reuse rounds of each CPU or save counter."""
    return {
        kind: {key: float(np.median([r[key] for r in costs])) for key in costs[0]}
        for kind, costs in rounds.items()
        if costs
    }


def summarize_multiround(runs: dict[str, dict]) -> dict:
    out = {}
    reference = {(o.doc, o.round_index): o.token_ids for o in runs.get("off", {}).get("outcomes", [])}
    for kind, run in runs.items():
        outcomes = run["outcomes"]
        ttfts = np.array([o.ttft_s for o in outcomes]) * 1e3
        later = np.array([o.ttft_s for o in outcomes if o.round_index > 0]) * 1e3
        first = np.array([o.ttft_s for o in outcomes if o.round_index == 0]) * 1e3
        same = [o.token_ids == reference.get((o.doc, o.round_index)) for o in outcomes if reference]
        # Where a differing answer first departs from the connector-off one: the first token
        # rests on the loaded KV alone, later ones also on how the engine batched the decode.
        departs = [
            common_prefix(o.token_ids, reference.get((o.doc, o.round_index)))
            for o in outcomes
            if reference and o.token_ids != reference.get((o.doc, o.round_index))
        ]
        c = run["counters"]
        out[kind] = {
            "requests": len(outcomes),
            "wall_s": run["wall_s"],
            "req_per_s": len(outcomes) / run["wall_s"],
            "ttft_median_ms": float(np.median(ttfts)),
            "ttft_p90_ms": float(np.percentile(ttfts, 90)),
            "ttft_round0_median_ms": float(np.median(first)) if len(first) else None,
            "ttft_later_median_ms": float(np.median(later)) if len(later) else None,
            "prompt_tokens": int(sum(o.prompt_tokens for o in outcomes)),
            "cached_tokens": {k: c.get(k, 0.0) for k in ("device", *EXTERNAL) if c.get(k, 0.0)},
            "same_token_ids_as_off": f"{sum(same)}/{len(same)}" if same else None,
            "differing_answers_depart_at_token": departs,
            "ttfts_ms": [round(float(t), 1) for t in ttfts],
        }
    if "hpkv" in out and "lmcache" in out:
        h, p = out["hpkv"], out["lmcache"]
        out["targets"] = {
            "throughput HPKV / LMCache": {
                "value": h["req_per_s"] / p["req_per_s"],
                "target": "> 1",
                "passed": h["req_per_s"] > p["req_per_s"],
            },
            "median TTFT HPKV / LMCache": {
                "value": h["ttft_median_ms"] / p["ttft_median_ms"],
                "target": "< 1",
                "passed": h["ttft_median_ms"] < p["ttft_median_ms"],
            },
        }
    if "hpkv" in out and "off" in out:
        out["hpkv / off"] = {
            "throughput": out["hpkv"]["req_per_s"] / out["off"]["req_per_s"],
            "median TTFT": out["hpkv"]["ttft_median_ms"] / out["off"]["ttft_median_ms"],
        }
    return out


def common_prefix(a: list[int] | None, b: list[int] | None) -> int:
    n = 0
    for x, y in zip(a or [], b or []):
        if x != y:
            break
        n += 1
    return n


def checks(summary: dict) -> dict[str, object]:
    out = {}
    for row, by_len in summary["ttft"].items():
        for n, r in by_len.items():
            if r["same_token_ids"] is not None:
                out[f"{row} {n}: same token ids as the in-engine hit"] = r["same_token_ids"]
            if r["from_tier"] is not None:
                out[f"{row} {n}: prefix from the {r['tier']} source"] = r["from_tier"]
    l1 = l1_objects(summary["notes"].get("lmcache_status_after_restart"))
    if l1 is not None:  # so every LMCache hit after the restart came from L2
        out["LMCache L1 empty after the restart"] = l1 == 0
    for kind, r in summary["multiround"].items():
        if isinstance(r, dict) and r.get("same_token_ids_as_off"):
            out[f"multi-round {kind}: same token ids as no connector"] = r["same_token_ids_as_off"]
    return out


def l1_objects(status) -> int | None:
    try:
        return sum(m["total_object_count"] for m in status["storage_manager"]["l1_managers"].values())
    except (KeyError, TypeError, AttributeError):
        return None


def header(opts, pool_dir: Path, storage_dir: Path) -> dict:
    import lmcache
    import torch
    import vllm

    options = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(opts).items()}
    return {
        "command": shlex.join([sys.executable, *sys.argv]),
        "machine": describe(pool_dir, storage_dir),
        "versions": {
            "vllm": vllm.__version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "lmcache": getattr(lmcache, "__version__", "?"),
        },
        "options": options,
    }


# -- printing -------------------------------------------------------------------------------


def print_report(summary: dict, head: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 140))
    m = head["machine"]
    console.print(f"command: {head['command']}")
    console.print(
        f"machine: {m['cpus']} CPUs ({m['cpu_model']}), {m['memory_bytes'] / 2**30:.0f} GiB, load "
        f"{m['load_avg_1m']} at start; vllm {head['versions']['vllm']}, torch {head['versions']['torch']}, "
        f"lmcache {head['versions']['lmcache']}"
    )
    table = Table(title="(a) time to first token, by prompt length")
    for col in (
        "measure",
        "tokens",
        "median",
        "p90",
        "n",
        "cached dev/host/disk/ext",
        "HPKV copy",
        "from tier",
        "same ids",
    ):
        table.add_column(col, justify="left" if col == "measure" else "right")
    for by_len in summary["ttft"].values():
        for _n, r in sorted(by_len.items()):
            cached = "/".join(f"{r['cached_tokens'][k]:.0f}" for k in ("device", "host", "disk", "external"))
            table.add_row(
                r["measure"],
                str(r["prompt_tokens"]),
                f"{r['median_ms']:.0f} ms",
                f"{r['p90_ms']:.0f} ms",
                str(r["n"]),
                cached,
                f"{r['hpkv_load_ms']:.0f} ms" if r["hpkv_load_ms"] else "",
                yes_no(r["from_tier"]),
                yes_no(r["same_token_ids"]),
            )
    console.print(table)
    ratios = Table(title="(a) ratios of median TTFT")
    for col in ("ratio", "prompt words", "value", "target", "result"):
        ratios.add_column(col)
    for label, by_len in summary["ttft_ratios"].items():
        for n, r in by_len.items():
            ratios.add_row(label, str(n), f"{r['value']:.2f}", r["target"], pass_miss(r["passed"]))
    console.print(ratios)
    print_multiround(console, summary["multiround"])
    print_noreuse(console, summary["noreuse"])
    for label, ok in summary["checks"].items():
        console.print(f"check: {label}: {ok if isinstance(ok, str) else yes_no(ok)}")
    console.print(f"{head['elapsed_s']:.0f} s in all; plots: {', '.join(head.get('plots', [])) or 'none'}")


def print_multiround(console, mr: dict) -> None:
    from rich.table import Table

    table = Table(title="(b) multi-round long-document QA")
    for col in (
        "system",
        "requests",
        "req/s",
        "TTFT median",
        "p90",
        "round 0 median",
        "later rounds median",
        "cached tokens",
        "same ids as off",
    ):
        table.add_column(col, justify="left" if col in ("system", "cached tokens") else "right")
    for kind in (*SYSTEMS, "off_again"):
        if kind in mr:
            r = mr[kind]
            cached = ", ".join(f"{k} {v / 1e3:.0f}K" for k, v in r["cached_tokens"].items()) or "-"
            table.add_row(
                LABELS[kind],
                str(r["requests"]),
                f"{r['req_per_s']:.3f}",
                f"{r['ttft_median_ms']:.0f} ms",
                f"{r['ttft_p90_ms']:.0f} ms",
                f"{r['ttft_round0_median_ms']:.0f} ms",
                f"{r['ttft_later_median_ms']:.0f} ms" if r["ttft_later_median_ms"] else "-",
                f"{cached} of {r['prompt_tokens'] / 1e3:.0f}K",
                r["same_token_ids_as_off"] or "(reference)",
            )
    console.print(table)
    for kind in ("hpkv", "lmcache", "off_again"):
        if mr.get(kind, {}).get("differing_answers_depart_at_token"):
            console.print(
                f"(b) {LABELS[kind]}: answers that differ from no connector's depart at token "
                f"{mr[kind]['differing_answers_depart_at_token']}"
            )
    for label, t in mr.get("targets", {}).items():
        console.print(f"(b) {label}: {t['value']:.2f} (target {t['target']}): {pass_miss(t['passed'])}")
    if "hpkv / off" in mr:
        r = mr["hpkv / off"]
        console.print(
            f"(b) HPKV / no connector: throughput {r['throughput']:.2f}x, median TTFT {r['median TTFT']:.2f}x"
        )


def print_noreuse(console, nr: dict) -> None:
    for kind in SYSTEMS:
        if kind in nr:
            console.print(
                f"(c) no reuse, {LABELS[kind]}: {nr[kind]['req_per_s']:.3f} req/s "
                f"(rounds {nr[kind]['rounds_req_per_s']})"
            )
    for kind, costs in nr.get("cpu_per_round", {}).items():
        console.print(f"(c) {LABELS[kind]}, medians per round: " + ", ".join(f"{k} {v:.3f}" for k, v in costs.items()))
    for label in ("hpkv / off", "lmcache / off", "hpkv / lmcache"):
        if label in nr:
            r = nr[label]
            target = f" (target {r['target']}): {pass_miss(r['passed'])}" if r.get("target") else ""
            rounds = f"; median of the rounds' ratios {r['median_of_rounds']:.3f}" if r.get("median_of_rounds") else ""
            console.print(f"(c) throughput {label}: {r['value']:.3f}{target}{rounds}")


def yes_no(value) -> str:
    return {None: "-", True: "yes", False: "NO"}[value]


def pass_miss(passed: bool) -> str:
    return "PASS" if passed else "MISS"


# -- plots ----------------------------------------------------------------------------------


def plot(summary: dict, out_dir: Path) -> list[str]:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    rows = [
        r
        for r in ("engine_hit", "hpkv_dram", "lmcache_l1", "hpkv_storage", "lmcache_l2", "cold")
        if r in summary["ttft"]
    ]
    if rows:
        lengths = sorted({n for r in rows for n in summary["ttft"][r]})
        fig, ax = plt.subplots(figsize=(9, 5.6))
        width = 0.8 / len(rows)
        for i, row in enumerate(rows):
            med = [summary["ttft"][row].get(n, {}).get("median_ms", np.nan) for n in lengths]
            p90 = [summary["ttft"][row].get(n, {}).get("p90_ms", np.nan) for n in lengths]
            x = np.arange(len(lengths)) + (i - (len(rows) - 1) / 2) * width
            ax.bar(x, med, width, label=ROWS[row][0])
            ax.errorbar(
                x,
                med,
                yerr=[np.zeros(len(med)), np.subtract(p90, med)],
                fmt="none",
                ecolor="black",
                capsize=2,
                linewidth=0.8,
            )
        ax.set_xticks(np.arange(len(lengths)), [f"{n // 1024}K tokens" for n in lengths])
        ax.set_yscale("log")
        ax.set_ylabel("TTFT, ms (median; whisker to p90)")
        ax.set_title("Time to first token on vLLM (CPU): HPKV vs LMCache vs vLLM's own cache")
        ax.legend(fontsize=8, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.1))
        fig.tight_layout()
        paths.append(save(fig, out_dir / "peers_ttft.png"))
    mr, nr = summary["multiround"], summary["noreuse"]
    kinds = [k for k in SYSTEMS if k in mr]
    if kinds:
        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
        for kind in kinds:
            t = np.sort(mr[kind]["ttfts_ms"])
            left.plot(t, np.arange(1, len(t) + 1) / len(t), label=LABELS[kind])
        left.set_xscale("log")
        left.set_xticks([100, 200, 500, 1000, 2000, 5000, 10000, 20000])
        left.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        left.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        left.set_xlabel("TTFT, ms")
        left.set_ylabel("fraction of requests")
        left.set_title("(b) multi-round document QA: TTFT")
        left.legend()
        x = np.arange(len(kinds))
        right.bar(x - 0.2, [mr[k]["req_per_s"] for k in kinds], 0.4, label="(b) multi-round")
        right.bar(x + 0.2, [nr.get(k, {}).get("req_per_s", np.nan) for k in kinds], 0.4, label="(c) no reuse")
        right.set_xticks(x, [LABELS[k] for k in kinds])
        right.set_ylabel("requests/s")
        right.set_title("throughput")
        right.legend()
        fig.tight_layout()
        paths.append(save(fig, out_dir / "peers_throughput.png"))
    return paths


def save(fig, path: Path) -> str:
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
