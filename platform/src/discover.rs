//! Device-tree discovery: turns the blob the firmware passes in `x0` into a
//! [`BoardInfo`].
//!
//! This module owns the interpretation of the tree (which nodes and
//! properties mean RAM, reserved memory, console, GIC, CPUs, PSCI, timer,
//! power-off; `#address-cells`/`#size-cells`, `ranges` translation, GIC
//! interrupt specifiers). The byte-level format is [`fdt`]'s.
//!
//! It runs before the hypervisor has a heap, so it allocates nothing, and the
//! blob is firmware input, so it never panics: structural damage is an
//! [`Err`]; a device whose description is unusable is left out (`None`),
//! except RAM, which the hypervisor cannot do without, and CPUs, where
//! guessing would start the wrong core.

mod fdt;
#[cfg(any(test, feature = "testing"))]
pub mod testing;

use core::fmt;

use self::fdt::{be32, Fdt, Node};
use crate::{
    boards, BoardInfo, Cpu, EnableMethod, Gic, GicVersion, PhysRange, PowerOff, PsciConduit,
    ReservedRegion, TimerIrqs, Uart, UartKind, VirtioMmioSlot, MAX_CPUS, MAX_RAM_BANKS,
    MAX_RESERVED, MAX_VIRTIO_MMIO,
};

/// Why a device tree could not be turned into a [`BoardInfo`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DiscoveryError {
    /// The first word is not `0xd00dfeed`.
    BadMagic(u32),
    /// The slice is shorter than the header or than the header's `totalsize`.
    Truncated { len: usize, needed: usize },
    /// Older than version 17, or not readable by a version-17 reader.
    UnsupportedVersion { version: u32, last_compatible: u32 },
    /// A header offset or size points outside the blob.
    BadHeader(&'static str),
    /// The structure block is malformed at this offset (within the block).
    BadStructure { offset: usize, what: &'static str },
    /// No available `device_type = "memory"` node has a non-empty `reg`.
    NoMemory,
    /// More entries than [`BoardInfo`] holds (`what` is plural, e.g. "RAM banks").
    TooMany { what: &'static str, max: usize },
    /// The `index`th CPU node (in `/cpus` order) cannot be used.
    BadCpu { index: usize, what: &'static str },
}

impl fmt::Display for DiscoveryError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("device tree: ")?;
        match *self {
            Self::BadMagic(m) => write!(f, "bad header magic {m:#010x} (expected 0xd00dfeed)"),
            Self::Truncated { len, needed } => {
                write!(f, "blob truncated: {len} bytes, the header needs {needed}")
            }
            Self::UnsupportedVersion {
                version,
                last_compatible,
            } => write!(
                f,
                "unsupported version {version} (last compatible {last_compatible}), need 17"
            ),
            Self::BadHeader(what) => write!(f, "bad header: {what}"),
            Self::BadStructure { offset, what } => {
                write!(f, "malformed structure block at offset {offset:#x}: {what}")
            }
            Self::NoMemory => f.write_str("no /memory node with a non-empty reg"),
            Self::TooMany { what, max } => write!(f, "more than {max} {what}"),
            Self::BadCpu { index, what } => write!(f, "CPU node {index} under /cpus: {what}"),
        }
    }
}

impl core::error::Error for DiscoveryError {}

/// The description of the board a blob names, from its root `compatible`
/// alone: usable when full discovery failed (to report why on the board's
/// usual console). `None` for a bad blob or an unknown board.
pub fn board_desc(dtb: &[u8]) -> Option<&'static crate::boards::BoardDesc> {
    let fdt = Fdt::new(dtb).ok()?;
    let compatible = fdt.root().prop("compatible")?;
    let names = compatible
        .split(|&b| b == 0)
        .filter_map(|s| core::str::from_utf8(s).ok());
    let desc = crate::boards::describe(names);
    (desc != &crate::boards::GENERIC).then_some(desc)
}

/// Why the board the blob names cannot run Tidal
/// ([`crate::boards::unsupported`]), from its root `compatible` alone.
pub fn unsupported_board(dtb: &[u8]) -> Option<&'static str> {
    let fdt = Fdt::new(dtb).ok()?;
    let compatible = fdt.root().prop("compatible")?;
    crate::boards::unsupported(
        compatible
            .split(|&b| b == 0)
            .filter_map(|s| core::str::from_utf8(s).ok()),
    )
}

/// Reads everything [`BoardInfo`] holds from the tree `dtb`, which the
/// firmware placed at physical address `dtb_addr`.
///
/// `bootargs` longer than [`BoardInfo::bootargs`] holds are cut at the last
/// whole UTF-8 character that fits (a long command line is no reason to
/// refuse to boot); `model` and `compatible` likewise.
pub fn discover(dtb: &[u8], dtb_addr: u64) -> Result<BoardInfo, DiscoveryError> {
    let fdt = Fdt::new(dtb)?;
    let root = fdt.root();

    let compatible = bounded_str(root.prop("compatible").unwrap_or(&[]));
    let model = match root.prop("model") {
        Some(m) if cstr(m).is_some_and(|m| !m.is_empty()) => bounded_str(m),
        _ => compatible.clone(),
    };
    let cpus = cpus(&fdt)?;
    let psci = psci(&fdt);
    let console = console(&fdt);
    let trace_uart = trace_uart(&fdt, console.as_ref());

    Ok(BoardInfo {
        model,
        compatible,
        dtb: PhysRange::from_base_size(dtb_addr, fdt.totalsize().into()),
        ram: ram(&fdt)?,
        reserved: reserved(&fdt, &cpus)?,
        initrd: initrd(&fdt),
        console,
        trace_uart,
        gic: gic(&fdt),
        cpus,
        psci,
        timer: timer(&fdt),
        power_off: power_off(&fdt, psci),
        virtio_mmio: virtio_mmio(&fdt),
        bootargs: fdt
            .root()
            .child(b"chosen")
            .and_then(|c| c.prop("bootargs"))
            .map(bounded_str),
    })
}

// ---------------------------------------------------------------- helpers

/// The bytes up to the first NUL (or all of them).
fn cstr(b: &[u8]) -> Option<&[u8]> {
    b.split(|&c| c == 0).next()
}

/// The strings of a string-list property (`compatible`).
fn strings(b: &[u8]) -> impl Iterator<Item = &[u8]> {
    // A well-formed list ends in NUL, which leaves one empty piece at the end.
    b.split(|&c| c == 0).filter(|s| !s.is_empty())
}

/// The first string of `b` as a bounded `String`, cut at a character
/// boundary if it is too long or at the first invalid UTF-8 byte.
fn bounded_str<const N: usize>(b: &[u8]) -> heapless::String<N> {
    let b = cstr(b).unwrap_or(&[]);
    let s = match core::str::from_utf8(b) {
        Ok(s) => s,
        Err(e) => core::str::from_utf8(&b[..e.valid_up_to()]).unwrap_or(""),
    };
    let mut out = heapless::String::new();
    for ch in s.chars() {
        if out.push(ch).is_err() {
            break;
        }
    }
    out
}

fn is_compatible(node: &Node, any_of: &[&str]) -> bool {
    node.prop("compatible")
        .is_some_and(|c| strings(c).any(|s| any_of.iter().any(|want| want.as_bytes() == s)))
}

/// `status` absent, "okay" or "ok".
fn is_available(node: &Node) -> bool {
    match node.prop("status").and_then(cstr) {
        None => true,
        Some(s) => s == b"okay" || s == b"ok",
    }
}

fn u32_prop(node: &Node, name: &str) -> Option<u32> {
    node.prop(name).and_then(|v| be32(v, 0))
}

/// The `#address-cells` and `#size-cells` a node gives its children
/// (defaults 2 and 1, as the specification says).
fn child_cells(bus: &Node) -> (usize, usize) {
    let get = |name, default| u32_prop(bus, name).map_or(default, |v| v as usize);
    (get("#address-cells", 2), get("#size-cells", 1))
}

/// A number of `cells` 32-bit cells at the start of `b`. Wider numbers are
/// accepted only when the cells above 64 bits are zero.
fn read_cells(b: &[u8], cells: usize) -> Option<u64> {
    let len = cells.checked_mul(4)?;
    let b = b.get(..len)?;
    let mut v: u64 = 0;
    for (i, cell) in b.chunks_exact(4).enumerate() {
        if i + 2 < cells && cell != [0; 4] {
            return None;
        }
        v = (v << 32) | be32(cell, 0)? as u64;
    }
    Some(v)
}

/// A node's `reg` entries as (address, size) in its parent's bus space.
fn reg<'a>(node: &Node<'a>) -> impl Iterator<Item = (u64, u64)> + 'a {
    let (ac, sc) = node.parent().map_or((2, 1), |p| child_cells(&p));
    let entry = ac
        .checked_add(sc)
        .and_then(|c| c.checked_mul(4))
        .unwrap_or(0);
    let value = node.prop("reg").unwrap_or(&[]);
    // chunks_exact panics on 0; an entry of no cells describes nothing.
    value
        .chunks_exact(entry.max(1))
        .filter(move |_| entry != 0)
        .filter_map(move |e| Some((read_cells(e, ac)?, read_cells(e.get(ac * 4..)?, sc)?)))
}

/// Translates `addr`, an address on `node`'s parent bus, to a CPU physical
/// address through every ancestor bus's `ranges`. An empty `ranges` is the
/// identity; a bus without `ranges`, or an address no range covers, cannot
/// be reached from the CPU.
fn translate(node: &Node, mut addr: u64) -> Option<u64> {
    let mut bus = node.parent()?;
    while let Some(up) = bus.parent() {
        let ranges = bus.prop("ranges")?;
        if !ranges.is_empty() {
            let (child_ac, sc) = child_cells(&bus);
            let (parent_ac, _) = child_cells(&up);
            let entry = child_ac
                .checked_add(parent_ac)
                .and_then(|c| c.checked_add(sc))
                .and_then(|c| c.checked_mul(4))
                .filter(|&e| e != 0)?;
            addr = ranges.chunks_exact(entry).find_map(|e| {
                let child = read_cells(e, child_ac)?;
                let parent = read_cells(e.get(child_ac * 4..)?, parent_ac)?;
                let size = read_cells(e.get((child_ac + parent_ac) * 4..)?, sc)?;
                let within = addr.checked_sub(child).filter(|&off| off < size)?;
                parent.checked_add(within)
            })?;
        }
        bus = up;
    }
    Some(addr)
}

/// The `index`th `reg` entry of `node` as a CPU physical range.
fn reg_range(node: &Node, index: usize) -> Option<PhysRange> {
    let (addr, size) = reg(node).nth(index)?;
    let start = translate(node, addr)?;
    Some(PhysRange::new(start, start.checked_add(size)?))
}

const GICV2_COMPATIBLE: &[&str] = &[
    "arm,gic-400",
    "arm,cortex-a15-gic",
    "arm,cortex-a9-gic",
    "arm,gic-v2",
];
const GICV3_COMPATIBLE: &[&str] = &["arm,gic-v3"];

/// A GIC interrupt specifier (type, number, flags) as an INTID.
fn gic_intid(spec: &[u8]) -> Option<u32> {
    let (kind, n) = (be32(spec, 0)?, be32(spec, 4)?);
    match kind {
        0 if n < 988 => Some(32 + n),
        1 if n < 16 => Some(16 + n),
        _ => None,
    }
}

/// The node's interrupts as INTIDs, when its interrupt parent is a GIC with
/// three-cell specifiers; entries that are not SPIs or PPIs are `None`.
fn intids<'a>(node: &Node<'a>) -> Option<impl Iterator<Item = Option<u32>> + 'a> {
    let ints = node.prop("interrupts")?;
    // The interrupt parent is the nearest `interrupt-parent` on the way up.
    let mut cur = Some(*node);
    let phandle = loop {
        let n = cur?;
        if let Some(p) = u32_prop(&n, "interrupt-parent") {
            break p;
        }
        cur = n.parent();
    };
    let parent = node.fdt().by_phandle(phandle)?;
    let is_gic =
        is_compatible(&parent, GICV2_COMPATIBLE) || is_compatible(&parent, GICV3_COMPATIBLE);
    if !is_gic || u32_prop(&parent, "#interrupt-cells") != Some(3) {
        return None;
    }
    Some(ints.chunks_exact(12).map(gic_intid))
}

fn first_intid(node: &Node) -> Option<u32> {
    intids(node)?.next()?
}

// --------------------------------------------------------------- sections

fn ram(fdt: &Fdt) -> Result<heapless::Vec<PhysRange, MAX_RAM_BANKS>, DiscoveryError> {
    // Collect before merging: a bank split across entries is still one bank.
    let mut raw: heapless::Vec<PhysRange, { 4 * MAX_RAM_BANKS }> = heapless::Vec::new();
    for node in fdt.nodes() {
        if node.prop("device_type").and_then(cstr) != Some(b"memory") || !is_available(&node) {
            continue;
        }
        for (addr, size) in reg(&node) {
            let Some(start) = translate(&node, addr) else {
                continue;
            };
            let r = PhysRange::from_base_size(start, size);
            if !r.is_empty() {
                raw.push(r).map_err(|_| DiscoveryError::TooMany {
                    what: "memory reg entries",
                    max: 4 * MAX_RAM_BANKS,
                })?;
            }
        }
    }
    raw.sort_unstable();
    let mut ram: heapless::Vec<PhysRange, MAX_RAM_BANKS> = heapless::Vec::new();
    for r in raw {
        match ram.last_mut() {
            Some(last) if r.start <= last.end => last.end = last.end.max(r.end),
            _ => ram.push(r).map_err(|_| DiscoveryError::TooMany {
                what: "RAM banks",
                max: MAX_RAM_BANKS,
            })?,
        }
    }
    if ram.is_empty() {
        return Err(DiscoveryError::NoMemory);
    }
    Ok(ram)
}

fn reserved(
    fdt: &Fdt,
    cpus: &[Cpu],
) -> Result<heapless::Vec<ReservedRegion, MAX_RESERVED>, DiscoveryError> {
    let mut out = heapless::Vec::new();
    let mut add = |range: PhysRange, name: &[u8]| {
        if range.is_empty() {
            return Ok(());
        }
        let region = ReservedRegion {
            range,
            name: bounded_str(name),
        };
        out.push(region).map_err(|_| DiscoveryError::TooMany {
            what: "reserved regions",
            max: MAX_RESERVED,
        })
    };
    for (addr, size) in fdt.memreserve() {
        add(PhysRange::from_base_size(addr, size), b"/memreserve/")?;
    }
    if let Some(rm) = fdt.root().child(b"reserved-memory") {
        for child in rm.children().filter(is_available) {
            for (addr, size) in reg(&child) {
                if let Some(start) = translate(&child, addr) {
                    add(PhysRange::from_base_size(start, size), child.name())?;
                }
            }
        }
    }
    // The spin-table release words: written by us, read by waiting cores.
    let mut pages: heapless::Vec<u64, MAX_CPUS> = heapless::Vec::new();
    for cpu in cpus {
        if let EnableMethod::SpinTable { release_addr } = cpu.enable_method {
            let page = release_addr & !0xfff;
            if !pages.contains(&page) {
                // At most one page per CPU, so this cannot overflow.
                let _ = pages.push(page);
                add(PhysRange::from_base_size(page, 0x1000), b"spin-table")?;
            }
        }
    }
    Ok(out)
}

fn initrd(fdt: &Fdt) -> Option<PhysRange> {
    let chosen = fdt.root().child(b"chosen")?;
    // Firmware writes these as one or two cells, whatever #address-cells says.
    let num = |name| {
        let v = chosen.prop(name)?;
        match v.len() {
            4 | 8 => read_cells(v, v.len() / 4),
            _ => None,
        }
    };
    let r = PhysRange::new(num("linux,initrd-start")?, num("linux,initrd-end")?);
    (!r.is_empty()).then_some(r)
}

fn uart_at(node: &Node) -> Option<Uart> {
    let kind = if is_compatible(node, &["arm,pl011"]) {
        UartKind::Pl011
    } else if is_compatible(node, &["brcm,bcm2835-aux-uart"]) {
        UartKind::Bcm2835Aux
    } else {
        return None;
    };
    Some(Uart {
        kind,
        regs: reg_range(node, 0)?,
        intid: first_intid(node),
    })
}

fn console(fdt: &Fdt) -> Option<Uart> {
    let stdout = fdt
        .root()
        .child(b"chosen")
        .and_then(|c| c.prop("stdout-path"))
        .and_then(cstr);
    let node = match stdout {
        // Options such as the baud rate follow a ':'; the path has none.
        Some(path) => fdt.resolve(path.split(|&c| c == b':').next()?)?,
        None => fdt.resolve(b"serial0")?,
    };
    uart_at(&node)
}

fn trace_uart(fdt: &Fdt, console: Option<&Uart>) -> Option<Uart> {
    let root_compatible = fdt.root().prop("compatible").unwrap_or(&[]);
    let desc =
        boards::describe(strings(root_compatible).filter_map(|s| core::str::from_utf8(s).ok()));
    let node = fdt.resolve(desc.trace_uart_alias?.as_bytes())?;
    let uart = uart_at(&node).filter(|_| is_available(&node))?;
    (uart.kind == UartKind::Pl011 && console.is_none_or(|c| !c.regs.overlaps(&uart.regs)))
        .then_some(uart)
}

fn gic(fdt: &Fdt) -> Option<Gic> {
    let (node, version) = fdt.nodes().filter(is_available).find_map(|n| {
        if is_compatible(&n, GICV2_COMPATIBLE) {
            Some((n, GicVersion::V2))
        } else if is_compatible(&n, GICV3_COMPATIBLE) {
            Some((n, GicVersion::V3))
        } else {
            None
        }
    })?;
    // The GIC's own `interrupts` is the maintenance PPI in its own format.
    let maintenance_intid = node.prop("interrupts").and_then(gic_intid);
    let distributor = reg_range(&node, 0)?;
    Some(match version {
        GicVersion::V2 => Gic {
            version,
            distributor,
            cpu_interface: reg_range(&node, 1),
            hyp_interface: reg_range(&node, 2),
            virtual_cpu_interface: reg_range(&node, 3),
            redistributors: None,
            maintenance_intid,
        },
        GicVersion::V3 => {
            // reg: GICD, one entry per redistributor region, then GICC, GICH, GICV.
            let regions = u32_prop(&node, "#redistributor-regions")
                .unwrap_or(1)
                .max(1) as usize;
            let after = |i: usize| regions.checked_add(i).and_then(|j| reg_range(&node, j));
            Gic {
                version,
                distributor,
                cpu_interface: after(1),
                hyp_interface: after(2),
                virtual_cpu_interface: after(3),
                redistributors: Some(reg_range(&node, 1)?),
                maintenance_intid,
            }
        }
    })
}

fn cpus(fdt: &Fdt) -> Result<heapless::Vec<Cpu, MAX_CPUS>, DiscoveryError> {
    let mut out = heapless::Vec::new();
    let Some(cpus) = fdt.root().child(b"cpus") else {
        return Ok(out);
    };
    let (ac, _) = child_cells(&cpus);
    let nodes = cpus
        .children()
        .filter(|n| n.prop("device_type").and_then(cstr) == Some(b"cpu"));
    for (index, node) in nodes.enumerate() {
        let bad = |what| DiscoveryError::BadCpu { index, what };
        let mpidr = node
            .prop("reg")
            .filter(|_| ac == 1 || ac == 2)
            .and_then(|r| read_cells(r, ac))
            .ok_or(bad("no 1- or 2-cell reg"))?;
        let enable_method = match node.prop("enable-method").and_then(cstr) {
            Some(b"psci") => EnableMethod::Psci,
            Some(b"spin-table") => {
                let v = node.prop("cpu-release-addr").unwrap_or(&[]);
                let release_addr = match v.len() {
                    4 | 8 => read_cells(v, v.len() / 4),
                    _ => None,
                }
                .ok_or(bad("spin-table without a 1- or 2-cell cpu-release-addr"))?;
                EnableMethod::SpinTable { release_addr }
            }
            _ => EnableMethod::None,
        };
        out.push(Cpu {
            mpidr,
            enable_method,
        })
        .map_err(|_| DiscoveryError::TooMany {
            what: "CPUs",
            max: MAX_CPUS,
        })?;
    }
    Ok(out)
}

fn psci(fdt: &Fdt) -> Option<PsciConduit> {
    let root = fdt.root();
    let node = root.child(b"psci").or_else(|| {
        fdt.nodes().find(|n| {
            n.prop("compatible")
                .is_some_and(|c| strings(c).any(|s| s.starts_with(b"arm,psci")))
        })
    })?;
    match node.prop("method").and_then(cstr)? {
        b"smc" => Some(PsciConduit::Smc),
        b"hvc" => Some(PsciConduit::Hvc),
        _ => None,
    }
}

fn timer(fdt: &Fdt) -> TimerIrqs {
    let node = fdt
        .nodes()
        .filter(is_available)
        .find(|n| is_compatible(n, &["arm,armv8-timer", "arm,armv7-timer"]));
    let Some(mut ids) = node.as_ref().and_then(intids) else {
        return TimerIrqs::default();
    };
    let mut next = || ids.next().flatten();
    TimerIrqs {
        secure_phys: next(),
        nonsecure_phys: next(),
        virt: next(),
        hyp_phys: next(),
    }
}

fn power_off(fdt: &Fdt, psci: Option<PsciConduit>) -> PowerOff {
    if let Some(conduit) = psci {
        return PowerOff::Psci(conduit);
    }
    fdt.nodes()
        .filter(is_available)
        .find(|n| {
            is_compatible(
                n,
                &["brcm,bcm2835-pm", "brcm,bcm2835-pm-wdt", "brcm,bcm2711-pm"],
            )
        })
        .and_then(|n| reg_range(&n, 0))
        .map_or(PowerOff::None, |regs| PowerOff::Bcm2835Watchdog { regs })
}

#[cfg(test)]
mod tests;

fn virtio_mmio(fdt: &Fdt) -> heapless::Vec<VirtioMmioSlot, MAX_VIRTIO_MMIO> {
    fdt.nodes()
        .filter(|n| is_available(n) && is_compatible(n, &["virtio,mmio"]))
        .filter_map(|n| {
            Some(VirtioMmioSlot {
                regs: reg_range(&n, 0).filter(|r| !r.is_empty())?,
                intid: first_intid(&n),
            })
        })
        .take(MAX_VIRTIO_MMIO)
        .collect()
}
