#!/usr/bin/env python3
"""Boot Tidal's Linux guest fixture under plain QEMU (no hypervisor) and
balloon it: the baseline the hypervisor's balloon benchmark is compared with.

Steps: start QEMU (`-M virt`, virtio-balloon-device on virtio-mmio), wait for
`tidal-guest: ready`, run `cat /proc/meminfo | head -3` through the agent,
ask QEMU's monitor for `balloon <target>` (MiB of guest RAM to leave; 384 of
512 inflates 128 MiB), poll the guest's /proc/vmstat until `balloon_inflate`
has grown by the inflated page count, then `balloon <mem>` and poll
`balloon_deflate` likewise. Prints the timings; `--json FILE` writes them too.

Build the fixture first (xtask's `linux::build_initramfs`, which writes
target/fixtures/linux/Image and initramfs.cpio). See README.md.
"""

import argparse
import json
import os
import queue
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
FIXTURE = os.path.join(ROOT, "target", "fixtures", "linux")
CMDLINE = "console=ttyAMA0 earlycon=pl011,0x9000000 rdinit=/init quiet"
READY = "tidal-guest: ready"
DONE = re.compile(r"^tidal-guest: done (\d+) rc=(-?\d+)$")
PAGE = 4096


class Failure(Exception):
    pass


class Guest:
    """QEMU with the guest's console on stdio and HMP on a unix socket."""

    def __init__(self, args):
        self.args = args
        self.tmp = tempfile.mkdtemp(prefix="tidal-qemu-")
        self.mon_path = args.monitor or os.path.join(self.tmp, "monitor.sock")
        self.lines = queue.Queue()
        self.log = open(args.log, "w") if args.log else None
        self.next_id = 1
        cmd = [
            args.qemu, "-M", "virt", "-cpu", "cortex-a72",
            "-smp", str(args.smp), "-m", f"{args.mem}M",
            "-display", "none", "-serial", "stdio",
            "-kernel", args.kernel, "-initrd", args.initrd,
            "-append", args.append,
            "-device", "virtio-balloon-device,deflate-on-oom=on,free-page-reporting=on",
            "-monitor", f"unix:{self.mon_path},server,nowait",
        ] + args.qemu_arg
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        threading.Thread(target=self._read, daemon=True).start()
        self.mon = None

    def _read(self):
        buf = b""
        while True:
            chunk = self.proc.stdout.read1(4096)
            if not chunk:
                self.lines.put(None)
                return
            buf += chunk
            while b"\n" in buf:
                raw, buf = buf.split(b"\n", 1)
                line = raw.decode("utf-8", "replace").rstrip("\r")
                now = time.monotonic() - self.t0
                if self.log:
                    self.log.write(f"[{now:9.3f}] {line}\n")
                    self.log.flush()
                if self.args.verbose:
                    print(f"  guest| {line}", file=sys.stderr)
                self.lines.put((now, line))

    def wait_line(self, match, timeout):
        """Console lines until one satisfies `match`: (time, line, lines before)."""
        deadline = time.monotonic() + timeout
        seen = []
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise Failure(f"timed out after {timeout}s; last lines: {seen[-10:]}")
            try:
                item = self.lines.get(timeout=left)
            except queue.Empty:
                continue
            if item is None:
                raise Failure(f"QEMU exited ({self.proc.wait()}); last lines: {seen[-10:]}")
            when, line = item
            if match(line):
                return when, line, seen
            seen.append(line)

    def run(self, command, timeout=60):
        """Runs `command` through the agent: (rc, output lines)."""
        rid = self.next_id
        self.next_id += 1
        request = f"run {rid} {command}"
        self.proc.stdin.write((request + "\n").encode())
        self.proc.stdin.flush()
        _, line, seen = self.wait_line(
            lambda l: (m := DONE.match(l)) is not None and int(m.group(1)) == rid, timeout
        )
        # The tty echoes the request; everything after the echo is output.
        if request in seen:
            seen = seen[seen.index(request) + 1:]
        return int(DONE.match(line).group(2)), seen

    def monitor(self, command):
        if self.mon is None:
            deadline = time.monotonic() + 10
            while True:
                try:
                    self.mon = socket.socket(socket.AF_UNIX)
                    self.mon.connect(self.mon_path)
                    break
                except OSError:
                    self.mon.close()
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
            self._mon_read()
        self.mon.sendall((command + "\n").encode())
        out = self._mon_read()
        # Drop the echoed command line (HMP echoes with terminal escapes).
        return "\n".join(l for l in out.splitlines()[1:] if l.strip())

    def _mon_read(self):
        data = b""
        while not data.endswith(b"(qemu) "):
            chunk = self.mon.recv(4096)
            if not chunk:
                break
            data += chunk
        text = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", data.decode("utf-8", "replace"))
        return text.replace("\r", "").removesuffix("(qemu) ")

    def close(self):
        try:
            if self.proc.poll() is None and self.mon is not None:
                self.mon.sendall(b"quit\n")
                self.proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.log:
            self.log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def vmstat(guest):
    rc, out = guest.run("grep balloon /proc/vmstat")
    if rc != 0:
        raise Failure(f"grep balloon /proc/vmstat: rc={rc} {out}")
    counters = {}
    for line in out:
        parts = line.split()
        if len(parts) == 2 and parts[0].startswith("balloon_") and parts[1].isdigit():
            counters[parts[0]] = int(parts[1])
    for key in ("balloon_inflate", "balloon_deflate"):
        if key not in counters:
            raise Failure(f"no {key} in /proc/vmstat output {out}")
    return counters


def balloon_to(guest, target_mib, counter, pages, timeout):
    """Sets the balloon target and polls until `counter` grew by `pages`:
    (seconds until the guest counted every page, seconds until QEMU's
    `info balloon` showed the target, polls)."""
    before = vmstat(guest)[counter]
    t0 = time.monotonic()
    guest.monitor(f"balloon {target_mib}")
    qemu_done = None
    polls = 0
    while True:
        polls += 1
        now = vmstat(guest)[counter]
        if qemu_done is None and f"actual={target_mib}" in guest.monitor("info balloon"):
            qemu_done = time.monotonic() - t0
        if now - before >= pages:
            took = time.monotonic() - t0
            if qemu_done is None:
                qemu_done = took
            return took, qemu_done, polls
        if time.monotonic() - t0 > timeout:
            raise Failure(f"{counter} grew by {now - before} of {pages} in {timeout}s")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kernel", default=os.path.join(FIXTURE, "Image"))
    p.add_argument("--initrd", default=os.path.join(FIXTURE, "initramfs.cpio"))
    p.add_argument("--qemu", default="qemu-system-aarch64")
    p.add_argument("--append", default=CMDLINE, help="kernel command line")
    p.add_argument("--mem", type=int, default=512, help="guest RAM, MiB")
    p.add_argument("--target", type=int, default=384,
                   help="balloon target, MiB of RAM left to the guest")
    p.add_argument("--smp", type=int, default=2)
    p.add_argument("--monitor", help="monitor socket path (default: a temporary one)")
    p.add_argument("--timeout", type=float, default=120, help="seconds per step")
    p.add_argument("--log", help="write the guest console, timestamped, here")
    p.add_argument("--json", help="write the results as JSON here")
    p.add_argument("-v", "--verbose", action="store_true", help="echo the console")
    p.add_argument("qemu_arg", nargs="*", help="extra QEMU arguments (after --)")
    args = p.parse_args()
    for path in (args.kernel, args.initrd):
        if not os.path.isfile(path):
            sys.exit(f"{path} missing: build the Linux fixture first (guests/linux/README.md)")
    pages = (args.mem - args.target) * 1024 * 1024 // PAGE
    if pages <= 0:
        sys.exit("--target must be below --mem")

    guest = Guest(args)
    result = {"mem_mib": args.mem, "target_mib": args.target, "pages": pages}
    try:
        when, _, _ = guest.wait_line(lambda l: l == READY, args.timeout)
        result["ready_s"] = round(when, 3)
        print(f"ready: {when:.2f} s after QEMU started")

        rc, out = guest.run("cat /proc/meminfo | head -3")
        if rc != 0:
            raise Failure(f"meminfo: rc={rc} {out}")
        print("meminfo: " + "; ".join(" ".join(l.split()) for l in out))

        took, qemu, polls = balloon_to(guest, args.target, "balloon_inflate", pages, args.timeout)
        result.update(inflate_s=round(took, 3), inflate_qemu_s=round(qemu, 3), inflate_polls=polls)
        print(f"inflate {pages} pages ({args.mem - args.target} MiB): {took:.2f} s "
              f"(QEMU saw actual={args.target} after {qemu:.2f} s; {polls} vmstat polls)")

        rc, out = guest.run("cat /proc/meminfo | head -3")
        print("meminfo: " + "; ".join(" ".join(l.split()) for l in out))

        took, qemu, polls = balloon_to(guest, args.mem, "balloon_deflate", pages, args.timeout)
        result.update(deflate_s=round(took, 3), deflate_qemu_s=round(qemu, 3), deflate_polls=polls)
        print(f"deflate {pages} pages: {took:.2f} s "
              f"(QEMU saw actual={args.mem} after {qemu:.2f} s; {polls} vmstat polls)")
        result["vmstat"] = vmstat(guest)
        print("vmstat: " + ", ".join(f"{k} {v}" for k, v in result["vmstat"].items()))
        result["ok"] = True
    except Failure as e:
        result["ok"] = False
        result["error"] = str(e)
        print(f"FAILED: {e}", file=sys.stderr)
    finally:
        guest.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
