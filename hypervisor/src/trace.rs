//! Trace events: compact defmt frames sent to the trace UART when the board
//! has one (see `platform::BoardInfo::trace_uart`), dropped otherwise; never
//! mixed into the console.

#[cfg(target_os = "none")]
pub fn cpu_online(index: usize, mpidr: u64) {
    let _ = (index, mpidr);
}
