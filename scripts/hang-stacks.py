#!/usr/bin/env python3
"""Run a test binary; if it stops printing for STALL seconds, dump where every thread waits.

No gdb needed: for each thread it reads /proc/PID/task/TID/{wchan,syscall,stat}, then scans the
thread's stack (from its stack pointer upwards, /proc/PID/mem) for words that point into executable
mappings, and names those in the test binary with its symbol table (nm -C). A stack scan also shows
stale return addresses, so read each list from the top (innermost) and trust the frames that make a
plausible call chain. Addresses inside libcuda.so are printed as library+offset.

usage: scripts/hang-stacks.py [--stall 15] [--runs 6] [--crash] -- BINARY [libtest args...]
With --crash each run is traced (ptrace): a thread that takes a fatal signal (SIGSEGV, SIGBUS, ...) has its
instruction pointer and stack printed, named the same way, before the signal is delivered.
Exit status: 0 when every run finished, 3 when a run stalled or died of a signal (the dump is on stdout).
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


def name_of(w, exe, base, real, syms, addrs):
    for lo, hi, off, path in exe:
        if lo <= w < hi:
            if os.path.realpath(path) == real:
                i = bisect.bisect_right(addrs, w - base) - 1
                return syms[i][1] if i >= 0 else "?"
            return f"{os.path.basename(path)}+{w - lo + off:#x}"
    return None


def scan(mem, sp, exe, base, real, syms, addrs, words=8192):
    """Print the words of a stack from sp upwards that point into executable mappings, named."""
    raw = b""
    while len(raw) < words * 8:  # page by page: the stack ends somewhere above sp
        try:
            mem.seek(sp + len(raw))
            raw += mem.read(4096 - (sp + len(raw)) % 4096)
        except OSError:
            break
    last = None
    for (w,) in struct.iter_unpack("<Q", raw[: len(raw) // 8 * 8]):
        name = name_of(w, exe, base, real, syms, addrs)
        if name is not None and name != last:
            print(f"    {name}")
            last = name


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
        scan(mem, int(sc[-2], 16), exe, base, real, syms, addrs, words)
    sys.stdout.flush()


def traced_run(cmd, stall):
    """Run cmd under ptrace: on a fatal signal (SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT) print the
    faulting thread's instruction pointer and stack, named, then every thread's; on a stall, every
    thread's. Returns (exit status or None when stalled, tests passed)."""
    import ctypes
    import signal

    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    libc.ptrace.restype = ctypes.c_long
    TRACEME, CONT, GETREGS, SETOPTIONS = 0, 7, 12, 0x4200
    O_TRACECLONE, O_EXITKILL = 0x8, 0x100000
    WALL = 0x40000000
    fatal = {signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGABRT}

    def traceme():
        libc.ptrace(TRACEME, 0, None, None)

    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                         preexec_fn=traceme)
    last, passed = [time.time()], [0]

    def reader():
        for line in p.stdout:
            last[0] = time.time()
            if line.rstrip().endswith(" ok"):
                passed[0] += 1
            if "FAILED" in line or "panicked" in line:
                print(line, end="")

    threading.Thread(target=reader, daemon=True).start()
    _, st = os.waitpid(p.pid, WALL)  # the stop at exec
    libc.ptrace(SETOPTIONS, p.pid, None, ctypes.c_void_p(O_TRACECLONE | O_EXITKILL))
    libc.ptrace(CONT, p.pid, None, None)
    seen = {p.pid}
    real = os.path.realpath(cmd[0])
    while True:
        tid, st = os.waitpid(-1, WALL | os.WNOHANG)
        if tid == 0:
            if time.time() - last[0] > stall:
                print(f"STALLED after {passed[0]} passed; threads:")
                dump(p.pid, cmd[0])
                p.kill()
                p.wait()
                return None, passed[0]
            time.sleep(0.01)
            continue
        if os.WIFEXITED(st) or os.WIFSIGNALED(st):
            if tid == p.pid:
                code = os.WEXITSTATUS(st) if os.WIFEXITED(st) else -os.WTERMSIG(st)
                time.sleep(0.2)
                return code, passed[0]
            continue
        sig, event = os.WSTOPSIG(st), st >> 16
        deliver = 0
        if event or sig == signal.SIGTRAP:
            pass
        elif sig == signal.SIGSTOP and tid not in seen:
            seen.add(tid)  # a new thread's first stop
        elif sig in fatal:
            regs = (ctypes.c_ulong * 27)()
            libc.ptrace(GETREGS, tid, None, ctypes.byref(regs))
            rip, rsp = regs[16], regs[19]
            syms = symbols(cmd[0])
            addrs = [a for a, _ in syms]
            exe, base = maps(p.pid, real)
            comm = open(f"/proc/{p.pid}/task/{tid}/comm").read().strip()
            print(f"FATAL {signal.Signals(sig).name} in thread {tid} ({comm}) after {passed[0]} passed: "
                  f"rip {rip:#x} = {name_of(rip, exe, base, real, syms, addrs)}; its stack:")
            with open(f"/proc/{p.pid}/mem", "rb") as mem:
                scan(mem, rsp, exe, base, real, syms, addrs)
            print("every thread:")
            dump(p.pid, cmd[0])
            deliver = sig
        else:
            deliver = sig
        libc.ptrace(CONT, tid, None, ctypes.c_void_p(deliver))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--stall", type=float, default=15)
    ap.add_argument("--runs", type=int, default=6)
    ap.add_argument("--crash", action="store_true",
                    help="run under ptrace and print the stack of a thread that takes a fatal signal")
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    cmd = a.cmd[1:] if a.cmd and a.cmd[0] == "--" else a.cmd
    for run in range(a.runs):
        start = time.time()
        if a.crash:
            code, passed = traced_run(cmd, a.stall)
            print(f"run {run}: {'STALLED' if code is None else f'exit {code}'}, {passed} passed, "
                  f"{time.time() - start:.1f} s")
            sys.stdout.flush()
            if code is None or code < 0:
                return 3
            continue
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
