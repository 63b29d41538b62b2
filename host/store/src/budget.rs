//! The host-cache byte budget.
//!
//! Default rule: `MemAvailable - max(4 GiB, MemTotal / 8)`. The headroom keeps
//! room for everything that is not routed experts (the process itself, the
//! page cache of mapped dense weights, KV on CPU runs, the rest of the
//! system); scaling with MemTotal keeps large hosts from being run to the
//! edge. An explicit size (`--host-cache GB` / `PULSAR_CACHE_GB`, resolved
//! by the host) replaces the rule entirely.

use crate::error::{Result, StoreError};

const GIB: u64 = 1 << 30;
const MIN_HEADROOM: u64 = 4 * GIB;
/// Below this the cache cannot hold a single step of a real model.
const MIN_BUDGET: u64 = 256 << 20;

/// The default budget from `/proc/meminfo`.
pub fn default_host_budget() -> Result<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").map_err(|e| StoreError::Budget(format!("cannot read /proc/meminfo: {e}")))?;
    host_budget_from_meminfo(&text)
}

/// The default rule applied to the text of `/proc/meminfo`.
pub fn host_budget_from_meminfo(meminfo: &str) -> Result<u64> {
    let field = |name: &str| -> Result<u64> {
        meminfo
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .and_then(|v| v.trim().strip_suffix("kB")?.trim().parse::<u64>().ok())
            .map(|kb| kb * 1024)
            .ok_or_else(|| StoreError::Budget(format!("/proc/meminfo has no readable {name} line")))
    };
    let total = field("MemTotal")?;
    let avail = field("MemAvailable")?;
    let headroom = MIN_HEADROOM.max(total / 8);
    let budget = avail.saturating_sub(headroom);
    if budget < MIN_BUDGET {
        return Err(StoreError::Budget(format!(
            "only {:.1} GiB of RAM available and {:.1} GiB kept as headroom; set the host cache size explicitly",
            avail as f64 / GIB as f64,
            headroom as f64 / GIB as f64
        )));
    }
    Ok(budget)
}

/// An explicit size in GiB (fractions allowed) as bytes.
pub fn budget_from_gib(gib: f64) -> Result<u64> {
    if !gib.is_finite() || gib <= 0.0 || gib > (1u64 << 24) as f64 {
        return Err(StoreError::Budget(format!("host cache size {gib} GiB is not a positive size")));
    }
    Ok((gib * GIB as f64) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(total_gib: u64, avail_gib: u64) -> String {
        format!("MemTotal:       {} kB\nMemFree:        1 kB\nMemAvailable:   {} kB\nBuffers: 0 kB\n", total_gib << 20, avail_gib << 20)
    }

    #[test]
    fn rule_leaves_headroom() {
        // Small host: the 4 GiB floor applies.
        assert_eq!(host_budget_from_meminfo(&info(24, 23)).unwrap(), 19 * GIB);
        // Large host: one eighth of total.
        assert_eq!(host_budget_from_meminfo(&info(512, 500)).unwrap(), 436 * GIB);
        assert!(matches!(host_budget_from_meminfo(&info(8, 4)), Err(StoreError::Budget(_))));
        assert!(host_budget_from_meminfo("MemTotal: 5 kB\n").is_err());
        assert!(host_budget_from_meminfo("garbage").is_err());
    }

    #[test]
    fn live_meminfo_gives_a_plausible_number_or_a_clear_error() {
        match default_host_budget() {
            Ok(b) => assert!(b >= MIN_BUDGET),
            Err(e) => assert!(e.to_string().contains("host budget"), "{e}"),
        }
    }

    #[test]
    fn explicit_sizes() {
        assert_eq!(budget_from_gib(1.5).unwrap(), 3 * GIB / 2);
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            assert!(budget_from_gib(bad).is_err());
        }
    }
}
