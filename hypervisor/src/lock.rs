//! The VM lock: a spin lock on which board services (the shell, the memory
//! manager's tick, zeroing ahead, `check`) go before the VM's own vCPUs.
//!
//! A vCPU takes its VM's lock once per exit. Under a flood of exits from
//! every vCPU a plain spin lock is a race the shell can lose for ever, and
//! a ticket lock hands the lock, in order, to waiters whose host threads
//! may not be running under QEMU (the VM's other vCPUs then wait for them,
//! milliseconds at a time, in every burst of console output). This lock
//! stays a spin lock between vCPUs, but a service announces itself first:
//! from then on no vCPU starts to take the lock, so the service gets it
//! after at most the vCPUs already past that check, one acquisition each
//! ([`ServiceFirst::lock_service`]). What a guest does cannot hold a
//! service back longer than one exit per vCPU.

use core::sync::atomic::{AtomicU32, Ordering};

use spin::mutex::{SpinMutex, SpinMutexGuard};
use spin::relax::RelaxStrategy;

/// A spin lock that board services take before vCPUs (module docs).
pub struct ServiceFirst<T, R> {
    lock: SpinMutex<T, R>,
    /// Services waiting for the lock: vCPUs hold back while it is non-zero.
    services_waiting: AtomicU32,
}

impl<T, R: RelaxStrategy> ServiceFirst<T, R> {
    pub const fn new(value: T) -> Self {
        Self {
            lock: SpinMutex::new(value),
            services_waiting: AtomicU32::new(0),
        }
    }

    /// Take the lock for a vCPU's exit: after any service waiting for it.
    #[inline(always)]
    pub fn lock_vcpu(&self) -> SpinMutexGuard<'_, T, R> {
        while self.services_waiting.load(Ordering::Acquire) != 0 {
            R::relax();
        }
        self.lock.lock()
    }

    /// Take the lock for a board service: before any vCPU that has not yet
    /// started to take it.
    pub fn lock_service(&self) -> SpinMutexGuard<'_, T, R> {
        if let Some(guard) = self.lock.try_lock() {
            return guard;
        }
        self.services_waiting.fetch_add(1, Ordering::AcqRel);
        let guard = self.lock.lock();
        self.services_waiting.fetch_sub(1, Ordering::AcqRel);
        guard
    }

    /// The lock if it is free now.
    pub fn try_lock(&self) -> Option<SpinMutexGuard<'_, T, R>> {
        self.lock.try_lock()
    }

    /// Whether a service is waiting (vCPUs hold back).
    pub fn service_waiting(&self) -> bool {
        self.services_waiting.load(Ordering::Acquire) != 0
    }

    /// Release the lock whose guard was abandoned.
    ///
    /// # Safety
    ///
    /// Only for a lock the calling CPU holds and whose guard will never be
    /// used or dropped (a failure jumped over its frame).
    pub unsafe fn force_unlock(&self) {
        // SAFETY: the caller's contract.
        unsafe { self.lock.force_unlock() }
    }
}

#[cfg(test)]
mod tests {
    extern crate std;

    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;
    use std::vec::Vec;

    use spin::relax::Spin;

    use super::*;

    /// A flood of vCPUs taking the lock back to back: a service gets it
    /// after at most one acquisition per vCPU once it waits.
    #[test]
    fn a_service_waits_at_most_one_acquisition_per_vcpu() {
        const VCPUS: u64 = 3;
        // Acquisitions in all, and by vCPUs while a service waited.
        let lock = Arc::new(ServiceFirst::<(u64, u64), Spin>::new((0, 0)));
        let stop = Arc::new(AtomicBool::new(false));
        let floods: Vec<_> = (0..VCPUS)
            .map(|_| {
                let (lock, stop) = (lock.clone(), stop.clone());
                std::thread::spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        let mut g = lock.lock_vcpu();
                        g.0 += 1;
                        // An exit's work under the lock.
                        for _ in 0..200 {
                            core::hint::spin_loop();
                        }
                        if lock.service_waiting() {
                            g.1 += 1;
                        }
                    }
                })
            })
            .collect();
        let mut worst = 0;
        for _ in 0..300 {
            let mut g = lock.lock_service();
            worst = worst.max(g.1);
            g.1 = 0;
            drop(g);
            // Let the flood take the lock again.
            let seen = lock.try_lock().map_or(0, |g| g.0);
            while lock.try_lock().is_some_and(|g| g.0 < seen + 20) {
                std::thread::yield_now();
            }
        }
        stop.store(true, Ordering::Relaxed);
        for f in floods {
            f.join().unwrap();
        }
        assert!(
            worst <= VCPUS,
            "a service waited {worst} vCPU acquisitions (at most {VCPUS})"
        );
    }

    /// While a service waits, a vCPU does not start to take the lock.
    #[test]
    fn vcpus_hold_back_while_a_service_waits() {
        let lock = Arc::new(ServiceFirst::<u32, Spin>::new(0));
        let held = lock.lock_service();
        let service = {
            let lock = lock.clone();
            std::thread::spawn(move || {
                let mut g = lock.lock_service();
                *g = 1;
            })
        };
        while !lock.service_waiting() {
            core::hint::spin_loop();
        }
        let vcpu = {
            let lock = lock.clone();
            std::thread::spawn(move || {
                let mut g = lock.lock_vcpu();
                // The service went first.
                assert_eq!(*g, 1);
                *g = 2;
            })
        };
        drop(held);
        service.join().unwrap();
        vcpu.join().unwrap();
        assert_eq!(*lock.try_lock().unwrap(), 2);
    }
}
