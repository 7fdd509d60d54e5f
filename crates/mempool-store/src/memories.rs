//! The client's cache of the server's memories it has mapped, by the server's memory id: the
//! members of a group share one memory, which the client imports and maps once, however many of
//! them it attaches, in one call or in several. The cache holds [`Weak`] references: a memory's
//! mapping lives while a buffer attached through it does (each holds an [`Arc`]), and is
//! unmapped when the last goes; a later attach of a member of that group imports it again.
//!
//! Generic over what a mapping is, so that the host tests check the sharing without a GPU.
//! Imports nothing of the service but its error type.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use super::error::{Error, Result};

/// What the cache needs of a mapped memory: its size and the device it is on (a server that
/// names one memory id with another size or device is broken or hostile).
pub(crate) trait Mapped {
    /// The memory's whole size in bytes.
    fn memory_size(&self) -> u64;
    /// The device's identity (the server's UUID bytes).
    fn device_uuid(&self) -> [u8; 16];
}

/// Live mappings by memory id.
pub(crate) struct Memories<T>(Mutex<HashMap<u64, Weak<T>>>);

impl<T> Default for Memories<T> {
    fn default() -> Memories<T> {
        Memories(Mutex::new(HashMap::new()))
    }
}

/// The cache, locked: the client holds it across a whole import, so that two threads attaching
/// members of one group do not map its memory twice.
pub(crate) struct Locked<'a, T>(MutexGuard<'a, HashMap<u64, Weak<T>>>);

impl<T: Mapped> Memories<T> {
    /// Locks the cache, dropping the entries of mappings that are gone.
    pub(crate) fn lock(&self) -> Locked<'_, T> {
        let mut map = self.0.lock().unwrap_or_else(|p| p.into_inner());
        map.retain(|_, w| w.strong_count() > 0);
        Locked(map)
    }

    /// How many memories are mapped now (tests).
    #[cfg(test)]
    pub(crate) fn live(&self) -> usize {
        self.lock().0.len()
    }
}

impl<T: Mapped> Locked<'_, T> {
    /// The live mapping of memory `id`, if any, checked against what the server says of it now
    /// (`size` bytes on `device`): a mismatch is a protocol error (the server reused an id).
    pub(crate) fn get(&self, id: u64, size: u64, device: [u8; 16]) -> Result<Option<Arc<T>>> {
        let Some(mapped) = self.0.get(&id).and_then(Weak::upgrade) else {
            return Ok(None);
        };
        if mapped.memory_size() != size || mapped.device_uuid() != device {
            return Err(Error::protocol(format!(
                "the server granted memory {id} as {size} bytes, and earlier as {} bytes (or on another \
                 GPU): a broken or hostile server",
                mapped.memory_size()
            )));
        }
        Ok(Some(mapped))
    }

    /// Records the mapping of memory `id`.
    pub(crate) fn insert(&mut self, id: u64, mapped: &Arc<T>) {
        self.0.insert(id, Arc::downgrade(mapped));
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    /// A stand-in mapping that counts its unmaps.
    struct Fake {
        size: u64,
        unmapped: Arc<AtomicUsize>,
    }

    impl Mapped for Fake {
        fn memory_size(&self) -> u64 {
            self.size
        }
        fn device_uuid(&self) -> [u8; 16] {
            [1; 16]
        }
    }

    impl Drop for Fake {
        fn drop(&mut self) {
            self.unmapped.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn members_share_a_mapping_until_the_last_goes() {
        let memories: Memories<Fake> = Memories::default();
        let unmapped = Arc::new(AtomicUsize::new(0));
        let first = Arc::new(Fake {
            size: 8192,
            unmapped: unmapped.clone(),
        });
        memories.lock().insert(7, &first);
        let second = memories.lock().get(7, 8192, [1; 16]).unwrap().expect("cached");
        assert!(Arc::ptr_eq(&first, &second));
        assert!(memories.lock().get(8, 8192, [1; 16]).unwrap().is_none());
        drop(first);
        assert_eq!(unmapped.load(Ordering::SeqCst), 0, "a member still holds it");
        assert_eq!(memories.live(), 1);
        drop(second);
        assert_eq!(unmapped.load(Ordering::SeqCst), 1);
        assert_eq!(memories.live(), 0);
        assert!(memories.lock().get(7, 8192, [1; 16]).unwrap().is_none());
    }

    #[test]
    fn a_forgotten_member_leaks_only_its_own_reference() {
        let memories: Memories<Fake> = Memories::default();
        let unmapped = Arc::new(AtomicUsize::new(0));
        let mapped = Arc::new(Fake {
            size: 4096,
            unmapped: unmapped.clone(),
        });
        memories.lock().insert(1, &mapped);
        let other = memories.lock().get(1, 4096, [1; 16]).unwrap().unwrap();
        // One member forgotten: nothing unmaps the memory under the other, which stays usable.
        std::mem::forget(mapped);
        drop(other.clone());
        assert_eq!(unmapped.load(Ordering::SeqCst), 0);
        assert_eq!(other.memory_size(), 4096);
        drop(other);
        assert_eq!(
            unmapped.load(Ordering::SeqCst),
            0,
            "the forgotten reference keeps it mapped"
        );
        assert!(memories.lock().get(1, 4096, [1; 16]).unwrap().is_some());
    }

    #[test]
    fn a_memory_id_with_another_size_is_a_protocol_error() {
        let memories: Memories<Fake> = Memories::default();
        let mapped = Arc::new(Fake {
            size: 4096,
            unmapped: Arc::default(),
        });
        memories.lock().insert(3, &mapped);
        let err = memories.lock().get(3, 8192, [1; 16]).err().expect("refused");
        assert!(matches!(err, Error::Protocol { .. }), "{err}");
        assert!(err.to_string().contains("memory 3"), "{err}");
        let err = memories.lock().get(3, 4096, [2; 16]).err().expect("refused");
        assert!(matches!(err, Error::Protocol { .. }), "{err}");
    }
}
