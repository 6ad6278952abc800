//! The one percentile definition of every report and benchmark in this workspace.
//!
//! **Nearest rank**: the p-th percentile of n sorted samples is the sample at 1-based rank
//! `ceil(p/100 · n)` (rank 1 for p = 0). It is always one of the samples (never an
//! interpolation between two), so "p99 = 4.8 ms" means a run really took 4.8 ms.

/// Nearest-rank percentile of `sorted` (ascending); `None` for an empty slice or `p` outside
/// `0..=100`.
pub fn percentile<T: Copy>(sorted: &[T], p: f64) -> Option<T> {
    if sorted.is_empty() || !(0.0..=100.0).contains(&p) {
        return None;
    }
    let n = sorted.len();
    let rank = ((p / 100.0) * n as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, n) - 1])
}

/// Sorts `samples` and returns the nearest-rank percentile (see [`percentile`]).
pub fn percentile_of<T: Copy + PartialOrd>(samples: &mut [T], p: f64) -> Option<T> {
    samples.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    percentile(samples, p)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_matches_the_textbook_examples() {
        // Wikipedia "Percentile", nearest-rank method: 15, 20, 35, 40, 50.
        let v = [15, 20, 35, 40, 50];
        assert_eq!(percentile(&v, 5.0), Some(15));
        assert_eq!(percentile(&v, 30.0), Some(20));
        assert_eq!(percentile(&v, 40.0), Some(20));
        assert_eq!(percentile(&v, 50.0), Some(35));
        assert_eq!(percentile(&v, 100.0), Some(50));
        assert_eq!(percentile(&v, 0.0), Some(15));
    }

    #[test]
    fn p99_of_a_hundred_is_the_99th_and_never_interpolated() {
        let v: Vec<u32> = (1..=100).collect();
        assert_eq!(percentile(&v, 99.0), Some(99));
        assert_eq!(percentile(&v, 99.5), Some(100));
        let two = [1.0, 2.0];
        assert_eq!(percentile(&two, 50.0), Some(1.0));
    }

    #[test]
    fn empty_and_out_of_range_are_none() {
        assert_eq!(percentile::<u32>(&[], 50.0), None);
        assert_eq!(percentile(&[1], 101.0), None);
        assert_eq!(percentile(&[1], -1.0), None);
        let mut v = vec![3.0, 1.0, 2.0];
        assert_eq!(percentile_of(&mut v, 50.0), Some(2.0));
    }
}
