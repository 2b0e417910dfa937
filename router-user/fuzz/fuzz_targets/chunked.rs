//! The chunked decoder on arbitrary bytes, fed whole and in two pieces: it
//! never panics, never consumes more than it is given, and the split does not
//! change what it decodes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use prefix_router::http::chunked::ChunkedDecoder;

fuzz_target!(|data: &[u8]| {
    let Some((&cut, input)) = data.split_first() else {
        return;
    };
    let mut whole = ChunkedDecoder::new();
    let mut out_whole = Vec::new();
    let res_whole = whole.feed(input, Some(&mut out_whole));
    if let Ok(n) = res_whole {
        assert!(n <= input.len());
        assert_eq!(whole.decoded_len(), out_whole.len() as u64);
    }

    let cut = usize::from(cut).min(input.len());
    let mut split = ChunkedDecoder::new();
    let mut out_split = Vec::new();
    let res_split = split
        .feed(&input[..cut], Some(&mut out_split))
        .and_then(|a| {
            if split.is_done() {
                return Ok(a);
            }
            split
                .feed(&input[cut..], Some(&mut out_split))
                .map(|b| a + b)
        });
    match (res_whole, res_split) {
        (Ok(a), Ok(b)) => {
            assert_eq!(a, b, "consumed the same bytes");
            assert_eq!(out_whole, out_split, "decoded the same body");
            assert_eq!(whole.is_done(), split.is_done());
        }
        (Err(_), Err(_)) => {}
        (a, b) => panic!("split feeding changed the outcome: {a:?} vs {b:?}"),
    }
});
