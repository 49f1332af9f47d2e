#!/usr/bin/env python3
"""Interleaved datapath comparison for e2e/bench/overlay.sh (run as root).

Each argument is LABEL:FROM_NS:TO_NS:ADDR. Every round measures every pair
once, in alternating order, so the machine's drift and noise hit all pairs
alike: TCP throughput with iperf3 (client on CPU 0, server on CPU 1;
--streams parallel streams, 1 by default) and
ping round trips (ping on CPU 0), twice: spaced 2 ms apart (an idle path,
as a request meets it; on a VM this includes waking halted CPUs), in ten
short blocks per round with the pairs taking turns, and back to back (ping
-f: the path's own cost, caches warm). A short unrecorded run per pair first
lets a freshly started sandbox settle. Prints one line per pair: the label,
the median Gbit/s over the rounds, the median spaced round trip (ms) of all
samples, the mean back-to-back round trip (ms) over the rounds, then each
round's Gbit/s. With --ratio A/B, also a line "A/B" followed by the median
over rounds of A's figure divided by B's in the same round (throughput,
spaced round trip, back-to-back round trip): pairing within a round cancels
the drift between rounds that a ratio of two medians keeps.
"""

import argparse
import json
import statistics
import subprocess
import time

PORT = 5301
# Spaced pings of a round come in this many blocks, the pairs taking turns.
BLOCKS = 10


def netns(ns, *cmd, **kw):
    return subprocess.run(["ip", "netns", "exec", ns, *cmd], **kw)


def throughput(src, dst, addr, secs, streams=1):
    server = subprocess.Popen(
        ["ip", "netns", "exec", dst, "taskset", "-c", "1", "iperf3", "-s", "-p", str(PORT), "-1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 5
        while f":{PORT} " not in netns(dst, "ss", "-ltnH", capture_output=True, text=True).stdout:
            if time.monotonic() > deadline:
                raise RuntimeError(f"iperf3 server in {dst} did not listen")
            time.sleep(0.01)
        out = netns(
            src, "taskset", "-c", "0", "iperf3", "-c", addr, "-p", str(PORT), "-t", str(secs), "-P", str(streams), "-J",
            capture_output=True, text=True, check=True,
        ).stdout
        return json.loads(out)["end"]["sum_received"]["bits_per_second"] / 1e9
    finally:
        server.wait(timeout=10)


def round_trips(src, addr, count):
    out = netns(
        src, "taskset", "-c", "0", "ping", "-c", str(count), "-i", "0.002", addr, capture_output=True, text=True,
    ).stdout
    samples = [float(line.split("time=")[1].split()[0]) for line in out.splitlines() if "time=" in line]
    if not samples:
        raise RuntimeError(f"ping from {src} to {addr} got no replies:\n{out}")
    return samples


def busy_round_trip(src, addr, count):
    out = netns(src, "taskset", "-c", "0", "ping", "-f", "-q", "-c", str(count), addr, capture_output=True, text=True).stdout
    # rtt min/avg/max/mdev = 0.018/0.025/1.014/0.011 ms
    if "rtt min/avg/max/mdev = " not in out:
        raise RuntimeError(f"ping -f from {src} to {addr} got no replies:\n{out}")
    return float(out.split("rtt min/avg/max/mdev = ")[1].split("/")[1])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--secs", type=int, default=4)
    p.add_argument("--streams", type=int, default=1, help="parallel TCP streams of iperf3 (-P)")
    p.add_argument("--pings", type=int, default=200, help=f"spaced pings per pair and round, in {BLOCKS} blocks")
    p.add_argument("--ratio", action="append", default=[], help="A/B: per-round ratios of two labels")
    p.add_argument("pairs", nargs="+")
    a = p.parse_args()
    if a.pings < BLOCKS:
        p.error(f"--pings must be at least {BLOCKS} (one per block)")
    # ADDR last: an IPv6 address keeps its colons.
    pairs = [x.split(":", 3) for x in a.pairs]
    gbps = {label: [] for label, *_ in pairs}
    rtts = {label: [] for label, *_ in pairs}
    round_rtts = {label: [] for label, *_ in pairs}
    busy = {label: [] for label, *_ in pairs}
    for label, src, dst, addr in pairs:
        throughput(src, dst, addr, 1)
    for r in range(a.rounds):
        order = pairs if r % 2 == 0 else list(reversed(pairs))
        for label, src, dst, addr in order:
            gbps[label].append(throughput(src, dst, addr, a.secs, a.streams))
        # Spaced pings in short blocks taking turns, so that what the VM's
        # idle CPUs do meanwhile falls on every pair alike.
        samples = {label: [] for label, *_ in pairs}
        for _ in range(BLOCKS):
            for label, src, _dst, addr in order:
                samples[label] += round_trips(src, addr, a.pings // BLOCKS)
        for label, src, _dst, addr in order:
            rtts[label] += samples[label]
            round_rtts[label].append(statistics.median(samples[label]))
            busy[label].append(busy_round_trip(src, addr, 20 * a.pings))
    for label, *_ in pairs:
        runs = " ".join(f"{x:.2f}" for x in gbps[label])
        rtt, rtt_busy = statistics.median(rtts[label]), statistics.mean(busy[label])
        print(f"{label} {statistics.median(gbps[label]):.2f} {rtt:.4f} {rtt_busy:.4f} {runs}")
    for ratio in a.ratio:
        x, y = ratio.split("/")
        paired = [
            statistics.median(mx / my for mx, my in zip(figures[x], figures[y]))
            for figures in (gbps, round_rtts, busy)
        ]
        print(ratio, " ".join(f"{r:.3f}" for r in paired))


if __name__ == "__main__":
    main()
