//! PSCI for guests: the calls a guest makes by HVC or SMC (function IDs and
//! return codes from the smccc crate, as the hypervisor's own calls to its
//! firmware in `arch::aarch64::psci`), answered from the VM's vCPU power
//! states.

use super::cpu::{GuestContext, PhysCpu};
use super::state::{Power, Vm};

use smccc::psci::{
    PSCI_AFFINITY_INFO_64 as AFFINITY_INFO_64, PSCI_CPU_OFF as CPU_OFF,
    PSCI_CPU_ON_64 as CPU_ON_64, PSCI_FEATURES, PSCI_MIGRATE_INFO_TYPE as MIGRATE_INFO_TYPE,
    PSCI_SYSTEM_OFF as SYSTEM_OFF, PSCI_SYSTEM_RESET as SYSTEM_RESET, PSCI_VERSION,
};

/// The bit that tells an SMC64 function ID from its SMC32 twin.
const SMC64: u32 = 0x4000_0000;

/// PSCI return codes, as x0 holds them.
pub const NOT_SUPPORTED: u64 = smccc::psci::error::NOT_SUPPORTED as i64 as u64;
pub const INVALID_PARAMETERS: u64 = smccc::psci::error::INVALID_PARAMETERS as i64 as u64;
pub const ALREADY_ON: u64 = smccc::psci::error::ALREADY_ON as i64 as u64;

/// What a PSCI call asks of the vCPU loop besides its return value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PsciOutcome {
    /// Answered in x0; the guest goes on.
    Answered,
    /// SYSTEM_OFF.
    SystemOff,
    /// SYSTEM_RESET.
    SystemReset,
    /// CPU_OFF: this vCPU turns itself off.
    CpuOff,
}

/// Answer the PSCI call in `ctx` (function ID in x0, arguments in x1-x3).
pub fn call(
    vm: &mut Vm,
    cpu: &mut impl PhysCpu,
    vcpu: usize,
    ctx: &mut GuestContext,
) -> PsciOutcome {
    let function = ctx.x[0] as u32;
    // The 32-bit calling convention's IDs differ only in bit 30.
    let function64 = if function & 0xff00_0000 == 0x8400_0000 {
        function | SMC64
    } else {
        function
    };
    let vcpus = vm.vcpus.count();
    let target = |mpidr: u64| {
        let v = (mpidr & 0xff_00ff_ffff) as usize;
        (v < vcpus).then_some(v)
    };
    let result = match function64 {
        _ if function == PSCI_VERSION => 0x1_0000, // 1.0
        _ if function == PSCI_FEATURES => match ctx.x[1] as u32 | SMC64 {
            f if [
                PSCI_VERSION | SMC64,
                CPU_OFF | SMC64,
                SYSTEM_OFF | SMC64,
                SYSTEM_RESET | SMC64,
                PSCI_FEATURES | SMC64,
                CPU_ON_64,
                AFFINITY_INFO_64,
                MIGRATE_INFO_TYPE | SMC64,
            ]
            .contains(&f) =>
            {
                0
            }
            _ => NOT_SUPPORTED,
        },
        _ if function == SYSTEM_OFF => return PsciOutcome::SystemOff,
        _ if function == SYSTEM_RESET => return PsciOutcome::SystemReset,
        _ if function == CPU_OFF => return PsciOutcome::CpuOff,
        _ if function == MIGRATE_INFO_TYPE => 2, // no trusted OS to migrate
        CPU_ON_64 => match target(ctx.x[1]) {
            None => INVALID_PARAMETERS,
            Some(t) if vm.vcpus.power(t) != Power::Off || t == vcpu => ALREADY_ON,
            Some(t) => {
                vm.vcpus.set_power(
                    t,
                    Power::Starting {
                        entry: ctx.x[2],
                        context: ctx.x[3],
                    },
                );
                cpu.hand_vcpu(vm.vcpus.cpu(t), vm.id, t);
                0
            }
        },
        AFFINITY_INFO_64 => match target(ctx.x[1]) {
            None => INVALID_PARAMETERS,
            Some(t) => match vm.vcpus.power(t) {
                Power::On => 0,
                Power::Off => 1,
                Power::Starting { .. } => 2,
            },
        },
        _ => NOT_SUPPORTED,
    };
    ctx.x[0] = result;
    PsciOutcome::Answered
}
