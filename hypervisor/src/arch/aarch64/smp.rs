//! Bringing secondary CPUs online: PSCI `CPU_ON` or the spin table, as each
//! CPU's device-tree node says, and waiting for each to report in.

use core::ptr::{addr_of, addr_of_mut, write_volatile};
use core::sync::atomic::{AtomicU32, Ordering};

use platform::{BoardInfo, Cpu, EnableMethod, PsciConduit};

use super::entry::{secondary_entry, CPU_MPIDRS};
use super::{psci, MAX_CPUS};

/// Per-CPU state, as the `cpus` command shows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum CpuState {
    Absent = 0,
    Starting = 1,
    Online = 2,
    Failed = 3,
    Parked = 4,
}

static CPU_STATE: [AtomicU32; MAX_CPUS] = [const { AtomicU32::new(0) }; MAX_CPUS];

pub fn state(cpu: usize) -> CpuState {
    match CPU_STATE[cpu].load(Ordering::Acquire) {
        1 => CpuState::Starting,
        2 => CpuState::Online,
        3 => CpuState::Failed,
        4 => CpuState::Parked,
        _ => CpuState::Absent,
    }
}

pub fn set_state(cpu: usize, state: CpuState) {
    if cpu < MAX_CPUS {
        CPU_STATE[cpu].store(state as u32, Ordering::Release);
    }
}

/// Why a CPU did not come online.
#[derive(Clone, Copy, Debug)]
pub enum StartError {
    NoEnableMethod,
    NoPsci,
    Psci(psci::PsciError),
    Timeout,
}

/// Record every CPU's MPIDR so secondaries can find their index, with the
/// boot CPU (whose MPIDR is `boot_mpidr`) as index 0. Returns the table.
pub fn assign_indexes(board: &BoardInfo, boot_mpidr: u64) -> [Option<Cpu>; MAX_CPUS] {
    let mut table = [None; MAX_CPUS];
    let mut next = 1;
    for cpu in &board.cpus {
        let index = if cpu.mpidr == boot_mpidr {
            0
        } else if next < MAX_CPUS {
            next += 1;
            next - 1
        } else {
            continue;
        };
        table[index] = Some(*cpu);
    }
    // The tree may not list the boot CPU (it always exists).
    if table[0].is_none() {
        table[0] = Some(Cpu {
            mpidr: boot_mpidr,
            enable_method: EnableMethod::None,
        });
    }
    // SAFETY: only the boot CPU runs; secondaries read CPU_MPIDRS after
    // they are started, and it is cleaned to the point of coherency first.
    unsafe {
        let mpidrs = addr_of_mut!(CPU_MPIDRS);
        for (slot, cpu) in (*mpidrs).iter_mut().zip(table.iter()) {
            *slot = cpu.map_or(u64::MAX, |c| c.mpidr);
        }
        super::clean_dcache_range(
            addr_of!(CPU_MPIDRS) as usize,
            core::mem::size_of_val(&*mpidrs),
        );
    }
    set_state(0, CpuState::Online);
    table
}

/// Start CPU `index` and wait (at most ~1 s) until it reports online.
pub fn start(index: usize, cpu: &Cpu, psci_conduit: Option<PsciConduit>) -> Result<(), StartError> {
    let entry = secondary_entry as *const () as u64;
    set_state(index, CpuState::Starting);
    let result = match cpu.enable_method {
        EnableMethod::Psci => {
            let conduit = psci_conduit.ok_or(StartError::NoPsci)?;
            psci::cpu_on(conduit, cpu.mpidr, entry, index as u64).map_err(StartError::Psci)
        }
        EnableMethod::SpinTable { release_addr } => {
            release_spinning_cpu(release_addr, entry);
            Ok(())
        }
        EnableMethod::None => Err(StartError::NoEnableMethod),
    };
    if let Err(e) = result {
        set_state(index, CpuState::Failed);
        return Err(e);
    }
    let (start, freq) = super::counter();
    while state(index) != CpuState::Online {
        if super::counter().0 - start > freq {
            set_state(index, CpuState::Failed);
            return Err(StartError::Timeout);
        }
        core::hint::spin_loop();
    }
    Ok(())
}

/// Send a CPU waiting in the spin table to `entry`: write its release
/// address (one u64 in normal memory, not a register block), clean it to
/// the point of coherency (the CPU polls it with caches off) and wake it.
fn release_spinning_cpu(release_addr: u64, entry: u64) {
    // SAFETY: the release address is in a page the frame table marks
    // firmware-reserved, mapped as normal memory, 8-byte aligned per the
    // spin-table binding.
    unsafe { write_volatile(release_addr as *mut u64, entry) };
    super::clean_dcache_range(release_addr as usize, 8);
    super::send_event();
}

impl CpuState {
    pub fn label(self) -> &'static str {
        match self {
            CpuState::Absent => "offline",
            CpuState::Starting => "offline (starting)",
            CpuState::Online => "online",
            CpuState::Failed => "offline (failed to start)",
            CpuState::Parked => "offline (parked after a crash)",
        }
    }
}

/// The MPIDR of logical CPU `index`, if such a CPU exists.
pub fn cpu_mpidr(index: usize) -> Option<u64> {
    // SAFETY: CPU_MPIDRS is written only by the boot CPU before any
    // secondary starts; afterwards it is read-only.
    let v = unsafe { (*addr_of!(CPU_MPIDRS)).get(index).copied()? };
    (v != u64::MAX).then_some(v)
}
