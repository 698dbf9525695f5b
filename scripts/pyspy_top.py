"""Summarise a `py-spy record --format raw` profile: the functions that hold the most samples,
by self time (the leaf frame) and in total (anywhere on the stack), per thread.

    python scripts/pyspy_top.py PROFILE.txt [N]
"""
from __future__ import annotations

import collections
import sys


def summarise(path: str, top: int = 18) -> str:
    own: collections.Counter = collections.Counter()
    total: collections.Counter = collections.Counter()
    threads: collections.Counter = collections.Counter()
    samples = 0
    for line in open(path):
        stack, _, count = line.rstrip().rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        samples += n
        threads[frames[0]] += n
        own[frames[-1]] += n
        for frame in set(frames[1:]):
            total[frame] += n
    out = [f"{samples} samples; threads: " + ", ".join(f"{t} {100 * c / samples:.0f}%" for t, c in threads.most_common(4))]
    for title, counter in (("self", own), ("total", total)):
        out.append(f"-- {title}")
        out += [f"{100 * c / samples:5.1f}%  {f[:150]}" for f, c in counter.most_common(top)]
    return "\n".join(out)


if __name__ == "__main__":
    print(summarise(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 18))
