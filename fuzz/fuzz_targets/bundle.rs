//! The guest bundle reader over any bytes. Invariants: a bundle it accepts
//! is internally consistent (every VM's blobs lie inside the input, names
//! are valid and unique, counts agree) and survives a round trip through
//! the writer: the rebuilt bundle parses to the same VMs and header flags.
#![no_main]

use guest_bundle::{parse, parse_untrusted, BundleBuilder, PoolSpec, VmMemory, VmSpec};
use libfuzzer_sys::fuzz_target;

fn inside(outer: &[u8], inner: &[u8]) -> bool {
    let (o, i) = (outer.as_ptr() as usize, inner.as_ptr() as usize);
    inner.is_empty() || (i >= o && i + inner.len() <= o + outer.len())
}

fuzz_target!(|data: &[u8]| {
    // The untrusted entry point must agree with the plain one.
    let untrusted = parse_untrusted(data).map(|b| b.vm_count());
    let Ok(bundle) = parse(data) else {
        return;
    };
    assert_eq!(untrusted.ok(), Some(bundle.vm_count()));
    assert!(bundle.total_size() <= data.len() as u64);
    assert!(bundle.header_size() as u64 <= bundle.total_size());
    assert!(inside(data, bundle.as_bytes()));
    assert_eq!(bundle.vms().count(), bundle.vm_count());
    let mut names = Vec::new();
    let mut builder = BundleBuilder::new();
    builder.on_target_tests(bundle.on_target_tests());
    let stop_lowest = bundle.stop_lowest_when_exhausted();
    if bundle.pool_watermarks().is_some() || !stop_lowest {
        let (min, low, high) = bundle.pool_watermarks().unwrap_or((0, 0, 0));
        builder
            .pool(PoolSpec {
                min,
                low,
                high,
                wait: !stop_lowest,
            })
            .expect("the writer takes the pool the reader accepted");
    }
    for (i, vm) in bundle.vms().enumerate() {
        assert_eq!(vm.index(), i);
        assert!(
            guest_bundle::is_valid_name(vm.name()),
            "name {:?}",
            vm.name()
        );
        assert!(!names.contains(&vm.name()), "duplicate name {}", vm.name());
        names.push(vm.name());
        assert!(inside(data, vm.kernel()));
        if let Some(initrd) = vm.initrd() {
            assert!(inside(data, initrd));
        }
        if let Some(c) = vm.cmdline() {
            assert!(inside(data, c.as_bytes()));
        }
        assert_eq!(bundle.find(vm.name()).map(|v| v.index()), Some(i));
        assert_eq!(bundle.vm(i).map(|v| v.name()), Some(vm.name()));
        let memory = VmMemory {
            min: vm.mem_min(),
            low: vm.mem_low(),
            max: vm.mem_max(),
            weight: vm.weight(),
            prealloc: vm.prealloc(),
        };
        builder
            .add_vm_with_memory(
                VmSpec {
                    name: vm.name().to_string(),
                    ram_size: vm.ram_size(),
                    vcpus: vm.vcpus(),
                    cpu_affinity: vm.cpu_affinity(),
                    kernel: vm.kernel().to_vec(),
                    initrd: vm.initrd().map(<[u8]>::to_vec),
                    cmdline: vm.cmdline().map(str::to_string),
                    balloon_features: vm.balloon_features(),
                    devices: vm.devices(),
                    on_bad_access: vm.on_bad_access(),
                    restore: vm.restore().map(String::from),
                },
                memory,
            )
            .expect("the writer takes what the reader accepted");
    }
    assert!(bundle.vm(bundle.vm_count()).is_none());
    let rebuilt = builder.build();
    let again = parse(&rebuilt).expect("a rebuilt bundle parses");
    assert_eq!(again.vm_count(), bundle.vm_count());
    assert_eq!(again.flags(), bundle.flags());
    assert_eq!(again.on_target_tests(), bundle.on_target_tests());
    for (a, b) in again.vms().zip(bundle.vms()) {
        assert_eq!(
            (
                a.name(),
                a.ram_size(),
                a.vcpus(),
                a.cpu_affinity(),
                a.kernel(),
                a.initrd(),
                a.cmdline(),
                a.balloon_features(),
                a.devices(),
                (
                    a.mem_min(),
                    a.mem_low(),
                    a.mem_max(),
                    a.weight(),
                    a.prealloc()
                )
            ),
            (
                b.name(),
                b.ram_size(),
                b.vcpus(),
                b.cpu_affinity(),
                b.kernel(),
                b.initrd(),
                b.cmdline(),
                b.balloon_features(),
                b.devices(),
                (
                    b.mem_min(),
                    b.mem_low(),
                    b.mem_max(),
                    b.weight(),
                    b.prealloc()
                )
            )
        );
    }
    assert_eq!(again.pool_watermarks(), bundle.pool_watermarks());
    assert_eq!(again.stop_lowest_when_exhausted(), stop_lowest);
});
