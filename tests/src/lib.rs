//! Host-side test harness for the Tidal hypervisor.
//!
//! - [`qemu`]: boards, build artifacts and the QEMU command lines (also used
//!   by `cargo xtask run`, so they exist in one place only);
//! - [`session`]: a running QEMU whose console is captured, matched against
//!   and typed into, and which always ends (deadline, kill on drop);
//! - [`console`]: parsers for the hypervisor's console output;
//! - [`linux`]: Linux guests' agent (run a command in a named VM) and the
//!   progress lines of their background loops;
//! - [`symbols`]: crash-address symbolization and defmt trace decoding from
//!   the hypervisor ELF.
//!
//! # Console protocol (what the parsers and `tests/boot.rs` expect)
//!
//! - Boot: `Tidal hypervisor v<version> (<build>) on <board> [<compatible>]`,
//!   then `GIC: GICv2 ...` or `GIC: GICv3 ...`; the prompt is `tidal> `.
//! - `mem`: `RAM: <N> bytes (<M> MiB) in <k> bank(s)`, bank lines,
//!   `Accounting (4 KiB pages):`, lines `  <label>  <bytes> bytes <text>`,
//!   ending with `  total <bytes> bytes = RAM`.
//! - `cpus`: a header, then `<index> <mpidr hex> <enable-method> <state...>`.
//! - Crash: `*** EXCEPTION on CPU <n>: ...` with `ESR_EL2 0x..`, `FAR_EL2 0x..`,
//!   `ELR_EL2 0x.. (image offset 0x..)`, x0..x30, then `CPU <n> parked.`;
//!   panic: `*** PANIC on CPU <n> at <file>:<line>:<col>: <message>`, then
//!   `CPU <n> parked.`.
//! - Fatal boot errors: one line starting `FATAL:`, then QEMU exits.
//! - Trace: a defmt (rzCOBS) stream on the second UART.

pub mod console;
pub mod linux;
pub mod qemu;
pub mod session;
pub mod symbols;

pub use console::{parse_cpus, parse_mem, CpuLine, MemReport, PROMPT};
pub use qemu::{
    bundle_with_address, disk_image, log_dir, qemu_args, qemu_command, qemu_command_line,
    target_dir, trace_build, workspace_root, Artifacts, Board, NetLink, QemuOptions, PI4_QEMU_DTB,
    QEMU, TRACE_BUILD_DIR,
};
pub use session::{ErrorKind, HarnessError, Session, DEFAULT_DEADLINE};
pub use symbols::{decode_trace, symbolize};
