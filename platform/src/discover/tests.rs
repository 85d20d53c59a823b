//! Discovery against real trees (QEMU virt GICv2/GICv3, a hand-written board,
//! the Raspberry Pi 4) and against damaged blobs.

use super::*;
use std::path::PathBuf;

const VIRT_GICV2: &[u8] = include_bytes!("../../testdata/virt-gicv2.dtb");
const VIRT_GICV3: &[u8] = include_bytes!("../../testdata/virt-gicv3.dtb");
const RESERVED: &[u8] = include_bytes!("../../testdata/reserved.dtb");

fn r(start: u64, end: u64) -> PhysRange {
    PhysRange::new(start, end)
}

fn sz(base: u64, size: u64) -> PhysRange {
    PhysRange::from_base_size(base, size)
}

fn psci_cpus(n: u64) -> Vec<Cpu> {
    (0..n)
        .map(|mpidr| Cpu {
            mpidr,
            enable_method: EnableMethod::Psci,
        })
        .collect()
}

fn virt_common(b: &BoardInfo, blob: &[u8]) {
    assert_eq!(b.model, "linux,dummy-virt");
    assert_eq!(b.compatible, "linux,dummy-virt");
    assert_eq!(b.dtb, sz(0x4800_0000, blob.len() as u64));
    assert_eq!(b.ram.as_slice(), &[sz(0x4000_0000, 2 << 30)]);
    assert!(b.reserved.is_empty());
    assert_eq!(b.initrd, None);
    let console = Uart {
        kind: UartKind::Pl011,
        regs: sz(0x900_0000, 0x1000),
        intid: Some(33),
    };
    assert_eq!(b.console, Some(console));
    let trace = Uart {
        kind: UartKind::Pl011,
        regs: sz(0x904_0000, 0x1000),
        intid: Some(40),
    };
    assert_eq!(b.trace_uart, Some(trace));
    assert_eq!(b.cpus.as_slice(), psci_cpus(4).as_slice());
    assert_eq!(b.psci, Some(PsciConduit::Smc));
    let timer = TimerIrqs {
        secure_phys: Some(29),
        nonsecure_phys: Some(30),
        virt: Some(27),
        hyp_phys: Some(26),
    };
    assert_eq!(b.timer, timer);
    assert_eq!(b.power_off, PowerOff::Psci(PsciConduit::Smc));
    assert_eq!(b.bootargs, None);
    // 32 virtio-mmio slots of 0x200 bytes from 0xa000000, SPI 16 onwards.
    assert_eq!(b.virtio_mmio.len(), 32);
    for i in 0..32u64 {
        let slot = VirtioMmioSlot {
            regs: sz(0xa00_0000 + i * 0x200, 0x200),
            intid: Some(32 + 16 + i as u32),
        };
        assert!(b.virtio_mmio.contains(&slot), "{slot:?} missing");
    }
}

#[test]
fn qemu_virt_gicv2() {
    let b = discover(VIRT_GICV2, 0x4800_0000).unwrap();
    virt_common(&b, VIRT_GICV2);
    let gic = Gic {
        version: GicVersion::V2,
        distributor: sz(0x800_0000, 0x1_0000),
        cpu_interface: Some(sz(0x801_0000, 0x1_0000)),
        hyp_interface: Some(sz(0x803_0000, 0x1_0000)),
        virtual_cpu_interface: Some(sz(0x804_0000, 0x1_0000)),
        redistributors: None,
        maintenance_intid: Some(25),
    };
    assert_eq!(b.gic, Some(gic));
}

#[test]
fn qemu_virt_gicv3() {
    let b = discover(VIRT_GICV3, 0x4800_0000).unwrap();
    virt_common(&b, VIRT_GICV3);
    let gic = Gic {
        version: GicVersion::V3,
        distributor: sz(0x800_0000, 0x1_0000),
        cpu_interface: None,
        hyp_interface: None,
        virtual_cpu_interface: None,
        redistributors: Some(sz(0x80a_0000, 0xf6_0000)),
        maintenance_intid: Some(25),
    };
    assert_eq!(b.gic, Some(gic));
}

#[test]
fn hand_written_board() {
    let b = discover(RESERVED, 0x8100_0000).unwrap();
    assert_eq!(b.model, "hv test board");
    assert_eq!(b.compatible, "hv,test-board");
    assert_eq!(b.dtb, sz(0x8100_0000, RESERVED.len() as u64));
    // Given out of order, with a zero-size and an overlapping entry.
    assert_eq!(
        b.ram.as_slice(),
        &[r(0x8000_0000, 0xc000_0000), r(0x1_0000_0000, 0x1_4000_0000)]
    );
    let reserved: Vec<(PhysRange, &str)> = b
        .reserved
        .iter()
        .map(|x| (x.range, x.name.as_str()))
        .collect();
    assert_eq!(
        reserved,
        [
            (sz(0x8000_0000, 0x1_0000), "/memreserve/"),
            (sz(0x8ff0_0000, 0x2000), "/memreserve/"),
            (sz(0x8020_0000, 0x10_0000), "firmware@80200000"),
            (sz(0x8000_f000, 0x1000), "spin-table"),
            (sz(0x8001_1000, 0x1000), "spin-table"),
        ]
    );
    assert_eq!(b.initrd, Some(r(0x8800_0000, 0x8812_3000)));
    // /soc@f0000000 (1 cell) -> bus@3000000 (2 cells) -> serial@1,1000.
    let console = Uart {
        kind: UartKind::Pl011,
        regs: sz(0xf300_1000, 0x1000),
        intid: Some(37),
    };
    assert_eq!(b.console, Some(console));
    // A generic board has no trace UART, even with a free PL011.
    assert_eq!(b.trace_uart, None);
    let gic = Gic {
        version: GicVersion::V2,
        distributor: sz(0xfe04_1000, 0x1000),
        cpu_interface: Some(sz(0xfe04_2000, 0x2000)),
        hyp_interface: None,
        virtual_cpu_interface: None,
        redistributors: None,
        maintenance_intid: Some(25),
    };
    assert_eq!(b.gic, Some(gic));
    let spin = |release_addr| EnableMethod::SpinTable { release_addr };
    let cpus = [
        Cpu {
            mpidr: 0,
            enable_method: spin(0x8000_fff8),
        },
        Cpu {
            mpidr: 1,
            enable_method: spin(0x8000_fff0),
        },
        Cpu {
            mpidr: 0x1_0000_0100,
            enable_method: spin(0x8001_1000),
        },
        Cpu {
            mpidr: 0x101,
            enable_method: EnableMethod::Psci,
        },
        Cpu {
            mpidr: 0x102,
            enable_method: EnableMethod::None,
        },
    ];
    assert_eq!(b.cpus.as_slice(), &cpus);
    assert_eq!(b.psci, Some(PsciConduit::Hvc));
    let timer = TimerIrqs {
        secure_phys: Some(29),
        nonsecure_phys: Some(30),
        virt: None,
        hyp_phys: None,
    };
    assert_eq!(b.timer, timer);
    // PSCI wins over the watchdog.
    assert_eq!(b.power_off, PowerOff::Psci(PsciConduit::Hvc));
    assert_eq!(b.bootargs.as_deref(), Some("hv.log=debug quiet"));
}

// ------------------------------------------------------------ Raspberry Pi 4

fn pi4_dtb() -> Vec<u8> {
    // Not HV_PI4_DTB: that is the tree the QEMU tests boot, with the RAM
    // above 1 GiB added (harness::PI4_QEMU_DTB).
    let path = std::env::var_os("HV_PI4_FIRMWARE_DTB")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/fixtures/bcm2711-rpi-4-b.dtb")
        });
    std::fs::read(&path).unwrap_or_else(|e| {
        panic!(
            "cannot read the Pi 4 tree {}: {e}; run `cargo xtask test` to fetch it",
            path.display()
        )
    })
}

/// What the Pi 4 tree says about everything but RAM and /chosen.
fn pi4_common(b: &BoardInfo) {
    assert_eq!(b.model, "Raspberry Pi 4 Model B");
    assert_eq!(b.compatible, "raspberrypi,4-model-b");
    let reserved: Vec<(PhysRange, &str)> = b
        .reserved
        .iter()
        .map(|x| (x.range, x.name.as_str()))
        .collect();
    // /memreserve/ and the spin table cover the same page; the nvram@0 child
    // of /reserved-memory is disabled with size 0 and linux,cma has no reg.
    assert_eq!(
        reserved,
        [
            (sz(0, 0x1000), "/memreserve/"),
            (sz(0, 0x1000), "spin-table")
        ]
    );
    // stdout-path = "serial1:115200n8": the mini UART, bus 0x7e215040.
    let console = Uart {
        kind: UartKind::Bcm2835Aux,
        regs: sz(0xfe21_5040, 0x40),
        intid: Some(32 + 93),
    };
    assert_eq!(b.console, Some(console));
    assert_eq!(b.trace_uart, None);
    let gic = Gic {
        version: GicVersion::V2,
        distributor: sz(0xff84_1000, 0x1000),
        cpu_interface: Some(sz(0xff84_2000, 0x2000)),
        hyp_interface: Some(sz(0xff84_4000, 0x2000)),
        virtual_cpu_interface: Some(sz(0xff84_6000, 0x2000)),
        redistributors: None,
        maintenance_intid: Some(25),
    };
    assert_eq!(b.gic, Some(gic));
    let cpus: Vec<Cpu> = [0xd8, 0xe0, 0xe8, 0xf0]
        .iter()
        .zip(0..)
        .map(|(&release_addr, mpidr)| Cpu {
            mpidr,
            enable_method: EnableMethod::SpinTable { release_addr },
        })
        .collect();
    assert_eq!(b.cpus.as_slice(), cpus.as_slice());
    assert_eq!(b.psci, None);
    let timer = TimerIrqs {
        secure_phys: Some(29),
        nonsecure_phys: Some(30),
        virt: Some(27),
        hyp_phys: Some(26),
    };
    assert_eq!(b.timer, timer);
    // The first reg of the brcm,bcm2711-pm node, bus 0x7e100000.
    assert_eq!(
        b.power_off,
        PowerOff::Bcm2835Watchdog {
            regs: sz(0xfe10_0000, 0x114)
        }
    );
}

/// Debian's tree leaves RAM for the firmware to fill in: `memory@0` has
/// `reg = <0 0 0>`. Discovery must refuse it rather than guess.
#[test]
#[ignore = "needs the Pi 4 tree: cargo xtask test fetches it"]
fn raspberry_pi_4_as_shipped() {
    let blob = pi4_dtb();
    assert_eq!(discover(&blob, 0x100), Err(DiscoveryError::NoMemory));

    // Everything else is there: give the memory node a size, as the firmware
    // does, by patching the third cell of its reg in place.
    let mut patched = blob.clone();
    let fdt = Fdt::new(&blob).unwrap();
    let mem = fdt.root().child(b"memory@0").unwrap();
    let value = mem.prop("reg").unwrap();
    assert_eq!(value, &[0; 12]);
    let at = value.as_ptr() as usize - blob.as_ptr() as usize;
    patched[at + 8..at + 12].copy_from_slice(&0x3c00_0000u32.to_be_bytes());
    let b = discover(&patched, 0x100).unwrap();
    assert_eq!(b.ram.as_slice(), &[sz(0, 0x3c00_0000)]);
    assert_eq!(b.initrd, None);
    assert_eq!(b.bootargs, None);
    pi4_common(&b);

    // A bigger tree with more kinds of node to damage.
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for _ in 0..1000 {
        let mut b = patched.clone();
        let at = rng.below(b.len());
        b[at] = rng.below(8) as u8;
        survives(&b);
    }
}

/// The tree QEMU's `raspi4b` passes to the image: it fills in the memory
/// node and /chosen.
#[test]
#[ignore = "needs the Pi 4 tree: cargo xtask test fetches it"]
fn raspberry_pi_4_under_qemu() {
    let dir = std::env::temp_dir().join(format!("platform-raspi4b-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (dtb, initrd, dump) = (
        dir.join("pi4.dtb"),
        dir.join("initrd"),
        dir.join("dump.dtb"),
    );
    std::fs::write(&dtb, pi4_dtb()).unwrap();
    std::fs::write(&initrd, [0u8; 1000]).unwrap();
    let status = std::process::Command::new("qemu-system-aarch64")
        .arg("-M")
        .arg(format!("raspi4b,dumpdtb={}", dump.display()))
        .arg("-dtb")
        .arg(&dtb)
        .args(["-kernel", "/dev/null", "-initrd"])
        .arg(&initrd)
        .args(["-append", "hv.test=1", "-display", "none", "-nic", "none"])
        .stderr(std::process::Stdio::null())
        .status()
        .expect("qemu-system-aarch64 must be installed");
    assert!(status.success());
    let blob = std::fs::read(&dump).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let b = discover(&blob, 0x100).unwrap();
    // QEMU describes only the RAM below the VideoCore's share of the first GiB.
    assert_eq!(b.ram.as_slice(), &[sz(0, 0x3c00_0000)]);
    // QEMU loads the initrd at 128 MiB and writes two-cell properties.
    assert_eq!(b.initrd, Some(sz(0x800_0000, 1000)));
    assert_eq!(b.bootargs.as_deref(), Some("hv.test=1"));
    pi4_common(&b);
    // QEMU turned the nodes it does not emulate into NOP tokens, on which
    // the fdt crate panics (`fdt_crate_panics_on_nop_tokens_we_read`).
    assert!(fdt_crate_panics(&blob));
}

// --------------------------------------------------------- damaged input

/// Discovery on `blob` must return, whatever it returns.
fn survives(blob: &[u8]) {
    let _ = discover(blob, 0);
}

#[test]
fn header_errors() {
    let mut bad = VIRT_GICV2.to_vec();
    bad[0] = 0;
    let e = discover(&bad, 0).unwrap_err();
    assert_eq!(e, DiscoveryError::BadMagic(0x000d_feed));
    assert_eq!(
        e.to_string(),
        "device tree: bad header magic 0x000dfeed (expected 0xd00dfeed)"
    );
    assert_eq!(
        discover(&[], 0),
        Err(DiscoveryError::Truncated { len: 0, needed: 40 })
    );
    assert_eq!(
        discover(&VIRT_GICV2[..20], 0),
        Err(DiscoveryError::Truncated {
            len: 20,
            needed: 40
        })
    );
    let n = VIRT_GICV2.len();
    assert_eq!(
        discover(&VIRT_GICV2[..n - 1], 0),
        Err(DiscoveryError::Truncated {
            len: n - 1,
            needed: n
        })
    );
    assert_eq!(
        DiscoveryError::NoMemory.to_string(),
        "device tree: no /memory node with a non-empty reg"
    );
    let e = DiscoveryError::TooMany {
        what: "RAM banks",
        max: MAX_RAM_BANKS,
    };
    assert_eq!(e.to_string(), "device tree: more than 8 RAM banks");
}

/// Offsets of the header fields we patch.
const SIZE_DT_STRINGS: usize = 32;
const SIZE_DT_STRUCT: usize = 36;

fn get32(b: &[u8], off: usize) -> u32 {
    u32::from_be_bytes(b[off..off + 4].try_into().unwrap())
}

fn set32(b: &mut [u8], off: usize, v: u32) {
    b[off..off + 4].copy_from_slice(&v.to_be_bytes());
}

#[test]
fn every_truncation() {
    for blob in [VIRT_GICV2, RESERVED] {
        for len in 0..blob.len() {
            assert!(discover(&blob[..len], 0).is_err());
        }
        // A cut blob stops at the header check, so also cut the structure
        // and strings blocks inside an intact blob, at every length.
        for field in [SIZE_DT_STRUCT, SIZE_DT_STRINGS] {
            for size in 0..get32(blob, field) {
                let mut b = blob.to_vec();
                set32(&mut b, field, size);
                assert!(discover(&b, 0).is_err(), "{field} = {size} accepted");
            }
        }
    }
}

/// A small deterministic xorshift generator: no dependency needed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

#[test]
fn random_byte_flips() {
    let mut rng = Rng(0x1234_5678_9abc_def1);
    let mut ok = 0;
    for (blob, rounds) in [(VIRT_GICV2, 3000), (RESERVED, 3000)] {
        for _ in 0..rounds {
            let mut b = blob.to_vec();
            for _ in 0..1 + rng.below(4) {
                let at = rng.below(b.len());
                // Mostly small integers, which is what cell counts, lengths
                // and offsets look like; sometimes anything.
                b[at] = match rng.below(4) {
                    0 => rng.next() as u8,
                    1 => 0xff,
                    _ => rng.below(8) as u8,
                };
            }
            ok += discover(&b, 0).is_ok() as usize;
        }
    }
    // Most flips land in property values and still give a board.
    assert!(ok > 1000, "only {ok} damaged trees were accepted");
}

/// Hand-built damage at the places a reader is most likely to trust.
#[test]
fn hostile_values() {
    // Every 32-bit big-endian word replaced, one at a time, by values that
    // overflow naive arithmetic.
    for blob in [VIRT_GICV2, RESERVED] {
        for word in (0..blob.len() / 4).map(|i| i * 4) {
            for v in [0xffff_ffffu32, 0x4000_0001] {
                let mut b = blob.to_vec();
                set32(&mut b, word, v);
                survives(&b);
            }
        }
    }
}

#[test]
fn cell_counts_and_ranges() {
    // Huge #address-cells on the root: no usable reg anywhere, so no RAM.
    let src = RESERVED;
    let fdt = Fdt::new(src).unwrap();
    let cells = fdt.root().prop("#address-cells").unwrap();
    let at = cells.as_ptr() as usize - src.as_ptr() as usize;
    let mut b = src.to_vec();
    set32(&mut b, at, 0x4000_0000);
    assert_eq!(discover(&b, 0), Err(DiscoveryError::NoMemory));

    // read_cells accepts wide numbers only when the extra cells are zero.
    assert_eq!(
        read_cells(&[0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 2], 3),
        Some(0x1_0000_0002)
    );
    assert_eq!(read_cells(&[0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 2], 3), None);
    assert_eq!(read_cells(&[1, 2, 3], 1), None);
    assert_eq!(read_cells(&[], 0), Some(0));
    assert_eq!(read_cells(&[], usize::MAX), None);
}

#[test]
fn path_and_alias_lookup() {
    let fdt = Fdt::new(RESERVED).unwrap();
    let name = |p: &[u8]| fdt.resolve(p).map(|n| n.name());
    assert_eq!(name(b"serial0"), Some(&b"serial@1,1000"[..]));
    assert_eq!(name(b"/soc/bus/serial"), Some(&b"serial@1,1000"[..]));
    assert_eq!(
        name(b"/soc@f0000000/serial@2000"),
        Some(&b"serial@2000"[..])
    );
    assert_eq!(name(b"/"), Some(&b""[..]));
    assert_eq!(name(b"/nope"), None);
    assert_eq!(name(b"nope"), None);
    assert_eq!(name(b""), None);
    let parent = fdt.resolve(b"serial0").unwrap().parent().unwrap();
    assert_eq!(parent.name(), b"bus@3000000");
    assert_eq!(parent.parent().unwrap().name(), b"soc@f0000000");
}

#[test]
fn too_many_cpus() {
    // Nine CPUs: a tree with more than MAX_CPUS is refused, not truncated.
    let n = MAX_CPUS as u64 + 1;
    let mut dts = String::from("/dts-v1/;\n/ { #address-cells = <1>; #size-cells = <1>;\n");
    dts.push_str("memory@0 { device_type = \"memory\"; reg = <0 0x1000>; };\n");
    dts.push_str("cpus { #address-cells = <1>; #size-cells = <0>;\n");
    for i in 0..n {
        dts.push_str(&format!(
            "cpu@{i} {{ device_type = \"cpu\"; reg = <{i}>; }};\n"
        ));
    }
    dts.push_str("}; };\n");
    let Some(blob) = compile(&dts) else { return };
    let e = discover(&blob, 0).unwrap_err();
    assert_eq!(
        e,
        DiscoveryError::TooMany {
            what: "CPUs",
            max: MAX_CPUS
        }
    );
    assert_eq!(e.to_string(), "device tree: more than 8 CPUs");
}

/// Compiles a small source with dtc, when dtc is installed.
fn compile(dts: &str) -> Option<Vec<u8>> {
    use std::io::Write;
    use std::process::{Command, Stdio};
    let mut child = Command::new("dtc")
        .args(["-q", "-I", "dts", "-O", "dtb"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .ok()?;
    child.stdin.take()?.write_all(dts.as_bytes()).ok()?;
    let out = child.wait_with_output().ok()?;
    assert!(out.status.success(), "dtc failed on:\n{dts}");
    Some(out.stdout)
}

#[test]
fn small_trees() {
    let Some(blob) = compile(
        "/dts-v1/;\n/ { compatible = \"linux,dummy-virt\";\n\
         #address-cells = <2>; #size-cells = <2>;\n\
         memory@0 { device_type = \"memory\"; reg = <0 0 0 0>; }; };\n",
    ) else {
        return;
    };
    assert_eq!(discover(&blob, 0), Err(DiscoveryError::NoMemory));

    // Nine disjoint banks do not fit.
    let mut regs = std::string::String::new();
    for i in 0..9u64 {
        regs.push_str(&format!("<0 {:#x} 0 0x1000> ", i * 0x10000));
    }
    let blob = compile(&format!(
        "/dts-v1/;\n/ {{ #address-cells = <2>; #size-cells = <2>;\n\
         memory@0 {{ device_type = \"memory\"; reg = {}; }}; }};\n",
        regs.trim_end().replace("> <", ">, <")
    ))
    .unwrap();
    assert_eq!(
        discover(&blob, 0),
        Err(DiscoveryError::TooMany {
            what: "RAM banks",
            max: MAX_RAM_BANKS
        })
    );

    // A long bootargs is cut to capacity, never split inside a character;
    // a stdout-path to a UART kind we do not drive is no console, not an
    // error; overlapping RAM entries merge.
    let long = "é".repeat(200);
    let blob = compile(&format!(
        "/dts-v1/;\n/ {{ #address-cells = <1>; #size-cells = <1>;\n\
         chosen {{ bootargs = \"{long}\"; stdout-path = \"/uart@1000\"; }};\n\
         uart@1000 {{ compatible = \"ns16550a\"; reg = <0x1000 0x100>; }};\n\
         memory@0 {{ device_type = \"memory\"; reg = <0x0 0x1000>, <0x800 0x1000>; }}; }};\n"
    ))
    .unwrap();
    let b = discover(&blob, 0).unwrap();
    assert_eq!(b.bootargs.as_deref(), Some("é".repeat(128).as_str()));
    assert_eq!(b.console, None);
    assert_eq!(b.ram.as_slice(), &[r(0, 0x1800)]);
    assert_eq!(b.gic, None);
    assert_eq!(b.power_off, PowerOff::None);
    assert!(b.cpus.is_empty());
}

/// The 8 GiB Pi 4's firmware writes its RAM with one size cell, so the
/// 4 GiB above 4 GiB come as two entries: they make one bank, 35-bit
/// addresses included, and the low-peripheral window stays out.
#[test]
fn eight_gib_pi4_memory_node() {
    let Some(blob) = compile(
        "/dts-v1/;\n/ { compatible = \"raspberrypi,4-model-b\", \"brcm,bcm2711\";\n\
         #address-cells = <2>; #size-cells = <1>;\n\
         memory@0 { device_type = \"memory\"; reg = <0x0 0x0 0x3b400000>, <0x0 0x40000000 0xbc000000>,\n\
         <0x1 0x0 0x80000000>, <0x1 0x80000000 0x80000000>; }; };\n",
    ) else {
        return;
    };
    let b = discover(&blob, 0).unwrap();
    assert_eq!(
        b.ram.as_slice(),
        &[
            r(0, 0x3b40_0000),
            r(0x4000_0000, 0xfc00_0000),
            r(0x1_0000_0000, 0x2_0000_0000)
        ]
    );
    assert_eq!(unsupported_board(&blob), None);
}

#[test]
fn unsupported_boards_are_named() {
    let tree = |compatible: &str| {
        compile(&format!(
            "/dts-v1/;\n/ {{ compatible = {compatible}; #address-cells = <1>; #size-cells = <1>;\n\
             memory@0 {{ device_type = \"memory\"; reg = <0x0 0x40000000>; }}; }};\n"
        ))
    };
    let Some(pi5) = tree(r#""raspberrypi,5-model-b", "brcm,bcm2712""#) else {
        return;
    };
    assert!(unsupported_board(&pi5).is_some_and(|w| w.contains("Raspberry Pi 5")));
    let pi3 = tree(r#""raspberrypi,3-model-b", "brcm,bcm2837""#).unwrap();
    assert!(unsupported_board(&pi3).is_some_and(|w| w.contains("no GIC")));
    for ok in [
        r#""raspberrypi,4-model-b", "brcm,bcm2711""#,
        r#""raspberrypi,400", "brcm,bcm2711""#,
        r#""raspberrypi,4-compute-module", "brcm,bcm2711""#,
        r#""linux,dummy-virt""#,
        r#""vendor,unknown-board""#,
    ] {
        assert_eq!(unsupported_board(&tree(ok).unwrap()), None, "{ok}");
    }
    assert_eq!(unsupported_board(b"garbage"), None);
}

// ------------------------------------------------------- property tests

mod properties {
    use super::*;
    use proptest::prelude::*;
    use proptest::sample::Index;

    /// Values that are structure tokens (1-4, 9), cell counts, lengths or
    /// offsets (small numbers), or overflow naive arithmetic.
    fn word() -> impl Strategy<Value = u32> {
        prop_oneof![0u32..16, Just(u32::MAX), Just(0x4000_0001), any::<u32>()]
    }

    /// A real tree with up to 8 bytes and 4 aligned words replaced, maybe
    /// cut short, and the address the firmware put it at.
    fn damaged_tree() -> impl Strategy<Value = (Vec<u8>, u64)> {
        let blob = prop_oneof![Just(VIRT_GICV2), Just(VIRT_GICV3), Just(RESERVED)];
        let bytes = prop::collection::vec((any::<Index>(), any::<u8>()), 0..8);
        let words = prop::collection::vec((any::<Index>(), word()), 0..4);
        let cut = prop::option::weighted(0.1, any::<Index>());
        (blob, bytes, words, cut, any::<u64>()).prop_map(|(blob, bytes, words, cut, addr)| {
            let mut b = blob.to_vec();
            for (at, v) in bytes {
                b[at.index(blob.len())] = v;
            }
            for (at, v) in words {
                set32(&mut b, at.index(blob.len() / 4) * 4, v);
            }
            if let Some(len) = cut {
                b.truncate(len.index(blob.len()));
            }
            (b, addr)
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(3000))]

        /// Discovery over damaged real trees returns (never panics), and
        /// what it accepts keeps every promise of `BoardInfo`.
        #[test]
        fn damaged_real_trees((blob, addr) in damaged_tree()) {
            if let Ok(info) = discover(&blob, addr) {
                testing::assert_invariants(&blob, addr, &info);
            }
        }
    }
}

// ------------------------------------------------- the `fdt` crate's gaps

/// Whether fdt 0.1.5 panics walking `blob`: every node, the root's
/// children (which skips each child's subtree), a lookup by path.
fn fdt_crate_panics(blob: &[u8]) -> bool {
    std::panic::catch_unwind(|| {
        let tree = ::fdt::Fdt::new(blob).expect("a valid header");
        let root = tree.find_node("/").expect("a root node");
        let nodes = tree.all_nodes().count();
        (
            nodes,
            root.children().count(),
            tree.find_node("/chosen").is_some(),
        )
    })
    .is_err()
}

/// Turns the property whose value is `value` (a slice of `blob`) into NOP
/// tokens, as libfdt's `fdt_nop_property` does: a valid tree.
fn nop_property(blob: &[u8], value: &[u8]) -> Vec<u8> {
    const FDT_NOP: u32 = 4;
    let at = value.as_ptr() as usize - blob.as_ptr() as usize;
    // FDT_PROP, len and nameoff precede the value, which is padded to 4.
    let (start, end) = (at - 12, (at + value.len() + 3) & !3);
    let mut b = blob.to_vec();
    for word in (start..end).step_by(4) {
        set32(&mut b, word, FDT_NOP);
    }
    b
}

/// Why the board tree is read by our own reader and not by the `fdt` crate
/// (docs/ARCHITECTURE.md, "Crates"). First, fdt 0.1.5 panics on NOP tokens
/// between a node's properties or children, which the specification allows
/// and libfdt writes when it deletes in place: QEMU's raspi4b turns the nodes
/// it does not emulate into NOPs (326 tokens; `raspberry_pi_4_under_qemu`).
#[test]
fn fdt_crate_panics_on_nop_tokens_we_read() {
    let tree = Fdt::new(RESERVED).unwrap();
    let serial0 = tree.resolve(b"/aliases").unwrap().prop("serial0").unwrap();
    let blob = nop_property(RESERVED, serial0);
    // The console comes from stdout-path, so the tree means the same board.
    assert_eq!(discover(&blob, 0), discover(RESERVED, 0));
    assert!(!fdt_crate_panics(RESERVED));
    assert!(fdt_crate_panics(&blob));
}

/// Second, fdt 0.1.5's nodes have no parent, so a `reg` on a bus cannot be
/// translated through the buses' `ranges`: it gives the bus address.
#[test]
fn fdt_crate_gives_bus_addresses() {
    let tree = ::fdt::Fdt::new(RESERVED).unwrap();
    let serial = tree
        .find_node("/soc@f0000000/bus@3000000/serial@1,1000")
        .unwrap();
    let reg = serial.reg().unwrap().next().unwrap();
    assert_eq!(reg.starting_address as u64, 0x1_0000_1000);
    let console = discover(RESERVED, 0).unwrap().console.unwrap();
    assert_eq!(console.regs, sz(0xf300_1000, 0x1000));
}
