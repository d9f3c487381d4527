//! A frame from the agent socket's peer: length header plus JSON body.
#![no_main]

use libfuzzer_sys::fuzz_target;
use volagent::socket::protocol::{RequestFrame, encode, read_frame};

fuzz_target!(|data: &[u8]| {
    let Ok(frame) = read_frame::<RequestFrame>(&mut &data[..]) else { return };
    // A request the agent accepted must encode back to one that reads the
    // same: the driver and the agent share these types.
    let bytes = encode(&frame).expect("a frame that was read encodes");
    let again: RequestFrame = read_frame(&mut bytes.as_slice()).expect("an encoded frame reads");
    assert_eq!(again, frame);
});
