//! One verb at a time per attachment. The runtime may send DEL while an ADD
//! of the same container and interface is still running (its ADD timed out),
//! or repeat a CHECK; each waits for the one before, so a late step of an
//! ADD can never undo or resurrect what a DEL did. Verbs for different
//! attachments do not wait for each other.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use tokio::sync::{Mutex as TurnLock, OwnedMutexGuard};

use crate::ipam::Key;

#[derive(Default)]
pub struct KeyLocks {
    // Weak: an entry lives as long as a verb holds or waits for it.
    turns: Mutex<HashMap<Key, Weak<TurnLock<()>>>>,
}

impl KeyLocks {
    /// Waits for the attachment's turn; it lasts until the guard is dropped.
    pub async fn turn(&self, key: &Key) -> OwnedMutexGuard<()> {
        let lock = {
            // Never poisoned in practice (no panics while held); a poisoned map is still consistent.
            let mut turns = self.turns.lock().unwrap_or_else(|p| p.into_inner());
            turns.retain(|_, w| w.strong_count() > 0);
            match turns.get(key).and_then(Weak::upgrade) {
                Some(lock) => lock,
                None => {
                    let lock = Arc::new(TurnLock::new(()));
                    turns.insert(key.clone(), Arc::downgrade(&lock));
                    lock
                }
            }
        };
        lock.lock_owned().await
    }

    #[cfg(test)]
    fn tracked(&self) -> usize {
        self.turns.lock().map(|t| t.values().filter(|w| w.strong_count() > 0).count()).unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(id: &str) -> Key {
        Key { container_id: id.into(), ifname: "eth0".into() }
    }

    #[tokio::test]
    async fn the_same_attachment_waits_and_others_do_not() {
        let locks = Arc::new(KeyLocks::default());
        let first = locks.turn(&key("a")).await;
        // Another attachment gets its turn at once.
        let other = locks.turn(&key("b")).await;
        drop(other);
        let (tx, mut rx) = tokio::sync::oneshot::channel();
        let l = Arc::clone(&locks);
        let waiter = tokio::spawn(async move {
            let _t = l.turn(&key("a")).await;
            let _ = tx.send(());
        });
        tokio::task::yield_now().await;
        assert!(rx.try_recv().is_err(), "the second verb ran while the first held the turn");
        drop(first);
        waiter.await.expect("waiter");
        assert_eq!(locks.tracked(), 0, "finished turns are forgotten");
    }
}
