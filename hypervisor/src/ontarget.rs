//! The on-target self-checks on the boot CPU (target only; bundle flag
//! `ON_TARGET_TESTS`). Once every VM has been started, `boot.rs` calls
//! [`run`] before the shell's prompt: each check reads the VM table, the
//! frame table and the CPUs' states (never holding a VM's lock while it
//! waits), feeds what it saw to `selftest` (the portable decisions, with
//! each check's deadline) and prints one `ON-TARGET:` line; the last line
//! is `ON-TARGET: N passed, M failed`. Waits sleep ~10 ms at a time and
//! run the memory manager's tick as the shell's idle loop does.

extern crate alloc;

use alloc::string::String;
use core::fmt::Write;

use guest_bundle::Bundle;
use platform::{BoardInfo, MAX_CPUS};

use crate::arch::aarch64::{self, smp};
use crate::mm::frames::PAGE_SIZE;
use crate::run::{self as vm, Vm, VmState};
use crate::selftest::{
    self, deadline, BalloonObs, LinuxStart, Role, RoundTrip, Step, Tally, Verdict,
};
use crate::virtio::mmio::STATUS_DRIVER_OK;
use crate::vm::fault::OnBadAccess;
use crate::{print, println};

/// Runs every check and prints the results; returns when the last line is out.
pub fn run(board: &BoardInfo, bundle: &Bundle<'static>) {
    let ram: u64 = board.ram.iter().map(|r| r.size()).sum();
    let mut on_shell_cpu = None;
    vm::for_each(|vm| {
        if vm.vcpus().cpus().contains(&vm::SHELL_CPU) {
            on_shell_cpu.get_or_insert(vm.name().clone());
        }
    });
    if let Some(name) = on_shell_cpu {
        // They run on the shell's CPU and wait for guests: a vCPU there
        // would not run until they end.
        return println!(
            "{} on-target checks not run: VM {name} is pinned to CPU {}, which runs them; pin it elsewhere",
            selftest::PREFIX,
            vm::SHELL_CPU
        );
    }
    println!(
        "{} on-target checks start ({} of them; each has a deadline)",
        selftest::PREFIX,
        selftest::CHECKS.len()
    );
    let mut tally = Tally::default();
    let mut say = |name: &str, verdict: Verdict| {
        let mut line = String::new();
        let _ = tally.record(&mut line, name, &verdict);
        print!("{line}");
    };

    say("cpus", Verdict::from_result(cpus(board)));
    say("memory", Verdict::from_result(memory(ram)));
    say("isolation", isolation(ram));
    say(
        "balloon",
        match find(Role::Pattern) {
            None => Verdict::Skipped(
                "no test guest in pattern mode with a balloon in the bundle".into(),
            ),
            Some(name) => Verdict::from_result(round_trip(
                &name,
                selftest::BALLOON_PAGES,
                deadline::BALLOON_US,
                deadline::BALLOON_US,
            )),
        },
    );

    let guaranteed: u64 = bundle.vms().map(|v| v.guaranteed()).sum();
    let linux = find(Role::Linux);
    let start = match &linux {
        None => LinuxStart::Skip("no Linux VM with a balloon in the bundle".into()),
        Some(name) => {
            let started = vm::with_vm(name, |vm| vm.starts() > 0).unwrap_or(false);
            selftest::linux_start(started, ram, guaranteed)
        }
    };
    match (&linux, start) {
        (Some(name), LinuxStart::Run) => linux_checks(name, &mut say),
        (_, start) => {
            let (failed, why) = match start {
                LinuxStart::Fail(why) => (true, why),
                LinuxStart::Skip(why) => (false, why),
                LinuxStart::Run => (false, String::from("no Linux VM in the bundle")),
            };
            for name in ["linux-balloon", "linux-reporting", "linux-hint"] {
                say(
                    name,
                    if failed {
                        Verdict::Failed(why.clone())
                    } else {
                        Verdict::Skipped(why.clone())
                    },
                );
            }
        }
    }
    say("final-check", Verdict::from_result(memory(ram)));

    let mut line = String::new();
    let _ = tally.write_summary(&mut line);
    print!("{line}");
}

/// `linux-balloon`, `linux-reporting` and `linux-hint` with the running
/// Linux VM `name`.
fn linux_checks(name: &str, say: &mut impl FnMut(&str, Verdict)) {
    // The device counts from the VM's start (a driver reset keeps the
    // counters): Linux reports its free memory about 2 s after its driver
    // registers, which may be before this check looks, and again as
    // memory is freed (the round trip's deflate frees 64 MiB).
    let reported = |vm: &mut Vm| {
        vm.balloon()
            .as_ref()
            .map_or(0, |b| b.device().stats().pages_reported)
    };
    let before = 0;
    say(
        "linux-balloon",
        Verdict::from_result(round_trip(
            name,
            selftest::LINUX_BALLOON_PAGES,
            deadline::LINUX_DRIVER_US,
            deadline::LINUX_BALLOON_US,
        )),
    );
    say(
        "linux-reporting",
        if offers(name, FEATURE_REPORTING) {
            let until = aarch64::uptime_us() + deadline::REPORTING_US;
            loop {
                let now = vm::with_vm(name, reported).unwrap_or(0);
                if let Some(ok) = selftest::reporting(before, now) {
                    break Verdict::Passed(ok);
                }
                if aarch64::uptime_us() >= until {
                    break Verdict::Failed(alloc::format!(
                        "no free page report within {} s ({now} pages reported)",
                        deadline::REPORTING_US / 1_000_000
                    ));
                }
                pause();
            }
        } else {
            Verdict::Skipped(alloc::format!("{name} does not offer free-page-reporting"))
        },
    );
    say(
        "linux-hint",
        if offers(name, FEATURE_HINT) {
            Verdict::from_result(hint(name))
        } else {
            Verdict::Skipped(alloc::format!("{name} does not offer free-page-hint"))
        },
    );
}

const FEATURE_HINT: u64 = crate::balloon::F_FREE_PAGE_HINT;
const FEATURE_REPORTING: u64 = crate::balloon::F_PAGE_REPORTING;

/// Sleep about 10 ms, running the memory manager's tick.
fn pause() {
    aarch64::idle_wait(10_000);
    vm::memory_tick();
}

/// The first VM playing `role`.
fn find(role: Role) -> Option<heapless::String<32>> {
    let mut found = None;
    vm::for_each(|vm| {
        let r = selftest::role(
            vm.spec().cmdline(),
            vm.spec().has_balloon(),
            vm.on_bad_access() == OnBadAccess::Abort,
        );
        if found.is_none() && r == role {
            found = Some(vm.name().clone());
        }
    });
    found
}

/// Whether VM `name`'s balloon offers every bit of `feature`.
fn offers(name: &str, feature: u64) -> bool {
    vm::with_vm(name, |vm| vm.spec().balloon_features() & feature == feature).unwrap_or(false)
}

fn cpus(board: &BoardInfo) -> Result<String, String> {
    let listed: heapless::Vec<(u64, Option<bool>), MAX_CPUS> = board
        .cpus
        .iter()
        .map(|c| {
            let index = (0..MAX_CPUS).find(|&i| smp::cpu_mpidr(i) == Some(c.mpidr));
            (
                c.mpidr,
                index.map(|i| smp::state(i) == smp::CpuState::Online),
            )
        })
        .collect();
    selftest::cpus(&listed)
}

/// What `check` prints now.
fn check_text(ram: u64) -> String {
    let mut text = String::new();
    vm::check_system(ram, &mut text);
    text
}

fn memory(ram: u64) -> Result<String, String> {
    let accounted = vm::frames().accounting().total();
    selftest::memory(accounted, ram, &check_text(ram))
}

fn isolation(ram: u64) -> Verdict {
    let Some(name) = find(Role::Wild) else {
        return Verdict::Skipped("no test guest in wild mode (policy abort) in the bundle".into());
    };
    let observe = |vm: &mut Vm| {
        (
            selftest::WildObs {
                running: vm.state() == VmState::Running,
                injected: vm.bad_access().injected,
                mapped: vm.ram().map_or(0, |r| r.mapped_pages()),
                ram_pages: vm.ram_size() / PAGE_SIZE,
            },
            vm.spec().has_balloon(),
        )
    };
    let until = aarch64::uptime_us() + deadline::ISOLATION_US;
    let (mut obs, balloon) = match vm::with_vm(&name, observe) {
        Some(o) => o,
        None => return Verdict::Failed(alloc::format!("{name} is gone")),
    };
    let expected = selftest::wild_accesses(balloon);
    while !selftest::wild_settled(&obs, expected) && aarch64::uptime_us() < until {
        pause();
        obs = vm::with_vm(&name, observe).map_or(obs, |o| o.0);
    }
    // Every other VM that was started must still run.
    let mut down = String::new();
    vm::for_each(|vm| {
        if vm.name().as_str() != name && vm.starts() > 0 && vm.state() != VmState::Running {
            let _ = write!(
                down,
                "{}{} ({})",
                if down.is_empty() { "" } else { ", " },
                vm.name(),
                vm.state().label()
            );
        }
    });
    Verdict::from_result(selftest::isolation(
        &name,
        &obs,
        expected,
        &down,
        &check_text(ram),
    ))
}

/// A balloon round trip with VM `name` (see `selftest::RoundTrip`). The
/// memory manager leaves the balloon alone meanwhile, as after the shell's
/// `balloon`; it gets it back after.
fn round_trip(name: &str, pages: u32, driver_us: u64, balloon_us: u64) -> Result<String, String> {
    let observe = |vm: &mut Vm| BalloonObs {
        running: vm.state() == VmState::Running,
        driver: vm
            .balloon()
            .is_some_and(|b| b.status() & STATUS_DRIVER_OK != 0 && !b.needs_reset()),
        actual: vm.balloon().map_or(0, |b| b.device().actual()),
    };
    let was_manual = vm::with_vm(name, |vm| vm.set_manual(true))
        .ok_or_else(|| alloc::format!("{name} is gone"))?;
    let mut rt = RoundTrip::new(pages, aarch64::uptime_us(), driver_us, balloon_us);
    let result = loop {
        let Some(obs) = vm::with_vm(name, observe) else {
            break Err(alloc::format!("{name} is gone"));
        };
        match rt.step(&obs, aarch64::uptime_us()) {
            Step::Wait => pause(),
            Step::Set(p) => match vm::with_vm(name, |vm| vm::set_balloon(vm, u64::from(p))) {
                Some(Ok(())) => {}
                Some(Err(e)) => {
                    break Err(alloc::format!("cannot set the target to {p} pages: {e}"))
                }
                None => break Err(alloc::format!("{name} is gone")),
            },
            Step::Done(r) => break r,
        }
    };
    vm::with_vm(name, |vm| {
        vm.set_manual(was_manual);
    });
    result.map(|s| alloc::format!("{name}: {s}"))
}

/// A free page hinting run in VM `name`, to its end.
fn hint(name: &str) -> Result<String, String> {
    let id = match vm::with_vm(name, vm::start_hint) {
        None => return Err(alloc::format!("{name} is gone")),
        Some(Err(e)) => return Err(alloc::format!("cannot start a hinting run: {e}")),
        Some(Ok(id)) => id,
    };
    let until = aarch64::uptime_us() + deadline::HINT_US;
    loop {
        let seen = vm::with_vm(name, |vm| {
            let run = vm.balloon().and_then(|b| b.device().hint_run().copied());
            (
                vm.state() == VmState::Running,
                selftest::hint(id, run.as_ref()),
            )
        });
        match seen {
            None => return Err(alloc::format!("{name} is gone")),
            Some((_, Some(r))) => return r.map(|s| alloc::format!("{name}: {s}")),
            Some((false, None)) => {
                return Err(alloc::format!("{name} stopped during hinting run {id}"))
            }
            Some((true, None)) if aarch64::uptime_us() >= until => {
                return Err(alloc::format!(
                    "hinting run {id} did not end within {} s",
                    deadline::HINT_US / 1_000_000
                ))
            }
            Some((true, None)) => pause(),
        }
    }
}
