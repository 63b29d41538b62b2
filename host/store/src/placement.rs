//! Tier 1: which triples live for good on spare GPUs (their MoE compute runs
//! there and only activations cross the bus). Policy only.
//!
//! Greedy, hottest first by census count (ties in (layer, expert) order,
//! never-seen triples last): each whole triple goes to the device with the
//! most room left that can hold it, which also spreads the hottest experts,
//! and so the compute, across devices. A triple that fits nowhere is skipped
//! and smaller ones are still tried.

use std::collections::{BTreeMap, HashSet};

use serde::{Deserialize, Serialize};

use crate::catalog::Catalog;
use crate::census::Census;

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placement {
    /// (layer, expert) -> device index into `budgets`.
    assignments: BTreeMap<(u32, u32), u32>,
    pub budgets: Vec<u64>,
    pub used: Vec<u64>,
}

impl Placement {
    pub fn device_of(&self, layer: u32, expert: u32) -> Option<u32> {
        self.assignments.get(&(layer, expert)).copied()
    }

    /// (layer, expert) pairs placed on `device`.
    pub fn triples_on(&self, device: u32) -> Vec<(u32, u32)> {
        self.assignments.iter().filter(|(_, &d)| d == device).map(|(&k, _)| k).collect()
    }

    pub fn len(&self) -> usize {
        self.assignments.len()
    }

    pub fn is_empty(&self) -> bool {
        self.assignments.is_empty()
    }

    /// (layer, expert, device) in (layer, expert) order.
    pub fn iter(&self) -> impl Iterator<Item = (u32, u32, u32)> + '_ {
        self.assignments.iter().map(|(&(l, e), &d)| (l, e, d))
    }
}

/// Place triples on devices with byte budgets `budgets` (index = device).
pub fn place_resident(catalog: &Catalog, census: &Census, budgets: &[u64]) -> Placement {
    let mut order: Vec<(u64, u32, u32)> = Vec::new();
    let mut seen = HashSet::new();
    for (l, e, c) in census.hottest() {
        if catalog.triple(l, e).is_some() && seen.insert((l, e)) {
            order.push((c, l, e));
        }
    }
    for t in catalog.triples() {
        if seen.insert((t.layer, t.expert)) {
            order.push((0, t.layer, t.expert));
        }
    }
    let mut p = Placement { assignments: BTreeMap::new(), budgets: budgets.to_vec(), used: vec![0; budgets.len()] };
    for (_, layer, expert) in order {
        let t = catalog.triple(layer, expert).expect("only catalogue triples are ordered");
        let bytes = catalog.triple_bytes(t);
        let best = (0..budgets.len()).filter(|&d| budgets[d] - p.used[d] >= bytes).max_by_key(|&d| (budgets[d] - p.used[d], std::cmp::Reverse(d)));
        if let Some(d) = best {
            p.used[d] += bytes;
            p.assignments.insert((layer, expert), d as u32);
        }
    }
    p
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalog::{SlabId, SlabKind, SlabLoc};
    use pulsar_gguf::GgmlType;

    fn catalog(experts: u32) -> Catalog {
        let loc = SlabLoc { file: 0, offset: 0, bytes: 34, ty: GgmlType::Q8_0, rows: 1, cols: 32 };
        let mut e = Vec::new();
        for l in 0..2 {
            for x in 0..experts {
                for k in [SlabKind::Gate, SlabKind::Up, SlabKind::Down] {
                    e.push((SlabId::new(l, k, x), loc));
                }
            }
        }
        Catalog::new(vec!["f".into()], e).unwrap()
    }

    #[test]
    fn hottest_whole_triples_first_spread_over_devices_within_budget() {
        let cat = catalog(8); // each triple 102 bytes
        let mut c = Census::new();
        c.record(1, 5, 100);
        c.record(0, 2, 90);
        c.record(0, 7, 80);
        c.record(1, 1, 70);
        let p = place_resident(&cat, &c, &[250, 210]);
        // Device 0 has more room first, then they alternate by room left.
        assert_eq!(p.device_of(1, 5), Some(0));
        assert_eq!(p.device_of(0, 2), Some(1));
        assert_eq!(p.device_of(0, 7), Some(0));
        assert_eq!(p.device_of(1, 1), Some(1));
        assert_eq!(p.len(), 4, "no room for a fifth whole triple");
        for d in 0..2 {
            assert!(p.used[d] <= p.budgets[d]);
            assert_eq!(p.used[d], p.triples_on(d as u32).len() as u64 * 102);
        }
    }

    #[test]
    fn spare_room_takes_unseen_triples_and_no_devices_places_nothing() {
        let cat = catalog(2);
        let p = place_resident(&cat, &Census::new(), &[10_000]);
        assert_eq!(p.len(), 4);
        assert!(place_resident(&cat, &Census::new(), &[]).is_empty());
        assert!(place_resident(&cat, &Census::new(), &[101]).is_empty());
    }
}
