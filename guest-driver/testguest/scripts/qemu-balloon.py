#!/usr/bin/env python3
"""Boot the test guest under plain QEMU virt (EL1, no hypervisor) with QEMU's
own virtio-balloon, and move the balloon through the given sizes.

    qemu-balloon.py [--legacy|--modern] [--gic 2|3] [--ram MiB]
                    [--device-opts OPTS] [--image PATH] [--bootargs ARGS] SIZE_MIB...

Each SIZE is what QEMU's monitor command `balloon SIZE` takes: the memory the
guest should be left with, in MiB (so `balloon 128` on a 256 MiB guest inflates
128 MiB = 32768 pages). After each one the script waits for the guest's
`balloon target=...` line (or `balloon stalled`) and the pattern check.

With --gic N the machine is `virt,gic-version=N` and the guest must say that
it waits through interrupts of that GIC (`interrupts via GICvN`).

Exits 1 if the guest reports a mismatch, a non-zero deflated page, an
exception or a panic, or a step times out. The guest's console goes to stdout.
"""
import argparse
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
IMAGE = os.path.join(ROOT, "target", "aarch64-unknown-none", "release", "testguest.bin")
BAD = re.compile(r"MISMATCH|NOT ZERO|EXCEPTION|PANIC|balloon error")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("sizes", nargs="*", type=int)
    ap.add_argument("--ram", type=int, default=256)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--modern", action="store_true", help="virtio-mmio version 2 (force-legacy=false)")
    mode.add_argument("--legacy", action="store_true", help="virtio-mmio version 1 (QEMU's default)")
    ap.add_argument("--gic", type=int, choices=[2, 3], help="virt,gic-version=N; expect interrupts via GICvN")
    ap.add_argument("--device-opts", default="", help="e.g. deflate-on-oom=on,free-page-reporting=on")
    ap.add_argument("--image", default=IMAGE)
    ap.add_argument("--bootargs", default="pattern")
    ap.add_argument("--timeout", type=float, default=60)
    args = ap.parse_args()

    sock = os.path.join(tempfile.mkdtemp(), "mon.sock")
    device = "virtio-balloon-device" + ("," + args.device_opts if args.device_opts else "")
    machine = f"virt,gic-version={args.gic}" if args.gic else "virt"
    cmd = ["qemu-system-aarch64", "-M", machine, "-cpu", "cortex-a72", "-m", f"{args.ram}M",
           "-display", "none", "-nic", "none", "-serial", "stdio", "-kernel", args.image,
           "-device", device, "-append", args.bootargs,
           "-monitor", f"unix:{sock},server,nowait"]
    if args.modern:
        cmd[1:1] = ["-global", "virtio-mmio.force-legacy=false"]
    print("+ " + " ".join(cmd), flush=True)
    qemu = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    cond = threading.Condition()

    def reader():
        for line in qemu.stdout:
            line = line.rstrip("\r\n")
            print(line, flush=True)
            with cond:
                lines.append(line)
                cond.notify_all()
        with cond:
            lines.append(None)
            cond.notify_all()

    threading.Thread(target=reader, daemon=True).start()

    def wait_for(pattern, start):
        """Index of the first line at or after `start` matching `pattern`."""
        deadline = time.time() + args.timeout
        rx = re.compile(pattern)
        i = start
        with cond:
            while True:
                while i < len(lines):
                    if lines[i] is None:
                        raise SystemExit("QEMU exited")
                    if BAD.search(lines[i]):
                        raise SystemExit(f"guest reported a failure: {lines[i]}")
                    if rx.search(lines[i]):
                        return i
                    i += 1
                if time.time() > deadline:
                    raise SystemExit(f"timed out waiting for /{pattern}/")
                cond.wait(1)

    def monitor(command):
        s = socket.socket(socket.AF_UNIX)
        s.connect(sock)
        s.settimeout(2)
        time.sleep(0.2)
        try:
            s.recv(4096)
        except socket.timeout:
            pass
        s.sendall((command + "\n").encode())
        time.sleep(0.3)
        s.close()
        print(f"[monitor] {command}", flush=True)

    status = 0
    try:
        if args.gic:
            wait_for(rf"testguest: interrupts via GICv{args.gic} ", 0)
        at = wait_for(r"testguest: (balloon at|no usable balloon|hostile: done)", 0)
        for size in args.sizes:
            monitor(f"balloon {size}")
            at = wait_for(r"testguest: (balloon target=|balloon stalled)", at + 1)
            if "stalled" not in lines[at]:
                at = wait_for(r"testguest: pattern ok", at + 1)
                expect_zero = at + 1
                # A deflate is followed by the zero check.
                time.sleep(0.5)
                with cond:
                    tail = lines[expect_zero:expect_zero + 1]
                if tail and tail[0] and "deflated" in tail[0]:
                    at = expect_zero
        time.sleep(1)
        with cond:
            rest = [l for l in lines[at:] if l]
        if any(BAD.search(l) for l in rest):
            raise SystemExit("guest reported a failure")
        print("qemu-balloon: all steps passed", flush=True)
    except SystemExit as e:
        print(f"qemu-balloon: FAILED: {e}", flush=True)
        status = 1
    finally:
        if qemu.poll() is None:
            try:
                monitor("quit")
            except OSError:
                qemu.kill()
        qemu.wait(timeout=10)
    sys.exit(status)


if __name__ == "__main__":
    main()
