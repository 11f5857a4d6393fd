//! The smallest useful consumer: connect to a running daemon, open a stream over one epoch of a
//! dataset, read every batch in place and release it. It needs only this crate.
//!
//! ```sh
//! cargo run -p gpufeed-client --example client_minimal -- /run/gpufeed.sock DATASET 64
//! ```
//!
//! Each batch prints its step, its sample count and, for each field, its dtype, shape, byte count
//! and first bytes (a field in host memory; on a CUDA device a training process hands the field's
//! device address to its framework instead). `gpufeed consume` is the full-featured consumer.

use gpufeed_client::{Client, FieldData, StreamSpec};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let (Some(socket), Some(dataset), Some(batch_size)) = (args.next(), args.next(), args.next())
    else {
        return Err("usage: client_minimal SOCKET DATASET BATCH_SIZE".into());
    };

    // One session serves one stream. The spec's defaults: every field in its stored dtype, dataset
    // order, epoch 0, host memory, the last partial batch dropped.
    let client = Client::connect(&socket)?;
    let mut stream = client.open_stream(StreamSpec::new(dataset, batch_size.parse()?))?;
    println!("steps {}", stream.layout().steps);

    // The stream is an iterator of batches, in step order, that ends after the epoch.
    let mut batches = 0u64;
    for batch in &mut stream {
        let batch = batch?;
        println!("step {} samples {}", batch.step(), batch.samples());
        for field in batch.fields() {
            let first = match field.data {
                FieldData::Host(bytes) => format!("{:?}", &bytes[..bytes.len().min(8)]),
                FieldData::Device { ptr, .. } => format!("at device address {ptr:#x}"),
            };
            println!(
                "  field {} {:?} shape {:?}: {} bytes, first {first}",
                field.name,
                field.dtype,
                field.shape,
                field.byte_len()
            );
        }
        batches += 1;
        // Dropping the batch releases its slot to the daemon, which refills it.
        drop(batch);
    }
    println!(
        "batches {batches}, resume from cursor {}",
        stream.state().cursor
    );
    Ok(())
}
