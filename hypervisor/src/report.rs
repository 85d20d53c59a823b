//! What the boot log and the shell print about the board and its memory,
//! formatted from plain data so the exact text is tested on the host (the
//! test harness parses it).

use core::fmt::{self, Write};

use platform::{BoardInfo, EnableMethod, Gic, GicVersion, PhysRange, Uart, UartKind};

use crate::mm::frames::{Accounting, FrameUse};

pub use crate::size::Size;

pub struct Range(pub PhysRange);

impl fmt::Display for Range {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#012x}-{:#012x}", self.0.start, self.0.end)
    }
}

pub fn uart(u: &Uart) -> impl fmt::Display + '_ {
    struct D<'a>(&'a Uart);
    impl fmt::Display for D<'_> {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            let kind = match self.0.kind {
                UartKind::Pl011 => "PL011",
                UartKind::Bcm2835Aux => "BCM2835 mini UART",
            };
            write!(f, "{kind} at {:#x}", self.0.regs.start)
        }
    }
    D(u)
}

/// The `GIC: ...` boot line.
pub fn write_gic(out: &mut impl Write, gic: &Gic) -> fmt::Result {
    let v = match gic.version {
        GicVersion::V2 => 2,
        GicVersion::V3 => 3,
    };
    write!(out, "GIC: GICv{v}, GICD {:#x}", gic.distributor.start)?;
    let parts = [
        ("GICC", gic.cpu_interface),
        ("GICH", gic.hyp_interface),
        ("GICV", gic.virtual_cpu_interface),
        ("GICR", gic.redistributors),
    ];
    for (name, range) in parts {
        if let Some(r) = range {
            write!(out, ", {name} {:#x}", r.start)?;
        }
    }
    writeln!(out)
}

/// The memory map printed at boot and by `mem`.
pub fn write_memory_map(out: &mut impl Write, board: &BoardInfo) -> fmt::Result {
    let total: u64 = board.ram.iter().map(|r| r.size()).sum();
    let banks = board.ram.len();
    let plural = if banks == 1 { "" } else { "s" };
    writeln!(
        out,
        "RAM: {total} bytes ({}) in {banks} bank{plural}",
        Size(total)
    )?;
    for (i, bank) in board.ram.iter().enumerate() {
        writeln!(out, "  bank {i}: {}  {}", Range(*bank), Size(bank.size()))?;
    }
    for r in &board.reserved {
        writeln!(
            out,
            "  reserved {}  {} ({})",
            Range(r.range),
            Size(r.range.size()),
            r.name
        )?;
    }
    Ok(())
}

/// The `Accounting` block of `mem`: every category, then a total that must
/// equal the RAM size (the harness checks the sum).
pub fn write_accounting(out: &mut impl Write, acc: &Accounting, ram_bytes: u64) -> fmt::Result {
    writeln!(out, "Accounting (4 KiB pages):")?;
    let line = |out: &mut dyn Write, label: &str, bytes: u64| {
        writeln!(out, "  {label:<24} {bytes:>12} bytes  ({})", Size(bytes))
    };
    for use_ in FrameUse::ALL {
        line(out, use_.label(), acc.bytes(use_))?;
    }
    if acc.unusable_partial_pages > 0 {
        line(out, "unusable (partial page)", acc.unusable_partial_pages)?;
    }
    let total = acc.total();
    let verdict = if total == ram_bytes {
        "= RAM"
    } else {
        "!= RAM (accounting bug)"
    };
    writeln!(out, "  {:<24} {total:>12} bytes {verdict}", "total")
}

/// How a CPU is started, as device trees name it.
pub fn method_name(method: EnableMethod) -> &'static str {
    match method {
        EnableMethod::Psci => "psci",
        EnableMethod::SpinTable { .. } => "spin-table",
        EnableMethod::None => "-",
    }
}

/// The `cpus` table. `state(i)` names the state of logical CPU `i`.
pub fn write_cpus<'a>(
    out: &mut impl Write,
    cpus: impl Iterator<Item = (usize, u64, EnableMethod, &'a str)>,
) -> fmt::Result {
    writeln!(out, "cpu  MPIDR         enable-method  state")?;
    for (index, mpidr, method, state) in cpus {
        let method = method_name(method);
        let boot = if index == 0 { " (boot CPU)" } else { "" };
        writeln!(out, "{index:<4} {mpidr:<#13x} {method:<14} {state}{boot}")?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(Size(2 << 30).to_string(), "2048 MiB");
        assert_eq!(Size(1536 * 1024).to_string(), "1.5 MiB");
        assert_eq!(Size(512 * 1024).to_string(), "512 KiB");
        assert_eq!(Size(100).to_string(), "100 bytes");
        assert_eq!(Size(0).to_string(), "0 bytes");
    }

    #[test]
    fn cpus_table() {
        let mut s = String::new();
        let rows = [
            (0, 0u64, EnableMethod::Psci, "online"),
            (1, 0x100, EnableMethod::None, "offline"),
        ];
        write_cpus(&mut s, rows.into_iter()).unwrap();
        let lines: Vec<&str> = s.lines().collect();
        assert_eq!(
            lines[1],
            "0    0x0           psci           online (boot CPU)"
        );
        assert_eq!(lines[2], "1    0x100         -              offline");
    }
}
