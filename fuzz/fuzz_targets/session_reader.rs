//! Fuzz the tolerant session reader over arbitrary bytes: it never panics, and whatever it
//! accepts is validated (strictly increasing seq) and rebuilds into a tree.
#![no_main]

use envace::session::{SessionTree, parse_session, render_replay};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(s) = parse_session(data, "fuzz") {
        assert!(s.events.windows(2).all(|w| w[0].seq < w[1].seq));
        let tree = SessionTree::build(&s.events);
        assert_eq!(tree.branch_of.len(), s.events.len());
        let _ = render_replay(&s);
    }
});
