//! Process-wide tables of shared, immutable values built once per key: codebooks, rotations
//! and QJL sketch matrices, which cost far more to build than a kernel call that reads them.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Mutex, OnceLock};

/// Values of type `V` by key `K`, at most `cap` held (the table is emptied when full, so a
/// process that cycles through many keys keeps bounded memory).
pub(crate) struct Memo<K, V> {
    table: OnceLock<Mutex<HashMap<K, Arc<V>>>>,
    cap: usize,
}

impl<K: Eq + Hash + Copy, V> Memo<K, V> {
    pub(crate) const fn new(cap: usize) -> Self {
        Self {
            table: OnceLock::new(),
            cap,
        }
    }

    /// The value of `key`, built by `build` on a miss. `build` runs outside the lock: two
    /// threads may both build one key, and both get equal values.
    pub(crate) fn get_or_try<E>(
        &self,
        key: K,
        build: impl FnOnce() -> Result<V, E>,
    ) -> Result<Arc<V>, E> {
        let table = self.table.get_or_init(|| Mutex::new(HashMap::new()));
        if let Some(v) = table.lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
            return Ok(v.clone());
        }
        let built = Arc::new(build()?);
        let mut guard = table.lock().unwrap_or_else(|e| e.into_inner());
        if guard.len() >= self.cap {
            guard.clear();
        }
        guard.insert(key, built.clone());
        Ok(built)
    }
}

#[cfg(test)]
mod tests {
    use super::Memo;
    use std::sync::Arc;

    #[test]
    fn builds_once_per_key_and_stays_bounded() {
        static M: Memo<u32, String> = Memo::new(2);
        let mut calls = 0;
        let mut get = |k: u32| {
            M.get_or_try(k, || {
                calls += 1;
                Ok::<_, ()>(format!("v{k}"))
            })
            .unwrap()
        };
        let a = get(1);
        assert!(Arc::ptr_eq(&a, &get(1)));
        get(2);
        get(3); // the table was full: emptied, then 3 held
        assert_eq!(*get(1), "v1");
        assert_eq!(calls, 4);
        assert!(M.get_or_try(9, || Err::<String, _>("no")).is_err());
    }
}
