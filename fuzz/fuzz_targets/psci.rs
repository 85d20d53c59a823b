//! PSCI for guests (`vm/psci.rs`): any sequence of calls (function IDs
//! from the offered set, their 32-bit twins, or any 32 or 64 bits; any
//! arguments) from any vCPU of a VM of 1 to `MAX_VCPUS` vCPUs in any power
//! state. Invariants, checked against a model of the specification:
//! SYSTEM_OFF, SYSTEM_RESET and CPU_OFF only for their exact IDs (their
//! 64-bit-looking forms are answered NOT_SUPPORTED), everything else is
//! answered in x0 with a PSCI 1.0 value (VERSION 1.0, FEATURES 0 only for
//! an offered function, MIGRATE_INFO_TYPE 2, AFFINITY_INFO the target's
//! state); CPU_ON succeeds only for an existing other vCPU that is off, and
//! then makes it Starting with the entry and context given and hands it to
//! its CPU, once; no other power state changes; x1-x30 and the PC are
//! never touched; the target of an MPIDR is the vCPU whose Aff0 (with
//! Aff1-3 zero) it names.
#![no_main]

use std::sync::{Mutex, OnceLock};

use arbitrary::Arbitrary;
use guest_bundle::{BundleBuilder, VmSpec};
use hypervisor::limits::MAX_VCPUS;
use hypervisor::vm::cpu::GuestContext;
use hypervisor::vm::psci::{self, PsciOutcome, ALREADY_ON, INVALID_PARAMETERS, NOT_SUPPORTED};
use hypervisor::vm::state::{GuestGic, Power, Vm};
use hypervisor::vm::testing::{self, FakeCpu, FakeHost};
use libfuzzer_sys::fuzz_target;

const VERSION: u32 = 0x8400_0000;
const CPU_OFF: u32 = 0x8400_0002;
const CPU_ON_32: u32 = 0x8400_0003;
const CPU_ON_64: u32 = 0xc400_0003;
const AFFINITY_INFO_32: u32 = 0x8400_0004;
const AFFINITY_INFO_64: u32 = 0xc400_0004;
const MIGRATE_INFO_TYPE: u32 = 0x8400_0006;
const SYSTEM_OFF: u32 = 0x8400_0008;
const SYSTEM_RESET: u32 = 0x8400_0009;
const FEATURES: u32 = 0x8400_000a;

/// What FEATURES reports as present (either calling convention where
/// the function has only one).
const OFFERED: [u32; 8] = [
    VERSION,
    CPU_OFF,
    SYSTEM_OFF,
    SYSTEM_RESET,
    FEATURES,
    CPU_ON_64,
    AFFINITY_INFO_64,
    MIGRATE_INFO_TYPE,
];

#[derive(Arbitrary, Debug, Clone, Copy)]
enum State {
    Off,
    Starting(u64, u64),
    On,
}

#[derive(Arbitrary, Debug)]
struct Call {
    vcpu: u8,
    /// An ID from the table below, or `raw`.
    function: u8,
    raw: u64,
    /// 64-bit form (bit 30) of a table entry.
    smc64: bool,
    args: [u64; 3],
    /// A target MPIDR for x1 built from a vCPU index, or the raw x1.
    mpidr_of: Option<u8>,
}

#[derive(Arbitrary, Debug)]
struct Input {
    vcpus: u8,
    power: [State; MAX_VCPUS],
    calls: Vec<Call>,
}

const IDS: [u32; 12] = [
    VERSION,
    CPU_OFF,
    CPU_ON_32,
    CPU_ON_64,
    AFFINITY_INFO_32,
    AFFINITY_INFO_64,
    MIGRATE_INFO_TYPE,
    SYSTEM_OFF,
    SYSTEM_RESET,
    FEATURES,
    0x8400_0001, // CPU_SUSPEND: not offered
    0x8400_000c, // SYSTEM_SUSPEND: not offered
];

fn spec() -> guest_bundle::VmEntry<'static> {
    let bytes = BundleBuilder::new()
        .add_vm(VmSpec {
            name: "guest".into(),
            ram_size: 1 << 20,
            vcpus: 1,
            cpu_affinity: 0b10,
            kernel: vec![1; 64],
            initrd: None,
            cmdline: None,
            balloon_features: 0,
            devices: 0,
            on_bad_access: 0,
            restore: None,
        })
        .expect("valid VM")
        .build();
    hypervisor::vm::testing::first_vm(bytes)
}

static SPEC: OnceLock<guest_bundle::VmEntry<'static>> = OnceLock::new();
/// One host for every run (a new one leaks its frame table's storage).
static HOST: Mutex<Option<FakeHost>> = Mutex::new(None);

fn target(mpidr: u64, vcpus: usize) -> Option<usize> {
    // Aff0 names the vCPU; Aff1-3 must be zero; bits 24-31 are not affinity.
    let v = mpidr & 0xff_00ff_ffff;
    (v < vcpus as u64).then_some(v as usize)
}

fuzz_target!(|input: Input| {
    let spec = *SPEC.get_or_init(spec);
    let mut guard = HOST.lock().unwrap_or_else(|e| e.into_inner());
    let host = guard.take().unwrap_or_else(|| FakeHost::new(16));
    let mut cpu = FakeCpu::with_host(host);
    let mut vm = Vm::new(0, spec, GuestGic::V3);
    let vcpus = usize::from(input.vcpus) % MAX_VCPUS + 1;
    // vCPU v on CPU v + 1.
    let power: Vec<Power> = input.power[..vcpus]
        .iter()
        .map(|p| match *p {
            State::Off => Power::Off,
            State::Starting(entry, context) => Power::Starting { entry, context },
            State::On => Power::On,
        })
        .collect();
    testing::set_vcpus(&mut vm, ((1 << vcpus) - 1) << 1, &power);
    for call in input.calls.iter().take(64) {
        let vcpu = usize::from(call.vcpu) % vcpus;
        let function = match IDS.get(usize::from(call.function)) {
            Some(&f) if call.smc64 => u64::from(f | 0x4000_0000),
            Some(&f) => u64::from(f),
            None => call.raw,
        };
        let mut ctx = GuestContext::new(0x4008_0000, function);
        for (i, x) in ctx.x.iter_mut().enumerate().skip(1) {
            *x = call.args[i % 3].rotate_left(i as u32);
        }
        if let Some(v) = call.mpidr_of {
            ctx.x[1] = u64::from(v % 8);
        }
        let before_x = ctx.x;
        let before_pc = (ctx.elr, ctx.spsr);
        let power: Vec<Power> = (0..vcpus).map(|v| vm.vcpus().power(v)).collect();
        let handed = cpu.handed.len();
        let outcome = psci::call(&mut vm, &mut cpu, vcpu, &mut ctx);

        assert_eq!(ctx.x[1..], before_x[1..], "x1-x30 untouched");
        assert_eq!((ctx.elr, ctx.spsr), before_pc, "PC untouched");
        // The SMC32/HVC32 convention: the ID is w0.
        let id = function as u32;
        let fast = id & 0xff00_0000;
        let expect_outcome = match id {
            SYSTEM_OFF => PsciOutcome::SystemOff,
            SYSTEM_RESET => PsciOutcome::SystemReset,
            CPU_OFF => PsciOutcome::CpuOff,
            _ => PsciOutcome::Answered,
        };
        assert_eq!(outcome, expect_outcome, "function {function:#x}");
        if outcome != PsciOutcome::Answered {
            assert_eq!(ctx.x[0], function, "x0 left for the caller");
            let now: Vec<Power> = (0..vcpus).map(|v| vm.vcpus().power(v)).collect();
            assert_eq!(now, power);
            assert_eq!(cpu.handed.len(), handed);
            continue;
        }
        let x0 = ctx.x[0];
        let (x1, x2, x3) = (before_x[1], before_x[2], before_x[3]);
        let as64 = if fast == 0x8400_0000 {
            id | 0x4000_0000
        } else {
            id
        };
        let mut started = None;
        let expected = match id {
            VERSION => 0x1_0000,
            FEATURES => {
                let f = x1 as u32 | 0x4000_0000;
                if OFFERED.iter().any(|&o| o | 0x4000_0000 == f) {
                    0
                } else {
                    NOT_SUPPORTED
                }
            }
            MIGRATE_INFO_TYPE => 2,
            _ if as64 == CPU_ON_64 => match target(x1, vcpus) {
                None => INVALID_PARAMETERS,
                Some(t) if power[t] != Power::Off || t == vcpu => ALREADY_ON,
                Some(t) => {
                    started = Some(t);
                    0
                }
            },
            _ if as64 == AFFINITY_INFO_64 => match target(x1, vcpus) {
                None => INVALID_PARAMETERS,
                Some(t) => match power[t] {
                    Power::On => 0,
                    Power::Off => 1,
                    Power::Starting { .. } => 2,
                },
            },
            _ => NOT_SUPPORTED,
        };
        assert_eq!(x0, expected, "function {function:#x} x1 {x1:#x}");
        for (v, was) in power.iter().enumerate() {
            let now = &vm.vcpus().power(v);
            if Some(v) == started {
                let starting = Power::Starting {
                    entry: x2,
                    context: x3,
                };
                assert_eq!(*now, starting);
            } else {
                assert_eq!(now, was, "vCPU {v}'s power changed");
            }
        }
        match started {
            Some(t) => assert_eq!(cpu.handed[handed..], [(t + 1, 0, t)], "handed once"),
            None => assert_eq!(cpu.handed.len(), handed, "handed without CPU_ON"),
        }
    }
    *guard = Some(cpu.host);
});
