"""Round trips between two tasks on one CPU over pipes: two processes (every switch changes the address space) and
two threads of one process (none does); µs per round trip (two switches)."""
import os, sys, threading, time
N = int(sys.argv[1]) if len(sys.argv) > 1 else 20000
os.sched_setaffinity(0, {0})

def echo(rfd, wfd, n):
    for _ in range(n):
        os.write(wfd, os.read(rfd, 1))

def run(kind):
    a_r, a_w = os.pipe(); b_r, b_w = os.pipe()
    if kind == "processes":
        pid = os.fork()
        if pid == 0:
            echo(a_r, b_w, N); os._exit(0)
    else:
        t = threading.Thread(target=echo, args=(a_r, b_w, N)); t.start()
    start = time.perf_counter()
    for _ in range(N):
        os.write(a_w, b"x"); os.read(b_r, 1)
    took = time.perf_counter() - start
    if kind == "processes":
        os.waitpid(pid, 0)
    else:
        t.join()
    for fd in (a_r, a_w, b_r, b_w):
        os.close(fd)
    print(f"{kind}: {took / N * 1e6:.1f} µs per round trip ({N} round trips, CPU 0)", flush=True)

for _ in range(2):
    run("processes"); run("threads")
