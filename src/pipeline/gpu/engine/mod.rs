//! The round engine shared by the GPU backend's two assemblers: a batch is built in rounds, each on
//! one of a few sets of fixed round buffers used in turn ([`buffers`]), completed in order
//! ([`complete`]) with the block cache's bookkeeping ([`cache`]), for a stream whose state is the
//! [`rounds::RoundEngine`].

pub(in crate::pipeline::gpu) mod buffers;
pub(in crate::pipeline::gpu) mod cache;
mod complete;
pub(in crate::pipeline::gpu) mod rounds;
