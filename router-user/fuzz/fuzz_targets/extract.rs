//! The prompt extractor on arbitrary bodies for every endpoint: it never
//! panics, and an accepted body extracts the same way twice (the scratch
//! buffers it reuses carry nothing over).
#![no_main]

use libfuzzer_sys::fuzz_target;
use prefix_router::route::extract::{Endpoint, Extractor};

fuzz_target!(|data: &[u8]| {
    let mut ex = Extractor::default();
    for ep in [Endpoint::Chat, Endpoint::Completions, Endpoint::Generate] {
        let mut first = Vec::new();
        let a = ex.extract(ep, data, &mut first);
        let mut second = Vec::new();
        let b = ex.extract(ep, data, &mut second);
        match (a, b) {
            (Ok(a), Ok(b)) => {
                assert_eq!(a, b);
                assert_eq!(first, second);
            }
            (Err(a), Err(b)) => assert_eq!(a.status(), b.status()),
            (a, b) => panic!("extraction is not deterministic: {a:?} vs {b:?}"),
        }
    }
});
