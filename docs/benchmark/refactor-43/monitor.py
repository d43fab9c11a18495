"""Logs, every second, the CPU used by processes outside ROOT's tree (another user's bursts).

python monitor.py ROOT_PID LOG: one line a second, `unix-time percent-of-a-core busiest-command`.
"""

import os
import sys
import time

import psutil


def main(root: int, log: str) -> None:
    prev: dict[int, float] = {}
    with open(log, "a", buffering=1) as out:
        while psutil.pid_exists(root):
            mine = {root, os.getpid()} | {p.pid for p in psutil.Process(root).children(recursive=True)}
            foreign, top = 0.0, ""
            cur: dict[int, float] = {}
            for p in psutil.process_iter(["pid", "cmdline", "cpu_times"]):
                try:
                    times = p.info["cpu_times"]
                    cur[p.pid] = times.user + times.system
                except Exception:
                    continue
                if p.pid in mine or p.pid not in prev:
                    continue
                used = cur[p.pid] - prev[p.pid]
                if used > 0.05:
                    foreign += used
                    if not top or used > 0.3:
                        top = " ".join(p.info["cmdline"] or [])[:80]
            prev = cur
            out.write(f"{time.time():.1f} {foreign * 100:.0f} {top}\n")
            time.sleep(1)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
