//! The bundle writer (feature `std`), used by the host build tool.

use crate::{
    board_address_bytes, check_cmdline, check_fits, check_memory, check_pool, check_scalars, crc32,
    entry, flags, header, is_valid_name, mem_flags, pool_flags, BoardAddress, NameProblem, VmError,
    BLOB_ALIGN, HEADER_SIZE, HEADER_SIZE_POOL, MAGIC, MAX_VMS, NAME_LEN, VERSION, VM_ENTRY_SIZE,
};

/// One VM to put in a bundle.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VmSpec {
    /// 1 to 32 bytes of `[a-z0-9_-]`, unique within the bundle.
    pub name: String,
    /// Bytes of guest RAM: non-zero, a multiple of 4 KiB, at least kernel plus initrd.
    pub ram_size: u64,
    /// At least 1.
    pub vcpus: u32,
    /// Bit `n`: vCPUs may run on physical CPU `n`. Non-zero.
    pub cpu_affinity: u64,
    /// The kernel image, non-empty.
    pub kernel: Vec<u8>,
    /// The initrd; `Some` must be non-empty.
    pub initrd: Option<Vec<u8>>,
    /// The command line, UTF-8 without NUL; `Some("")` is stored as none.
    pub cmdline: Option<String>,
    /// Virtio balloon feature bits offered; must be 0 without the balloon.
    pub balloon_features: u64,
    /// [`devices`](crate::devices) bits.
    pub devices: u64,
    /// A [`bad_access`](crate::bad_access) code: what the VM gets for an
    /// access the hypervisor refuses.
    pub on_bad_access: u32,
    /// The snapshot it starts from instead of booting: 1 to 32 printable
    /// ASCII characters without spaces.
    pub restore: Option<String>,
}

/// A VM's memory limits, as stored in its entry: 0 means the default, so
/// `VmMemory::default()` is "no limits, weight 100, not preallocated".
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VmMemory {
    /// Bytes never reclaimed; multiple of 4 KiB (0: none).
    pub min: u64,
    /// Bytes reclaimed below only when no VM is above its own low; multiple
    /// of 4 KiB, at least `min` (0: same as `min`).
    pub low: u64,
    /// Bytes never backed above; multiple of 4 KiB, at most the RAM size and
    /// at least `min` and `low` (0: the RAM size).
    pub max: u64,
    /// Reclaim weight, at most 10000 (0: the default, 100).
    pub weight: u32,
    /// All RAM backed at start ([`mem_flags::PREALLOC`]).
    pub prealloc: bool,
}

impl VmMemory {
    fn flags(&self) -> u32 {
        if self.prealloc {
            mem_flags::PREALLOC
        } else {
            0
        }
    }
}

/// The free page pool settings of the header's pool extension. The default
/// (all zero, false) leaves the watermarks to the hypervisor and stops the
/// lowest-weight VM when a vCPU has waited the bound for a frame.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolSpec {
    /// Watermarks in bytes, multiples of 4 KiB: all zero, or all non-zero
    /// with `min <= low <= high`.
    pub min: u64,
    pub low: u64,
    pub high: u64,
    /// [`pool_flags::WAIT`]: vCPUs wait for a frame without bound.
    pub wait: bool,
}

impl PoolSpec {
    fn flags(&self) -> u32 {
        if self.wait {
            pool_flags::WAIT
        } else {
            0
        }
    }
}

/// Builds a bundle: `BundleBuilder::new().add_vm(spec)?...build()`.
#[derive(Clone, Debug, Default)]
pub struct BundleBuilder {
    vms: Vec<(VmSpec, VmMemory)>,
    pool: PoolSpec,
    on_target_tests: bool,
    board_address: Option<BoardAddress>,
}

fn align_up(x: usize) -> usize {
    let a = BLOB_ALIGN as usize;
    x.div_ceil(a) * a
}

impl BundleBuilder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of VMs added so far.
    pub fn len(&self) -> usize {
        self.vms.len()
    }

    pub fn is_empty(&self) -> bool {
        self.vms.is_empty()
    }

    /// Sets the pool extension after checking it against the reader's
    /// rules; on error nothing changes.
    pub fn pool(&mut self, pool: PoolSpec) -> Result<&mut Self, String> {
        check_pool(pool.min, pool.low, pool.high, pool.flags()).map_err(|e| e.to_string())?;
        self.pool = pool;
        Ok(self)
    }

    /// Sets or clears the header flag [`flags::ON_TARGET_TESTS`]: the
    /// hypervisor runs its on-target self-checks once the VMs have started.
    pub fn on_target_tests(&mut self, on: bool) -> &mut Self {
        self.on_target_tests = on;
        self
    }

    /// Sets the board's network address (`[board] address`); `None`: none.
    pub fn board_address(&mut self, address: Option<BoardAddress>) -> &mut Self {
        self.board_address = address;
        self
    }

    /// Adds a VM with the default memory limits; see
    /// [`add_vm_with_memory`](Self::add_vm_with_memory).
    pub fn add_vm(&mut self, spec: VmSpec) -> Result<&mut Self, String> {
        self.add_vm_with_memory(spec, VmMemory::default())
    }

    /// Adds a VM after checking it against every rule the reader applies; on
    /// error nothing is added and the message names the VM and the field.
    pub fn add_vm_with_memory(
        &mut self,
        spec: VmSpec,
        memory: VmMemory,
    ) -> Result<&mut Self, String> {
        let who = if is_valid_name(&spec.name) {
            format!("VM {} (\"{}\")", self.vms.len(), spec.name)
        } else {
            format!("VM {}", self.vms.len())
        };
        let err = |e: VmError| format!("{who}: {e}");
        if self.vms.len() >= MAX_VMS {
            return Err(format!("{who}: a bundle holds at most {MAX_VMS} VMs"));
        }
        if !is_valid_name(&spec.name) {
            let mut raw = [0u8; NAME_LEN];
            let n = spec.name.len().min(NAME_LEN);
            raw[..n].copy_from_slice(&spec.name.as_bytes()[..n]);
            let problem = if spec.name.is_empty() {
                NameProblem::Empty
            } else if spec.name.len() > NAME_LEN {
                NameProblem::TooLong(spec.name.len())
            } else {
                match crate::check_name_chars(spec.name.as_bytes()) {
                    Err(p) => p,
                    Ok(()) => NameProblem::Empty,
                }
            };
            return Err(err(VmError::BadName { raw, problem }));
        }
        if let Some(first) = self.vms.iter().position(|(v, _)| v.name == spec.name) {
            return Err(err(VmError::DuplicateName { first }));
        }
        check_scalars(
            spec.ram_size,
            spec.vcpus,
            spec.cpu_affinity,
            spec.balloon_features,
            spec.devices,
            spec.on_bad_access,
        )
        .map_err(err)?;
        check_memory(
            spec.ram_size,
            memory.min,
            memory.low,
            memory.max,
            memory.weight,
            memory.flags(),
        )
        .map_err(err)?;
        if spec.kernel.is_empty() {
            return Err(err(VmError::EmptyKernel));
        }
        if spec.initrd.as_ref().is_some_and(|i| i.is_empty()) {
            return Err(format!("{who}: initrd is empty (use no initrd instead)"));
        }
        if let Some(c) = &spec.cmdline {
            check_cmdline(c.as_bytes()).map_err(err)?;
        }
        if let Some(r) = &spec.restore {
            if r.is_empty() || r.len() > crate::NAME_LEN {
                return Err(err(VmError::BadRestore));
            }
            let mut raw = [0u8; crate::NAME_LEN];
            raw[..r.len()].copy_from_slice(r.as_bytes());
            crate::check_restore(&raw).map_err(err)?;
        }
        let initrd_len = spec.initrd.as_ref().map_or(0, |i| i.len()) as u64;
        check_fits(spec.kernel.len() as u64, initrd_len, spec.ram_size).map_err(err)?;
        self.vms.push((spec, memory));
        Ok(self)
    }

    /// The bundle: header (always with the pool extension), VM table right after it, then each VM's kernel,
    /// initrd and command line, each starting on a 4 KiB boundary, the whole
    /// padded with zeros to a multiple of 4 KiB. Deterministic: the same VMs
    /// give the same bytes.
    pub fn build(&self) -> Vec<u8> {
        let table_offset = HEADER_SIZE_POOL;
        let table_size = self.vms.len() * VM_ENTRY_SIZE;
        let mut out = vec![0u8; align_up(table_offset + table_size)];

        for (i, (vm, mem)) in self.vms.iter().enumerate() {
            let mut e = [0u8; VM_ENTRY_SIZE];
            e[entry::NAME..entry::NAME + vm.name.len()].copy_from_slice(vm.name.as_bytes());
            put64(&mut e, entry::RAM_SIZE, vm.ram_size);
            put32(&mut e, entry::VCPUS, vm.vcpus);
            put64(&mut e, entry::CPU_AFFINITY, vm.cpu_affinity);
            put64(&mut e, entry::BALLOON_FEATURES, vm.balloon_features);
            put64(&mut e, entry::DEVICES, vm.devices);
            put32(&mut e, entry::ON_BAD_ACCESS, vm.on_bad_access);
            put64(&mut e, entry::MEM_MIN, mem.min);
            put64(&mut e, entry::MEM_LOW, mem.low);
            put64(&mut e, entry::MEM_MAX, mem.max);
            put32(&mut e, entry::MEM_WEIGHT, mem.weight);
            put32(&mut e, entry::MEM_FLAGS, mem.flags());
            if let Some(r) = &vm.restore {
                e[entry::RESTORE..entry::RESTORE + r.len()].copy_from_slice(r.as_bytes());
            }
            let cmdline = vm.cmdline.as_deref().unwrap_or("").as_bytes();
            let blobs: [(usize, &[u8]); 3] = [
                (entry::KERNEL_OFFSET, &vm.kernel),
                (entry::INITRD_OFFSET, vm.initrd.as_deref().unwrap_or(&[])),
                (entry::CMDLINE_OFFSET, cmdline),
            ];
            for (field, data) in blobs {
                if data.is_empty() {
                    continue;
                }
                let offset = out.len();
                out.extend_from_slice(data);
                out.resize(align_up(out.len()), 0);
                put64(&mut e, field, offset as u64);
                put64(&mut e, field + 8, data.len() as u64);
            }
            let at = table_offset + i * VM_ENTRY_SIZE;
            out[at..at + VM_ENTRY_SIZE].copy_from_slice(&e);
        }

        let total = out.len();
        out[header::MAGIC..header::MAGIC + 8].copy_from_slice(&MAGIC);
        put32(&mut out, header::VERSION, VERSION);
        put32(&mut out, header::HEADER_SIZE, HEADER_SIZE_POOL as u32);
        put64(&mut out, header::TOTAL_SIZE, total as u64);
        put32(&mut out, header::VM_COUNT, self.vms.len() as u32);
        put32(&mut out, header::VM_ENTRY_SIZE, VM_ENTRY_SIZE as u32);
        put64(&mut out, header::VM_TABLE_OFFSET, table_offset as u64);
        put64(&mut out, header::VM_TABLE_SIZE, table_size as u64);
        let header_flags = if self.on_target_tests {
            flags::ON_TARGET_TESTS
        } else {
            0
        };
        put32(&mut out, header::FLAGS, header_flags);
        out[header::RESERVED..HEADER_SIZE]
            .copy_from_slice(&board_address_bytes(self.board_address));
        put64(&mut out, header::POOL_MIN, self.pool.min);
        put64(&mut out, header::POOL_LOW, self.pool.low);
        put64(&mut out, header::POOL_HIGH, self.pool.high);
        put32(&mut out, header::POOL_FLAGS, self.pool.flags());
        let crc = crc32(&out[HEADER_SIZE_POOL..]);
        put32(&mut out, header::CRC32, crc);
        debug_assert!(crate::parse(&out).is_ok());
        out
    }
}

pub(crate) fn put32(b: &mut [u8], off: usize, v: u32) {
    b[off..off + 4].copy_from_slice(&v.to_le_bytes());
}

pub(crate) fn put64(b: &mut [u8], off: usize, v: u64) {
    b[off..off + 8].copy_from_slice(&v.to_le_bytes());
}

/// Recomputes and stores the header CRC of a bundle whose contents were
/// edited (tests use it to reach the checks behind the CRC).
#[cfg(test)]
pub(crate) fn fix_crc(b: &mut [u8]) {
    if b.len() < crate::HEADER_SIZE {
        return;
    }
    let hs = crate::read_u32(b, header::HEADER_SIZE) as usize;
    let total = crate::read_u64(b, header::TOTAL_SIZE);
    if hs <= b.len() && total >= hs as u64 && total <= b.len() as u64 {
        let crc = crc32(&b[hs..total as usize]);
        put32(b, header::CRC32, crc);
    }
}
