//! graphpp-models: Llama-style decoders built with the graph builder, configs with Hugging Face
//! field names, and the split of a model into pipeline stages (see `shared/DESIGN.md`, "Models").

pub mod config;
pub mod llama;
pub mod memory;
pub mod rng;

pub use config::{LlamaConfig, ModelError};
pub use llama::{
    build_stage, check_shape, init_parameters, layer_checkpoints, split_layers, stage_buffer_shapes,
    stage_buffers, stage_graph_set, stage_parameters, StageOptions, StageSpec,
};
