//! graphpp-models: Llama-style decoders built with the graph builder, configs with Hugging Face
//! field names, and the split of a model into pipeline stages (see `docs/ARCHITECTURE.md`, "Models, data, training").

pub mod config;
pub mod flops;
pub mod llama;
pub mod memory;
pub mod mla;
pub mod model;
pub mod moe;
pub mod recompute;
pub mod rng;
pub mod tensor_parallel;

pub use config::{check_supported, HiddenAct, LlamaConfig, ModelError};
pub use flops::flops_per_token;
pub use llama::{
    balanced_split, build_stage, check_shape, init_parameters, layer_checkpoints, split_layers,
    stage_buffer_shapes, stage_buffers, stage_graph_set, stage_parameters, ExpertShard, StageOptions,
    StageSpec, EMBED, LM_HEAD,
};
pub use mla::{MlaConfig, Yarn};
pub use model::{Model, ModelConfig};
pub use moe::{MoeConfig, ScoringFunc, TopkMethod};
pub use recompute::Recompute;
pub use tensor_parallel::TensorShard;
