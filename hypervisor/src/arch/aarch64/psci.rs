//! Calls to the firmware's PSCI (Power State Coordination Interface) by SMC
//! or HVC, as the device tree's /psci node says, through the smccc crate
//! (function IDs, the SMCCC call itself and the return codes).

use platform::PsciConduit;
use smccc::{Hvc, Smc};

pub use smccc::psci::Error as PsciError;

/// Start the CPU `mpidr` at `entry` with `context` in x0.
pub fn cpu_on(conduit: PsciConduit, mpidr: u64, entry: u64, context: u64) -> Result<(), PsciError> {
    match conduit {
        PsciConduit::Smc => smccc::psci::cpu_on::<Smc>(mpidr, entry, context),
        PsciConduit::Hvc => smccc::psci::cpu_on::<Hvc>(mpidr, entry, context),
    }
}

/// Power the board off; returns only if the firmware refuses.
pub fn system_off(conduit: PsciConduit) -> Result<(), PsciError> {
    match conduit {
        PsciConduit::Smc => smccc::psci::system_off::<Smc>(),
        PsciConduit::Hvc => smccc::psci::system_off::<Hvc>(),
    }
}
