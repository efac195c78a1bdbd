//! The prefix cache for multi-turn work. A hybrid model cannot cut its recurrent state back to an
//! earlier token, so the cache keeps whole-state snapshots taken at chosen tokens (the end of each
//! prompt's history, the end of each answer) and a new prompt resumes from the longest snapshot
//! whose tokens are a prefix of it; only the rest is prefilled. Snapshots are evicted least
//! recently used first, under a memory budget.

/// One snapshot: the state after exactly `tokens`.
struct Entry<S> {
    tokens: Vec<u32>,
    state: S,
    bytes: usize,
    last_used: u64,
}

pub struct PrefixCache<S> {
    entries: Vec<Entry<S>>,
    budget_bytes: usize,
    clock: u64,
    pub hits: u64,
    pub misses: u64,
}

impl<S: Clone> PrefixCache<S> {
    pub fn new(budget_bytes: usize) -> Self {
        PrefixCache { entries: Vec::new(), budget_bytes, clock: 0, hits: 0, misses: 0 }
    }

    /// The longest snapshot that is a proper prefix of `prompt` (at least one prompt token is left
    /// to run), as (its length, a copy of its state).
    pub fn lookup(&mut self, prompt: &[u32]) -> Option<(usize, S)> {
        self.clock += 1;
        let best = self
            .entries
            .iter_mut()
            .filter(|e| e.tokens.len() < prompt.len() && prompt.starts_with(&e.tokens))
            .max_by_key(|e| e.tokens.len());
        match best {
            Some(e) => {
                e.last_used = self.clock;
                self.hits += 1;
                Some((e.tokens.len(), e.state.clone()))
            }
            None => {
                self.misses += 1;
                None
            }
        }
    }

    /// Keeps a snapshot of `state` after `tokens`; evicts the least recently used beyond the budget.
    /// A snapshot larger than the whole budget is not kept.
    pub fn insert(&mut self, tokens: Vec<u32>, state: S, bytes: usize) {
        if bytes > self.budget_bytes || tokens.is_empty() {
            return;
        }
        self.clock += 1;
        self.entries.retain(|e| e.tokens != tokens);
        self.entries.push(Entry { tokens, state, bytes, last_used: self.clock });
        while self.used_bytes() > self.budget_bytes {
            let (i, _) = self.entries.iter().enumerate().min_by_key(|(_, e)| e.last_used).expect("non-empty");
            self.entries.swap_remove(i);
        }
    }

    pub fn used_bytes(&self) -> usize {
        self.entries.iter().map(|e| e.bytes).sum()
    }
    pub fn len(&self) -> usize {
        self.entries.len()
    }
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
    pub fn clear(&mut self) {
        self.entries.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn longest_proper_prefix_wins_and_lru_evicts() {
        let mut c: PrefixCache<u32> = PrefixCache::new(30);
        c.insert(vec![1, 2], 2, 10);
        c.insert(vec![1, 2, 3, 4], 4, 10);
        c.insert(vec![9], 9, 10);
        assert_eq!(c.lookup(&[1, 2, 3, 4, 5]), Some((4, 4)));
        // An exact match leaves nothing to run: the shorter snapshot is used.
        assert_eq!(c.lookup(&[1, 2, 3, 4]), Some((2, 2)));
        assert_eq!(c.lookup(&[7, 7]), None);
        // [9] is now least recently used and goes first.
        c.insert(vec![5, 5], 5, 10);
        assert_eq!(c.lookup(&[9, 9]), None);
        assert_eq!(c.len(), 3);
        assert!(c.used_bytes() <= 30);
        // Too big for the budget: not kept.
        c.insert(vec![8], 8, 31);
        assert_eq!(c.lookup(&[8, 8]), None);
        assert_eq!((c.hits, c.misses), (2, 3));
    }
}
