#!/usr/bin/env python3
"""Run a test binary; if it stops printing for STALL seconds, dump where every thread waits.

No gdb needed: for each thread it reads /proc/PID/task/TID/{wchan,syscall,stat}, then scans the
thread's stack (from its stack pointer upwards, /proc/PID/mem) for words that point into executable
mappings, and names those in the test binary with its symbol table (nm -C). A stack scan also shows
stale return addresses, so read each list from the top (innermost) and trust the frames that make a
plausible call chain. Addresses inside libcuda.so are printed as library+offset.

usage: scripts/hang-stacks.py [--stall 15] [--runs 6] -- BINARY [libtest args...]
Exit status: 0 when every run finished, 3 when a run stalled (the dump is on stdout).
"""
import argparse
import bisect
import os
import struct
import subprocess
import sys
import threading
import time


def symbols(binary, kinds="tTwW"):
    out = subprocess.run(["nm", "-C", "--defined-only", binary], capture_output=True, text=True).stdout
    syms = []
    for line in out.splitlines():
        parts = line.split(" ", 2)
        if len(parts) == 3 and parts[1] in kinds:
            syms.append((int(parts[0], 16), parts[2]))
    syms.sort()
    return syms


def maps(pid, real):
    exe, base = [], None
    for line in open(f"/proc/{pid}/maps"):
        f = line.split()
        lo, hi = (int(x, 16) for x in f[0].split("-"))
        path = f[5] if len(f) > 5 else "?"
        if base is None and int(f[2], 16) == 0 and os.path.realpath(path) == real:
            base = lo  # the binary's load base: nm's addresses are relative to it (PIE)
        if "x" in f[1]:
            exe.append((lo, hi, int(f[2], 16), path))
    return exe, base or 0


def dump(pid, binary, words=8192):
    syms = symbols(binary)
    addrs = [a for a, _ in syms]
    data = symbols(binary, "bBdD")  # statics: names a futex that is a static lock (PRIMARY, REGISTRY, ...)
    daddrs = [a for a, _ in data]
    real = os.path.realpath(binary)
    exe, base = maps(pid, real)
    mem = open(f"/proc/{pid}/mem", "rb")
    for tid in sorted(os.listdir(f"/proc/{pid}/task"), key=int):
        t = f"/proc/{pid}/task/{tid}"
        try:
            wchan = open(f"{t}/wchan").read()
            sc = open(f"{t}/syscall").read().split()
            comm = open(f"{t}/comm").read().strip()
            state = open(f"{t}/stat").read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        lock = ""
        if len(sc) > 1 and sc[0] == "202":
            i = bisect.bisect_right(daddrs, int(sc[1], 16) - base) - 1
            if i >= 0 and int(sc[1], 16) - base - daddrs[i] < 256:
                lock = f" futex in static {data[i][1]}"
        print(f"--- thread {tid} ({comm}) state {state} wchan {wchan} syscall {' '.join(sc[:3])}{lock}")
        if len(sc) < 9 or sc[0] == "running":
            continue
        sp = int(sc[-2], 16)
        raw = b""
        while len(raw) < words * 8:  # page by page: the stack ends somewhere above sp
            try:
                mem.seek(sp + len(raw))
                raw += mem.read(4096 - (sp + len(raw)) % 4096)
            except OSError:
                break
        last = None
        for (w,) in struct.iter_unpack("<Q", raw[: len(raw) // 8 * 8]):
            for lo, hi, off, path in exe:
                if lo <= w < hi:
                    if os.path.realpath(path) == real:
                        i = bisect.bisect_right(addrs, w - base) - 1
                        name = syms[i][1] if i >= 0 else "?"
                    else:
                        name = f"{os.path.basename(path)}+{w - lo + off:#x}"
                    if name != last:
                        print(f"    {name}")
                        last = name
                    break
    sys.stdout.flush()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--stall", type=float, default=15)
    ap.add_argument("--runs", type=int, default=6)
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    cmd = a.cmd[1:] if a.cmd and a.cmd[0] == "--" else a.cmd
    for run in range(a.runs):
        start = time.time()
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        last = [time.time()]
        passed = [0]

        def reader():
            for line in p.stdout:
                last[0] = time.time()
                if line.rstrip().endswith(" ok"):
                    passed[0] += 1
                if "FAILED" in line or "panicked" in line:
                    print(line, end="")

        th = threading.Thread(target=reader, daemon=True)
        th.start()
        while p.poll() is None and time.time() - last[0] < a.stall:
            time.sleep(0.5)
        if p.poll() is None:
            print(f"run {run}: STALLED after {passed[0]} passed ({time.time() - start:.0f} s); threads:")
            dump(p.pid, cmd[0])
            p.kill()
            return 3
        th.join(5)
        print(f"run {run}: exit {p.returncode}, {passed[0]} passed, {time.time() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
