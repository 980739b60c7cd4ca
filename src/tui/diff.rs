//! Line alignment (longest common subsequence) for the real-vs-simulated diff and the
//! step-aligned diff of two runs. Inputs are short (a tool response, an episode's steps), so
//! the quadratic table is fine; longer inputs are cut to [`MAX_ITEMS`].

/// Longest prefix aligned by LCS; items past it are paired by position (a 10,000-step diff
/// would need a 400 MB table).
pub const MAX_ITEMS: usize = 2000;

/// One aligned row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Row {
    Same(usize, usize),
    /// Only on the left (removed) / only on the right (added).
    Left(usize),
    Right(usize),
    /// Both sides have an item here, but they differ (a left-only and right-only pair).
    Changed(usize, usize),
}

/// Align `a` and `b` by equality; adjacent left-only/right-only runs are paired as `Changed`.
pub fn align<T: PartialEq>(full_a: &[T], full_b: &[T]) -> Vec<Row> {
    let (a, b) = (
        &full_a[..full_a.len().min(MAX_ITEMS)],
        &full_b[..full_b.len().min(MAX_ITEMS)],
    );
    let (n, m) = (a.len(), b.len());
    let mut t = vec![0u32; (n + 1) * (m + 1)];
    for i in (0..n).rev() {
        for j in (0..m).rev() {
            t[i * (m + 1) + j] = if a[i] == b[j] {
                t[(i + 1) * (m + 1) + j + 1] + 1
            } else {
                t[(i + 1) * (m + 1) + j].max(t[i * (m + 1) + j + 1])
            };
        }
    }
    let mut raw = Vec::new();
    let (mut i, mut j) = (0, 0);
    while i < n || j < m {
        if i < n && j < m && a[i] == b[j] {
            raw.push(Row::Same(i, j));
            i += 1;
            j += 1;
        } else if j >= m || (i < n && t[(i + 1) * (m + 1) + j] >= t[i * (m + 1) + j + 1]) {
            raw.push(Row::Left(i));
            i += 1;
        } else {
            raw.push(Row::Right(j));
            j += 1;
        }
    }
    // Pair runs of removals with the following additions.
    let mut out = Vec::with_capacity(raw.len());
    let mut k = 0;
    while k < raw.len() {
        if let Row::Left(_) = raw[k] {
            let ls: Vec<usize> = raw[k..]
                .iter()
                .map_while(|r| if let Row::Left(x) = r { Some(*x) } else { None })
                .collect();
            let rs: Vec<usize> = raw[k + ls.len()..]
                .iter()
                .map_while(|r| {
                    if let Row::Right(x) = r {
                        Some(*x)
                    } else {
                        None
                    }
                })
                .collect();
            let pairs = ls.len().min(rs.len());
            for p in 0..pairs {
                out.push(Row::Changed(ls[p], rs[p]));
            }
            out.extend(ls[pairs..].iter().map(|x| Row::Left(*x)));
            out.extend(rs[pairs..].iter().map(|x| Row::Right(*x)));
            k += ls.len() + rs.len();
        } else {
            out.push(raw[k]);
            k += 1;
        }
    }
    // Past the aligned prefix: pair by position.
    let (mut i, mut j) = (a.len(), b.len());
    while i < full_a.len() || j < full_b.len() {
        match (i < full_a.len(), j < full_b.len()) {
            (true, true) => out.push(if full_a[i] == full_b[j] {
                Row::Same(i, j)
            } else {
                Row::Changed(i, j)
            }),
            (true, false) => out.push(Row::Left(i)),
            _ => out.push(Row::Right(j)),
        }
        i += usize::from(i < full_a.len());
        j += usize::from(j < full_b.len());
    }
    out
}

/// True when every row is `Same`.
pub fn identical(rows: &[Row]) -> bool {
    rows.iter().all(|r| matches!(r, Row::Same(..)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligns_and_pairs_changes() {
        let a = ["{", "\"x\": 1", "\"y\": 2", "}"];
        let b = ["{", "\"x\": 3", "\"y\": 2", "\"z\": 0", "}"];
        let rows = align(&a, &b);
        assert_eq!(
            rows,
            vec![
                Row::Same(0, 0),
                Row::Changed(1, 1),
                Row::Same(2, 2),
                Row::Right(3),
                Row::Same(3, 4)
            ]
        );
        assert!(!identical(&rows));
        assert!(identical(&align(&a, &a)));
        assert_eq!(align::<u8>(&[], &[1]), vec![Row::Right(0)]);
        let long: Vec<usize> = (0..MAX_ITEMS + 3).collect();
        let mut other = long.clone();
        other[MAX_ITEMS + 1] = 0;
        let rows = align(&long, &other);
        assert_eq!(rows.len(), long.len());
        assert_eq!(
            rows[MAX_ITEMS + 1],
            Row::Changed(MAX_ITEMS + 1, MAX_ITEMS + 1)
        );
    }
}
