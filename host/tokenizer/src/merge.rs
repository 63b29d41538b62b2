//! The merge loop shared by both vocabularies: symbols in a linked list, candidate pairs in a
//! min-heap keyed by (rank, position). Each merge costs O(log n), so a long word (or a whole
//! SentencePiece text, which is never split into words) stays O(n log n).

use rustc_hash::FxHashMap;
use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// What merging a pair gives: the merged token and the pair's priority (lower first).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Merge {
    pub rank: u32,
    pub id: u32,
}

/// Ranked merges keyed by the (left, right) token pair.
#[derive(Debug, Default)]
pub(crate) struct MergeTable {
    map: FxHashMap<u64, Merge>,
}

fn key(left: u32, right: u32) -> u64 {
    ((left as u64) << 32) | right as u64
}

impl MergeTable {
    pub(crate) fn with_capacity(n: usize) -> MergeTable {
        MergeTable {
            map: FxHashMap::with_capacity_and_hasher(n, Default::default()),
        }
    }

    /// Adds a merge unless the pair already has one (the first, best-ranked, wins).
    pub(crate) fn insert(&mut self, left: u32, right: u32, merge: Merge) {
        self.map.entry(key(left, right)).or_insert(merge);
    }

    pub(crate) fn get(&self, left: u32, right: u32) -> Option<Merge> {
        self.map.get(&key(left, right)).copied()
    }

    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }
}

const NONE: u32 = u32::MAX;

#[derive(Clone, Copy)]
struct Symbol {
    id: u32,
    prev: u32,
    next: u32,
    alive: bool,
}

/// Reusable buffers for [`MergeTable::apply`].
#[derive(Default)]
pub(crate) struct Scratch {
    symbols: Vec<Symbol>,
    heap: BinaryHeap<Reverse<(u32, u32, u32)>>,
}

impl MergeTable {
    /// Merges `ids` in place: repeatedly the best-ranked adjacent pair, the leftmost of equals
    /// (Hugging Face's and llama.cpp's order), until no adjacent pair has a merge.
    pub(crate) fn apply(&self, ids: &mut Vec<u32>, scratch: &mut Scratch) {
        // Positions are u32; an input of 4G symbols is left unmerged rather than mis-linked.
        if ids.len() < 2 || ids.len() >= NONE as usize {
            return;
        }
        let n = ids.len() as u32;
        let symbols = &mut scratch.symbols;
        symbols.clear();
        symbols.extend(ids.iter().enumerate().map(|(i, &id)| Symbol {
            id,
            prev: if i == 0 { NONE } else { i as u32 - 1 },
            next: if i as u32 + 1 == n {
                NONE
            } else {
                i as u32 + 1
            },
            alive: true,
        }));
        let heap = &mut scratch.heap;
        heap.clear();
        for i in 0..n - 1 {
            if let Some(m) = self.get(symbols[i as usize].id, symbols[i as usize + 1].id) {
                heap.push(Reverse((m.rank, i, m.id)));
            }
        }
        while let Some(Reverse((_, pos, new_id))) = heap.pop() {
            let left = symbols[pos as usize];
            if !left.alive || left.next == NONE {
                continue;
            }
            let right = symbols[left.next as usize];
            // A stale entry: one side has merged since it was pushed. The pair's text fixes the
            // merged token, so the pair is current exactly when it still merges into `new_id`.
            if self.get(left.id, right.id).map(|m| m.id) != Some(new_id) {
                continue;
            }
            let right_pos = left.next;
            symbols[pos as usize].id = new_id;
            symbols[pos as usize].next = right.next;
            symbols[right_pos as usize].alive = false;
            if right.next != NONE {
                symbols[right.next as usize].prev = pos;
            }
            if left.prev != NONE {
                let prev = symbols[left.prev as usize];
                if let Some(m) = self.get(prev.id, new_id) {
                    heap.push(Reverse((m.rank, left.prev, m.id)));
                }
            }
            if right.next != NONE {
                if let Some(m) = self.get(new_id, symbols[right.next as usize].id) {
                    heap.push(Reverse((m.rank, pos, m.id)));
                }
            }
        }
        ids.clear();
        ids.extend(symbols.iter().filter(|s| s.alive).map(|s| s.id));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Tokens: 0 a, 1 b, 2 c, 3 ab, 4 bc, 5 abc, 6 aa
    fn table(pairs: &[(u32, u32, u32)]) -> MergeTable {
        let mut t = MergeTable::default();
        for (rank, &(l, r, id)) in pairs.iter().enumerate() {
            t.insert(
                l,
                r,
                Merge {
                    rank: rank as u32,
                    id,
                },
            );
        }
        t
    }

    fn run(t: &MergeTable, ids: &[u32]) -> Vec<u32> {
        let mut v = ids.to_vec();
        t.apply(&mut v, &mut Scratch::default());
        v
    }

    #[test]
    fn best_rank_first() {
        // "abc": bc ranks before ab, so a + bc, and no merge a+bc exists.
        assert_eq!(run(&table(&[(1, 2, 4), (0, 1, 3)]), &[0, 1, 2]), vec![0, 4]);
        assert_eq!(run(&table(&[(0, 1, 3), (1, 2, 4)]), &[0, 1, 2]), vec![3, 2]);
        // chained: ab then ab+c
        assert_eq!(run(&table(&[(0, 1, 3), (3, 2, 5)]), &[0, 1, 2]), vec![5]);
    }

    #[test]
    fn leftmost_of_equal_ranks() {
        // "aaa" with a+a: the left pair merges, leaving "aa a".
        assert_eq!(run(&table(&[(0, 0, 6)]), &[0, 0, 0]), vec![6, 0]);
        assert_eq!(run(&table(&[(0, 0, 6)]), &[0, 0, 0, 0]), vec![6, 6]);
    }

    #[test]
    fn stale_entries_are_skipped() {
        // "abc" with ab (rank 0) and bc (rank 1): after ab, the queued bc entry is stale.
        assert_eq!(
            run(&table(&[(0, 1, 3), (1, 2, 4)]), &[0, 1, 2, 0, 1]),
            vec![3, 2, 3]
        );
    }

    #[test]
    fn long_input_merges_level_by_level() {
        // 200k symbols merge pairwise, three levels deep.
        let t = table(&[(0, 0, 6), (6, 6, 7), (7, 7, 8)]);
        let out = run(&t, &vec![0; 200_000]);
        assert_eq!(out.len(), 25_000);
        assert!(out.iter().all(|&x| x == 8));
    }
}
