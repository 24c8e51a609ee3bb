"""A latency-bandwidth model of kerasdist's communication, fitted on 2 ranks, checked on the
measurements it was not fitted on, and run at 1,024 and 27,600 ranks.

How to run (`make bench` runs it after benchmarks/scale_counts.py; it reads result files only,
and measures nothing):

  .venv/bin/python benchmarks/scale_model.py --json benchmarks/results/scale_model.json

Inputs (benchmarks/results/):
  topology_allreduce.json   raw MPI allreduce on 2, 3 and 4 emulated hosts (1 Gbit/s links) as
                            MPICH's own choice and as its ring; 3 hosts x 2 ranks
  scale_hierarchical.json   raw MPI allreduce inside hosts, then across them (2x2 and 3x2)
  scale_counts.json         what the engine sends per cycle at 2 to 128 ranks (counted)
  negotiation_scaling.json  negotiation per op at 2 to 16 ranks on 4 emulated hosts
  allreduce.json            raw MPI allreduce between 2 ranks of one host (shared memory)

The model, for P ranks on H hosts, n bytes, a link of latency alpha and seconds per byte beta:
  ring                2(P-1) (alpha + n beta / P)
  recursive (MPICH's own choice for large n; p the largest power of two <= P; a P that is not
                      one first folds whole buffers into p ranks and returns the result after)
                      2 log2(p) alpha + 2 (p-1)/p n beta  [+ 2 (alpha + n beta) when P > p]
  hierarchical        reduce and broadcast inside each host (shared memory, beta_local), and in
                      between ring or recursive across the H hosts: 2 n beta_local + ring(H)
  bit-vector (fast path, per cycle)   c_fast + ceil(log2 P) alpha_and, 136 bytes whatever P
  rank 0 (slow path, per cycle)       c_slow + (P-1) (alpha + s beta), s a rank's request bytes
  stall questions (a rank waiting > 5 s)  each waiting rank sends P-1 questions and P-2 answers
Fitted on 2 ranks only: alpha and beta on 2 hosts (ring and MPI's choice, which at 2 ranks move
the same bytes in 2 steps: 2 alpha + n beta), beta_local on one host, c_fast, c_slow and
alpha_and from the 2-rank negotiation row, and the counts (AND bytes, s, answer bytes) from the
2-rank counted job. Everything at more ranks is a check.
"""

import argparse
import math

import results as result_files  # benchmarks/results.py, beside this script

MIB = 1 << 20
# ResNet-50's gradients (docs/design: 161 tensors, 97.5 MiB) in the default 16 MiB fusion buffers.
RESNET50_BYTES = int(97.5 * MIB)
FUSION_THRESHOLD = 16 * MIB
# What kerasdist's KERASDIST_ALLREDUCE_ALGORITHM=auto picks (allreduce_algorithm.h): ring from 3
# hosts up, for buffers from 64 KiB (12 MiB when the ranks are a power of two).
RING_FROM_HOSTS, RING_FROM_BYTES, RING_FROM_BYTES_POWER_OF_TWO = 3, 64 << 10, 12 * MIB
STALL_ASK_EVERY_S = 5.0  # stall_inspector.cc's kAskEveryS
COLLECTIVE_TIMEOUT_S = 600.0  # KERASDIST_COLLECTIVE_TIMEOUT_S's default
# An InfiniBand-class network (assumed, not measured: no such network here).
ASSUMED_NETWORK = {"name": "InfiniBand-class (assumed)", "alpha_s": 2e-6, "bytes_per_s": 12.5e9}
# The scales predicted: (nodes, ranks per node).
SCALES = [(1024, 1), (4600, 6)]
# A component breaks where its cost per step passes this share of the step's unavoidable
# communication (2 n beta: every byte of the gradients out and in once over the host's link).
BREAK_SHARE = 0.1


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="the result file (benchmarks/results.py); none: print only")
    return parser.parse_args()


# ---- the model ----------------------------------------------------------------------------------


def ring(ranks, nbytes, alpha, beta):
    return 2 * (ranks - 1) * (alpha + nbytes * beta / ranks) if ranks > 1 else 0.0


def recursive(ranks, nbytes, alpha, beta):
    power = 1 << int(math.log2(ranks))
    time = 2 * math.log2(power) * alpha + 2 * (power - 1) / power * nbytes * beta
    return time + (2 * (alpha + nbytes * beta) if ranks > power else 0.0)


def hierarchical(hosts, ranks_per_host, nbytes, alpha, beta, beta_local, across=ring):
    """Reduce inside each host, ``across`` the hosts, broadcast inside each host."""
    local = 2 * nbytes * beta_local if ranks_per_host > 1 else 0.0
    return local + across(hosts, nbytes, alpha, beta)


def auto_uses_ring(ranks, hosts, nbytes):
    power_of_two = ranks & (ranks - 1) == 0
    return hosts >= RING_FROM_HOSTS and nbytes >= (RING_FROM_BYTES_POWER_OF_TWO if power_of_two else RING_FROM_BYTES)


def fusion_buffers(total, threshold):
    return [threshold] * (total // threshold) + ([total % threshold] if total % threshold else [])


def least_squares_line(points):
    """a, b of t = a + b n, each point weighted by 1/t (relative error: the sizes span 4,000x)."""
    weights = [1 / t for _, t in points]
    sw = sum(w * w for w in weights)
    sx = sum(w * w * n for w, (n, _) in zip(weights, points))
    sy = sum(w * w * t for w, (_, t) in zip(weights, points))
    sxx = sum(w * w * n * n for w, (n, _) in zip(weights, points))
    sxy = sum(w * w * n * t for w, (n, t) in zip(weights, points))
    b = (sw * sxy - sx * sy) / (sw * sxx - sx * sx)
    return (sy - b * sx) / sw, b


# ---- fitting on 2 ranks -------------------------------------------------------------------------


def layout(topology, hosts, ranks_per_host):
    return next(x for x in topology["layouts"] if x["hosts"] == hosts and x["ranks_per_host"] == ranks_per_host)


def micros(cell):
    """'88 (172)' -> 88e-6 s: the fastest of the repeats, as negotiation_scaling's table gives it."""
    return float(cell.split()[0].replace(",", "")) * 1e-6


def fit(topology, one_host, negotiation, counts):
    two_hosts = layout(topology, 2, 1)
    points = [(size["bytes"], size["raw_s"]) for job in ("mpi", "ring") for size in two_hosts["jobs"][job]["sizes"]]
    two_alpha, beta = least_squares_line(points)
    local = [(row["size_bytes"], row["raw_s"]) for row in one_host["sizes"]]
    _, beta_local = least_squares_line(local)
    row = next(r for r in negotiation["tables"]["negotiation"]["rows"] if r[0].startswith("2 "))
    raw, fast, slow = micros(row[1]), micros(row[2]), micros(row[3])
    two = next(r for r in counts["rows"] if r["ranks"] == 2)
    return {
        "alpha_s": two_alpha / 2,
        "beta_s_per_byte": beta,
        "link_gbits_fitted": 8 / beta / 1e9,
        "beta_local_s_per_byte": beta_local,
        "alpha_and_s": raw,  # one round of a small allreduce between 2 hosts
        "c_fast_s": fast - raw,
        "c_slow_s": slow - fast,
        "and_bytes": two["and_bytes_per_cycle"][0],
        "request_bytes_per_rank_per_step": max(two["other_rank_gather_bytes_out_per_step"]),
        "answer_bytes_per_step": two["answer_bytes_per_step"],
        "fit_points": len(points),
    }


# ---- checks against what was not fitted ---------------------------------------------------------


def error(predicted, measured):
    return (predicted - measured) / measured


def check_counts(parameters, counts):
    rows = []
    for row in counts["rows"]:
        p = row["ranks"]
        if p == 2:
            continue
        predicted = {
            "and_bytes": parameters["and_bytes"],
            "rank0_messages_per_slow_cycle": p - 1,
            "rank0_bytes_per_step": (p - 1) * parameters["request_bytes_per_rank_per_step"],
            "answer_bytes_per_step": parameters["answer_bytes_per_step"],
            "questions_per_waiting_rank": 2 * p - 3,
        }
        measured = {
            "and_bytes": max(row["and_bytes_per_cycle"]),
            "rank0_messages_per_slow_cycle": row["rank0_gatherv_messages_in"] / row["churn_slow_path_cycles"],
            "rank0_bytes_per_step": row["rank0_gather_bytes_in_per_step"],
            "answer_bytes_per_step": row["answer_bytes_per_step"],
            "questions_per_waiting_rank": row["stall_isends_per_waiting_rank"][0],
        }
        rows.append({"ranks": p, "predicted": predicted, "measured": measured})
    return rows


def check_times(parameters, topology, hierarchical_runs, negotiation):
    alpha, beta, beta_local = parameters["alpha_s"], parameters["beta_s_per_byte"], parameters["beta_local_s_per_byte"]
    rows = []

    def add(layout_name, algorithm, n, predicted, measured, load):
        rows.append(
            {
                "layout": layout_name,
                "algorithm": algorithm,
                "bytes": n,
                "predicted_s": predicted,
                "measured_s": measured,
                "load": load,
            }
        )

    for x in topology["layouts"]:
        hosts, per_host = x["hosts"], x["ranks_per_host"]
        if (hosts, per_host) == (2, 1):
            continue  # fitted on
        p = hosts * per_host
        for size in x["jobs"]["ring"]["sizes"]:
            n = size["bytes"]
            if n < MIB:
                continue  # below 1 MiB this machine's scheduler, not the link, sets the time
            add(
                f"{hosts}x{per_host}",
                "ring",
                n,
                ring(p, n, alpha, beta),
                size["raw_s"],
                x["jobs"]["ring"]["load_average_at_start"],
            )
            if per_host == 1:  # MPI's own choice; on several ranks per host its algorithm is not known
                mpi = next(s for s in x["jobs"]["mpi"]["sizes"] if s["bytes"] == n)
                add(
                    f"{hosts}x{per_host}",
                    "recursive",
                    n,
                    recursive(p, n, alpha, beta),
                    mpi["raw_s"],
                    x["jobs"]["mpi"]["load_average_at_start"],
                )
    for x in hierarchical_runs["layouts"]:
        for size in x["sizes"]:
            n = size["bytes"]
            # Across the hosts the runs used MPI's own choice, MPICH's recursive halving for these sizes.
            predicted = hierarchical(x["hosts"], x["ranks_per_host"], n, alpha, beta, beta_local, recursive)
            add(
                f"{x['hosts']}x{x['ranks_per_host']}",
                "hierarchical",
                n,
                predicted,
                size["hierarchical_s"],
                x["load_average_at_start"],
            )
    for row in negotiation["tables"]["negotiation"]["rows"]:
        p = int(row[0].split()[0])
        if p == 2:
            continue
        predicted = parameters["c_fast_s"] + math.ceil(math.log2(p)) * parameters["alpha_and_s"]
        rows.append(
            {
                "layout": row[0].replace(" (", " ranks on ").replace(")", " hosts"),
                "algorithm": "bit-vector cycle",
                "bytes": parameters["and_bytes"],
                "predicted_s": predicted,
                "measured_s": micros(row[2]),
                "load": float(row[6]),
            }
        )
    return rows


# ---- predictions --------------------------------------------------------------------------------


def step_costs(nodes, per_node, network, parameters, cycles_per_step):
    """Seconds per ResNet-50 step of each part, and what the parts send, at nodes x per_node."""
    p = nodes * per_node
    alpha, beta = network["alpha_s"], 1 / network["bytes_per_s"]
    beta_rank = beta * per_node  # a flat algorithm's ranks share their node's link
    buffers = fusion_buffers(RESNET50_BYTES, FUSION_THRESHOLD)
    flat_ring = sum(ring(p, n, alpha, beta) for n in buffers)
    flat_recursive = sum(recursive(p, n, alpha, beta_rank) for n in buffers)
    auto = sum(
        ring(p, n, alpha, beta) if auto_uses_ring(p, nodes, n) else recursive(p, n, alpha, beta_rank) for n in buffers
    )
    beta_local = parameters["beta_local_s_per_byte"]
    hier_ring = sum(hierarchical(nodes, per_node, n, alpha, beta, beta_local) for n in buffers)
    hier_recursive = sum(hierarchical(nodes, per_node, n, alpha, beta, beta_local, recursive) for n in buffers)
    fast = cycles_per_step * (parameters["c_fast_s"] + math.ceil(math.log2(p)) * alpha)
    slow = parameters["c_slow_s"] + (p - 1) * (alpha + parameters["request_bytes_per_rank_per_step"] * beta)
    return {
        "ranks": p,
        "nodes": nodes,
        "ranks_per_node": per_node,
        "bandwidth_bound_s": 2 * RESNET50_BYTES * beta,
        "fused_buffers": len(buffers),
        "data_ring_s": flat_ring,
        "data_recursive_s": flat_recursive,
        "data_auto_s": auto,
        "data_hierarchical_ring_s": hier_ring,
        "data_hierarchical_recursive_s": hier_recursive,
        "fast_path_per_step_s": fast,
        "slow_path_per_cycle_s": slow,
        "rank0_bytes_per_slow_cycle": (p - 1) * parameters["request_bytes_per_rank_per_step"],
        "rank0_messages_per_slow_cycle": p - 1,
        "stall_messages_per_waiting_rank": 2 * p - 3,
        "stall_messages_job_wide": (p - 1) * (2 * p - 3) + (p - 1),
        "and_bytes": parameters["and_bytes"],
        "longest_call_s": max(ring(p, n, alpha, beta) for n in buffers),
    }


def break_points(network, parameters, cycles_per_step):
    """The fewest ranks (one per node) at which each part passes BREAK_SHARE of the bandwidth bound."""

    def first(cost):
        p = 2
        while p <= 1 << 20:
            c = step_costs(p, 1, network, parameters, cycles_per_step)
            if cost(c) > BREAK_SHARE * c["bandwidth_bound_s"]:
                return p
            p *= 2
        return None

    return {
        "ring latency (auto's choice)": first(lambda c: c["data_auto_s"] - c["bandwidth_bound_s"]),
        "rank 0, slow path every step": first(lambda c: c["slow_path_per_cycle_s"]),
        "bit-vector fast path": first(lambda c: c["fast_path_per_step_s"]),
    }


# ---- the page's tables --------------------------------------------------------------------------


def duration(seconds):
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def count(value):
    return f"{value:,.0f}"


def percent(value):
    return f"{value * 100:+.0f}%"


# What each part costs as ranks grow, and the fix; the numbers come from the predictions.
PARTS = [
    (
        "fusion buffer's allreduce (auto picks ring from 3 hosts)",
        "ring latency (auto's choice)",
        lambda c: f"{duration(c['data_auto_s'])} per step, against {duration(c['bandwidth_bound_s'])} for the bytes",
        "2(P-1) latencies per fused buffer",
        "ring only while 2(P-1) alpha is small against n beta; beyond, reduce inside hosts first and cross "
        "hosts with a log P algorithm (recursive halving, tree); fewer, larger buffers",
    ),
    (
        "rank 0's coordinator (slow path)",
        "rank 0, slow path every step",
        lambda c: (
            f"{duration(c['slow_path_per_cycle_s'])} and {c['rank0_bytes_per_slow_cycle'] / 1e6:.0f} MB "
            f"from {count(c['rank0_messages_per_slow_cycle'])} messages per slow cycle"
        ),
        "P-1 messages and (P-1) s bytes into rank 0 per slow cycle",
        "matters where the slow path recurs (join at an epoch's end, more names per step than the cache "
        "holds, a stale request): agree on new requests by an allreduce of their hash (min = max) and "
        "gather full requests only when it differs, or gather along a tree that merges equal requests",
    ),
    (
        "stall inspector, the watchdog's liveness questions",
        "all-to-all: every waiting rank connects to every other (over TCP, a socket each: the usual "
        "open-file limit of 1,024 is reached near 1,024 ranks; not tried)",
        lambda c: (
            f"{count(c['stall_messages_per_waiting_rank'])} messages per waiting rank, "
            f"{count(c['stall_messages_job_wide'])} job-wide, every {STALL_ASK_EVERY_S:g} s of waiting"
        ),
        "every waiting rank asks all P-1 peers (and answers P-2): (P-1)(2P-3) messages",
        "a rank that waits more than 5 s (rank 0 checkpointing) makes every rank connect to every other: "
        "ask along a tree, or let rank 0 alone ask and the others ask rank 0",
    ),
    (
        "response cache and bit-vector fast path",
        "bit-vector fast path",
        lambda c: f"{duration(c['fast_path_per_step_s'])} per step, {c['and_bytes']} B per cycle",
        "one AND of 136 B per cycle, log2 P rounds",
        "none needed for scale: it breaks only when a step has more names than KERASDIST_CACHE_CAPACITY "
        "(1,024), and then as rank 0's row",
    ),
    (
        "watchdog's collective timeout",
        "never: a timeout per call, no state per rank",
        lambda c: f"longest single call {duration(c['longest_call_s'])}, against a {COLLECTIVE_TIMEOUT_S:g} s timeout",
        "no per-rank state; a timeout per call",
        "none: the longest call predicted stays far inside KERASDIST_COLLECTIVE_TIMEOUT_S",
    ),
]


def tables(parameters, counts, times, predictions, breaks, cycles_per_step):
    measured_name, assumed_name = "this machine's emulated link (fitted)", ASSUMED_NETWORK["name"]
    at_scale = {(p["network"], p["ranks"]): p for p in predictions}
    largest = max(p["ranks"] for p in predictions)
    summary_rows = []
    for part, break_key, at_largest, grows, fix in PARTS:
        if break_key in breaks[assumed_name]:
            first = breaks[assumed_name][break_key]
            where = count(first) if first else "not within 10^6 ranks"
        else:  # a part whose limit is not a time: the reason instead
            where = break_key
        summary_rows.append(
            [
                part,
                grows,
                where,
                at_largest(at_scale[(assumed_name, largest)]),
                fix,
            ]
        )
    summary = {
        "columns": [
            "part",
            "what grows with P (counted at 2-128 ranks)",
            f"ranks where it passes {BREAK_SHARE:.0%} of the step's bandwidth time (InfiniBand-class, assumed)",
            f"at {count(largest)} ranks (4,600 nodes x 6), ResNet-50, InfiniBand-class",
            "fix",
        ],
        "rows": summary_rows,
    }
    fit_table = {
        "columns": ["parameter", "value", "fitted on"],
        "rows": [
            [
                "alpha (link latency)",
                duration(parameters["alpha_s"]),
                "2 hosts, 1 Gbit/s: raw MPI allreduce, 4 KiB-16 MiB",
            ],
            ["beta (link)", f"{parameters['link_gbits_fitted']:.2f} Gbit/s", "the same 14 points"],
            [
                "beta_local (shared memory)",
                f"{8 / parameters['beta_local_s_per_byte'] / 1e9:.0f} Gbit/s",
                "2 ranks, one host",
            ],
            [
                "alpha_and (one round of the AND)",
                duration(parameters["alpha_and_s"]),
                "2 ranks, 2 hosts: raw 4-byte allreduce",
            ],
            ["c_fast (a fast-path cycle's own cost)", duration(parameters["c_fast_s"]), "the same row: fast - raw"],
            ["c_slow (a slow-path cycle's own cost)", duration(parameters["c_slow_s"]), "the same row: slow - fast"],
            ["AND per cycle", f"{parameters['and_bytes']} B", "2 ranks, counted"],
            [
                "s (a rank's requests per step)",
                f"{parameters['request_bytes_per_rank_per_step']:,} B",
                "2 ranks, counted",
            ],
            ["answer per step", f"{parameters['answer_bytes_per_step']:,} B", "2 ranks, counted"],
        ],
    }

    def pair(key, row, render=count):
        predicted, measured = row["predicted"][key], row["measured"][key]
        return f"{render(predicted)} / {render(measured)} ({percent(error(predicted, measured))})"

    count_table = {
        "columns": [
            "ranks",
            "AND bytes per cycle",
            "rank 0: messages per slow cycle",
            "rank 0: bytes per churning step",
            "answer bytes per step",
            "messages per waiting rank",
        ],
        "rows": [
            [row["ranks"]]
            + [
                pair(key, row)
                for key in (
                    "and_bytes",
                    "rank0_messages_per_slow_cycle",
                    "rank0_bytes_per_step",
                    "answer_bytes_per_step",
                    "questions_per_waiting_rank",
                )
            ]
            for row in counts
        ],
    }
    time_table = {
        "columns": ["layout", "algorithm", "size", "predicted", "measured", "error", "load"],
        "rows": [
            [
                row["layout"],
                row["algorithm"],
                f"{row['bytes'] >> 20} MiB" if row["bytes"] >= MIB else f"{row['bytes']} B",
                duration(row["predicted_s"]),
                duration(row["measured_s"]),
                percent(error(row["predicted_s"], row["measured_s"])),
                f"{row['load']:.1f}",
            ]
            for row in times
        ],
    }
    columns = [(n, p) for n in (assumed_name, measured_name) for p in sorted({x["ranks"] for x in predictions})]
    labels = {assumed_name: "InfiniBand-class", measured_name: "this machine's link"}
    quantities = [
        ("gradient bytes out and in once (the bound)", lambda c: duration(c["bandwidth_bound_s"])),
        ("allreduce as auto picks it (today)", lambda c: duration(c["data_auto_s"])),
        ("flat ring", lambda c: duration(c["data_ring_s"])),
        ("flat recursive halving (MPI's large-message choice)", lambda c: duration(c["data_recursive_s"])),
        ("inside hosts, then ring across hosts", lambda c: duration(c["data_hierarchical_ring_s"])),
        ("inside hosts, then recursive halving across hosts", lambda c: duration(c["data_hierarchical_recursive_s"])),
        ("negotiation, fast path (all cycles of a step)", lambda c: duration(c["fast_path_per_step_s"])),
        ("negotiation, one slow-path cycle at rank 0", lambda c: duration(c["slow_path_per_cycle_s"])),
        ("rank 0 receives per slow cycle", lambda c: f"{c['rank0_bytes_per_slow_cycle'] / 1e6:.1f} MB"),
        ("stall questions job-wide per 5 s of waiting", lambda c: count(c["stall_messages_job_wide"])),
    ]
    prediction_table = {
        "columns": ["per ResNet-50 step (97.5 MiB in 7 buffers)"]
        + [f"{count(p)} ranks, {labels[n]}" for n, p in columns],
        "rows": [[name] + [render(at_scale[key]) for key in columns] for name, render in quantities],
    }
    assumptions = {
        "columns": ["assumed, not measured here", "value"],
        "rows": [
            ["latency of one message, InfiniBand-class", duration(ASSUMED_NETWORK["alpha_s"])],
            ["a node's link, InfiniBand-class", f"{ASSUMED_NETWORK['bytes_per_s'] * 8 / 1e9:.0f} Gbit/s"],
            [
                "gradients per step (ResNet-50)",
                f"{RESNET50_BYTES / MIB:.1f} MiB in {len(fusion_buffers(RESNET50_BYTES, FUSION_THRESHOLD))} "
                f"fused buffers of at most {FUSION_THRESHOLD >> 20} MiB",
            ],
            ["negotiation cycles per step", f"{cycles_per_step:.1f} (the most counted per steady step)"],
            [
                "a rank's requests per step (s)",
                f"{parameters['request_bytes_per_rank_per_step']:,} B (counted: 4 buckets, 161 tensors)",
            ],
            ["reduce and broadcast inside a node", "this host's shared memory (beta_local above)"],
            ["ranks of a node in a flat recursive allreduce", "share the node's link"],
        ],
    }
    return {
        "summary": summary,
        "assumptions": assumptions,
        "fit": fit_table,
        "count checks": count_table,
        "time checks": time_table,
        "predictions": prediction_table,
    }


def main():
    args = parse_args()
    run = result_files.start_run("scale_model")
    inputs = {
        name: result_files.read(result_files.RESULTS_DIR / f"{name}.json")
        for name in ("topology_allreduce", "scale_hierarchical", "allreduce", "negotiation_scaling", "scale_counts")
    }
    parameters = fit(
        inputs["topology_allreduce"], inputs["allreduce"], inputs["negotiation_scaling"], inputs["scale_counts"]
    )
    counts = check_counts(parameters, inputs["scale_counts"])
    times = check_times(
        parameters, inputs["topology_allreduce"], inputs["scale_hierarchical"], inputs["negotiation_scaling"]
    )
    cycles = max(r["steady_cycles"] / r["steady_steps"] for r in inputs["scale_counts"]["rows"])
    measured_network = {
        "name": "this machine's emulated link (fitted)",
        "alpha_s": parameters["alpha_s"],
        "bytes_per_s": 1 / parameters["beta_s_per_byte"],
    }
    predictions = [
        {"network": network["name"], **step_costs(nodes, per_node, network, parameters, cycles)}
        for network in (measured_network, ASSUMED_NETWORK)
        for nodes, per_node in SCALES
    ]
    breaks = {
        network["name"]: break_points(network, parameters, cycles) for network in (measured_network, ASSUMED_NETWORK)
    }
    print(parameters)
    for row in counts + times + predictions:
        print(row)
    print(breaks)
    if args.json:
        record = result_files.finish_run(
            run,
            inputs={
                name: {"date": record.get("date") or record.get("recorded"), "source": record["source"]}
                for name, record in inputs.items()
            },
            parameters=parameters,
            cycles_per_step=cycles,
            count_checks=counts,
            time_checks=times,
            predictions=predictions,
            break_points=breaks,
            tables=tables(parameters, counts, times, predictions, breaks, cycles),
            notes="computed from the result files under inputs; it measures nothing",
        )
        result_files.write(args.json, record)


if __name__ == "__main__":
    main()
