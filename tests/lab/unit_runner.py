"""`systemctl` for the lab guest, whose PID 1 is a shell script, not systemd: it runs an installed unit's
ExecStart the way systemd runs a Type=notify service, for tests that run the documentation's commands as written.

    unit_runner.py daemon-reload
    unit_runner.py enable --now UNIT | start UNIT      # returns once the service sent READY=1
    unit_runner.py stop UNIT                           # SIGTERM, then its exit status
    unit_runner.py is-active UNIT

What it takes from the unit (/etc/systemd/system/UNIT's template and its drop-ins, %i filled in): ExecStart
(the last one), RuntimeDirectory and its mode, StateDirectory, UMask; what it does as systemd would: a clean
environment with NOTIFY_SOCKET, LimitMEMLOCK=infinity, an empty capability bounding set and no_new_privs
(CapabilityBoundingSet=, NoNewPrivileges=yes), as tests/lab/test_systemd_workers.py does.  Not emulated: the
mount and device sandbox (systemd-analyze security --offline rates the unit itself: tests/unit/test_systemd_units.py).
A small keeper process stays the service's parent, so `stop` gets its exit status.
"""
import glob
import os
import shlex
import signal
import socket
import subprocess
import sys
import time

UNIT_DIR = os.environ.get("UNIT_RUNNER_UNIT_DIR", "/etc/systemd/system")
STATE = os.environ.get("UNIT_RUNNER_STATE", "/run/unit-runner")
READY_TIMEOUT = 180.0


def unit_settings(unit: str) -> dict:
    name = unit if unit.endswith(".service") else unit + ".service"
    prefix, _, rest = name.partition("@")
    instance = rest[:-len(".service")]
    files = [os.path.join(UNIT_DIR, f"{prefix}@.service" if instance else name)]
    files += sorted(glob.glob(os.path.join(UNIT_DIR, f"{name}.d", "*.conf")))
    settings: dict = {}
    for path in files:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if not line or line.startswith(("#", ";", "[")) or "=" not in line:
                    continue
                key, value = line.split("=", 1)
                settings[key] = value.replace("%i", instance).replace("%I", instance)
    if not settings.get("ExecStart"):
        sys.exit(f"{unit}: no ExecStart in {files}")
    return settings


def paths(unit: str) -> dict:
    base = os.path.join(STATE, unit)
    return {"notify": base + ".notify", "pid": base + ".pid", "status": base + ".status", "log": base + ".log"}


def start(unit: str) -> int:
    s = unit_settings(unit)
    os.makedirs(STATE, exist_ok=True)
    p = paths(unit)
    if s.get("RuntimeDirectory"):
        os.makedirs(os.path.join("/run", s["RuntimeDirectory"]), mode=int(s.get("RuntimeDirectoryMode", "0755"), 8),
                    exist_ok=True)
    if s.get("StateDirectory"):
        os.makedirs(os.path.join("/var/lib", s["StateDirectory"]), mode=0o755, exist_ok=True)
    for key in ("notify", "status"):
        if os.path.exists(p[key]):
            os.unlink(p[key])
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(p["notify"])
    keeper = subprocess.Popen([sys.executable, os.path.abspath(__file__), "_keep", unit], start_new_session=True,
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + READY_TIMEOUT
    while time.monotonic() < deadline:
        if os.path.exists(p["status"]) or keeper.poll() is not None:
            break
        sock.settimeout(0.5)
        try:
            msg = sock.recv(4096).decode()
        except socket.timeout:
            continue
        if "READY=1" in msg.split("\n"):
            print(f"{unit}: started (READY=1)")
            return 0
    with open(p["log"]) as f:
        sys.stderr.write(f.read()[-4000:])
    print(f"{unit}: failed to start", file=sys.stderr)
    return 1


def keep(unit: str) -> None:
    """The service's parent: run ExecStart, record its pid, then its exit status."""
    s = unit_settings(unit)
    p = paths(unit)
    argv = ["prlimit", "--memlock=unlimited", "--", "setpriv", "--bounding-set", "-all", "--inh-caps", "-all",
            "--no-new-privs", "--"] + shlex.split(s["ExecStart"].lstrip("-@+!"))
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8",
           "NOTIFY_SOCKET": p["notify"]}
    umask = int(s.get("UMask", "0022"), 8)
    with open(p["log"], "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                preexec_fn=lambda: os.umask(umask))
        with open(p["pid"], "w") as f:
            f.write(str(proc.pid))
        code = proc.wait()
    with open(p["status"], "w") as f:
        f.write(str(code))


def stop(unit: str) -> int:
    p = paths(unit)
    try:
        with open(p["pid"]) as f:
            pid = int(f.read())
    except FileNotFoundError:
        print(f"{unit}: not running")
        return 0
    if not os.path.exists(p["status"]):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 60
    while not os.path.exists(p["status"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    if not os.path.exists(p["status"]):
        os.kill(pid, signal.SIGKILL)
        print(f"{unit}: did not stop in 60 s after SIGTERM: killed", file=sys.stderr)
        return 1
    with open(p["status"]) as f:
        code = int(f.read())
    os.unlink(p["pid"])
    print(f"{unit}: stopped, exit status {code}")
    return 0 if code == 0 else 1


def main(argv) -> int:
    args = [a for a in argv if a != "--now"]
    if not args:
        return 2
    verb, units = args[0], args[1:]
    if verb == "daemon-reload":
        return 0
    if verb == "_keep":
        keep(units[0])
        return 0
    if verb in ("enable", "start", "restart"):
        if verb == "restart":
            stop(units[0])
        return start(units[0])
    if verb == "stop":
        return stop(units[0])
    if verb == "is-active":
        return 0 if os.path.exists(paths(units[0])["pid"]) and not os.path.exists(paths(units[0])["status"]) else 3
    print(f"unit_runner: {verb} is not emulated", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
